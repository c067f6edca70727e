"""/v1/chat/completions with image parts, through a real server and the real openai client: the images are decoded
on the preprocessing threads and handed to the engine as ``multi_modal_data`` in order; refused sources and bad
images are OpenAI-shaped 400s. The engine here is a text model (the vision model's own tests are in
test_image_chat_e2e.py), so the recorded images are stripped before the text model runs."""

from __future__ import annotations

import threading

import numpy as np
from PIL import Image
import pytest

from hayabusa.assets import qwen2_vl_chat_template
from hayabusa.entrypoints.media import MediaPolicy
from tests.entrypoints.conftest import Served
from tests.entrypoints.test_media import data_url, gradient, image_url_part


@pytest.fixture(scope="module")
def vl_server(tiny_qwen2, tmp_path_factory):
    media = tmp_path_factory.mktemp("media")
    gradient(11, 13).save(media / "page.png")
    s = Served(tiny_qwen2, "tiny-vl", chat_template=qwen2_vl_chat_template(), max_model_len=256,
               app_kwargs={"media_policy": MediaPolicy(allowed_local_media_path=str(media), max_images=3)})
    s.media = media
    serving = s.app.state.serving
    serving.takes_images = True      # the text model stands in for a vision model (a text model refuses images)
    s.seen, s.threads = [], []
    add = serving.engine.add_request

    async def recording_add(rid, prompt, params, *a, **kw):
        s.seen.append(prompt)
        prompt = {k: v for k, v in prompt.items() if k != "multi_modal_data"}
        return await add(rid, prompt, params, *a, **kw)

    serving.engine.add_request = recording_add
    import hayabusa.entrypoints.openai.serving as serving_mod

    extract = serving_mod.extract_images

    def recording_extract(*a, **kw):
        s.threads.append(threading.current_thread().name)
        return extract(*a, **kw)

    serving_mod.extract_images = recording_extract
    yield s
    serving_mod.extract_images = extract
    s.close()


def test_image_chat_reaches_the_engine_in_order(vl_server):
    s = vl_server
    s.seen.clear()
    a, b = gradient(20, 10), gradient(7, 30)
    out = s.client().chat.completions.create(
        model="tiny-vl", max_tokens=3, temperature=0.0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Read these."},
                                                image_url_part(data_url(a)),
                                                image_url_part(f"file://{s.media / 'page.png'}"),
                                                image_url_part(data_url(b))]}])
    assert out.choices[0].finish_reason == "length"
    (prompt,) = s.seen
    assert prompt["prompt"].count("<|vision_start|><|image_pad|><|vision_end|>") == 3
    images = prompt["multi_modal_data"]["image"]
    assert [im.size for im in images] == [(20, 10), (11, 13), (7, 30)]
    assert np.array_equal(np.asarray(images[0]), np.asarray(a))
    assert s.threads and all(t.startswith("hayabusa-preprocess") for t in s.threads)   # never the event loop


@pytest.mark.parametrize("url, words", [
    ("https://example.com/page.png", "--allowed-media-domains"),
    ("file:///etc/hostname", "outside the allowed local media folder"),
    ("data:image/png;base64,%%%", "messages[0].content[1]: the data URL's payload is not valid base64"),
])
def test_refused_or_bad_images_are_400(vl_server, url, words):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        vl_server.client().chat.completions.create(
            model="tiny-vl", max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image_url_part(url)]}])
    assert e.value.status_code == 400 and words in e.value.body["message"]
    assert e.value.body["param"] == "messages"


def test_more_images_than_the_limit_is_400(vl_server):
    import openai

    part = image_url_part(data_url(gradient(4, 4)))
    with pytest.raises(openai.BadRequestError) as e:
        vl_server.client().chat.completions.create(model="tiny-vl", max_tokens=2,
                                                   messages=[{"role": "user", "content": [part] * 4}])
    assert "4 images; at most 3" in e.value.body["message"] and e.value.body["param"] == "limit_mm_per_prompt"


def test_text_only_chat_still_has_no_multi_modal_data(vl_server):
    s = vl_server
    s.seen.clear()
    s.client().chat.completions.create(model="tiny-vl", max_tokens=2,
                                       messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert "multi_modal_data" not in s.seen[0]


def test_a_data_url_counts_towards_the_body_limit(tiny_qwen2):
    import httpx

    s = Served(tiny_qwen2, "tiny-vl", chat_template=qwen2_vl_chat_template(), max_model_len=256,
               app_kwargs={"max_request_body_bytes": 8192})
    try:
        def body(n: int) -> dict:
            img = gradient(4, 4) if n == 0 else Image.fromarray(
                np.random.default_rng(0).integers(0, 256, (n, n, 3), dtype=np.uint8))
            return {"model": "tiny-vl", "max_tokens": 1, "messages": [
                {"role": "user", "content": [image_url_part(data_url(img)), {"type": "text", "text": "x"}]}]}

        small = httpx.post(s.url + "/v1/chat/completions", json=body(0), timeout=30)
        # past the body check (a text model's engine may then refuse the images with a 400, or run them)
        assert small.status_code in (200, 400) and small.status_code != 413
        big = httpx.post(s.url + "/v1/chat/completions", json=body(64), timeout=30)   # ~16 KB of base64
        assert big.status_code == 413
    finally:
        s.close()
