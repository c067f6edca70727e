"""Chat image parts (entrypoints/media.py): sources, the media policy, decoding limits, and the chat prompt they
become (Qwen2-VL's chat template, the Qwen tokenizer). Nothing here needs a vision model."""

from __future__ import annotations

import base64
import http.server
import io
import os
import struct
import threading
import zlib

import numpy as np
import pytest
from PIL import Image

from hayabusa.assets import qwen2_vl_chat_template
from hayabusa.entrypoints.chat_utils import chat_prompt
from hayabusa.entrypoints.media import (MediaPolicy, check_placeholders, decode_image, extract_images,
                                        load_image_url)
from hayabusa.errors import HayabusaValidationError
from tests.conftest import TOKENIZERS


def png_bytes(img: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def data_url(img: Image.Image, fmt: str = "PNG") -> str:
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(png_bytes(img, fmt)).decode()


def gradient(w: int, h: int) -> Image.Image:
    x = np.arange(w, dtype=np.uint8)[None, :, None].repeat(h, 0)
    y = np.arange(h, dtype=np.uint8)[:, None, None].repeat(w, 1)
    return Image.fromarray(np.concatenate([x, y, (x + y)], axis=2).astype(np.uint8))


def user(*parts):
    return [{"role": "user", "content": list(parts)}]


def image_url_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def qwen_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(TOKENIZERS / "qwen3"))


# ------------------------------------------------------------------------------------------------ data URLs
def test_data_url_decodes_to_the_same_pixels():
    img = gradient(37, 21)
    out = load_image_url(data_url(img), "m")
    assert out.size == (37, 21) and out.mode == "RGB"
    assert np.array_equal(np.asarray(out), np.asarray(img))
    jpeg = load_image_url(data_url(img, "JPEG"), "m")          # lossy, but the same size
    assert jpeg.size == (37, 21)


@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,@@@@", "not valid base64"),
    ("data:image/png," + "iVBORw0KGgo=", "must be base64"),
    ("data:text/plain;base64," + base64.b64encode(b"hello").decode(), "'text/plain' is not an image"),
    ("data:image/png;base64," + base64.b64encode(b"hello, not a png").decode(), "not an image in a supported"),
    ("ftp://example.com/a.png", "must be a data: URL"),
])
def test_bad_image_urls_name_the_message_and_part(url, words):
    messages = [{"role": "system", "content": "s"}, *user({"type": "text", "text": "x"}, image_url_part(url))]
    with pytest.raises(HayabusaValidationError) as e:
        extract_images(messages)
    assert str(e.value).startswith("messages[1].content[1]: ") and words in str(e.value)
    assert e.value.parameter == "messages"


def test_format_outside_the_allowed_list_is_refused():
    tiff = png_bytes(gradient(8, 8), "TIFF")
    assert Image.open(io.BytesIO(tiff)).format == "TIFF"          # Pillow itself would decode it
    with pytest.raises(HayabusaValidationError, match="supported format"):
        decode_image(tiff, "m")


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (1-bit grey) with a few bytes of pixel data."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


def test_decompression_bomb_is_refused_from_the_header():
    bomb = _png_header_only(30_000, 30_000)           # 900 M pixels in < 100 bytes
    assert len(bomb) < 100
    with pytest.raises(HayabusaValidationError, match="too large to decode|pixels") as e:
        decode_image(bomb, "messages[0].content[0]")
    assert str(e.value).startswith("messages[0].content[0]: ")
    # under Pillow's hard limit but over the policy's cap: refused by the header check, before decoding
    with pytest.raises(HayabusaValidationError, match="is 20 x 20 pixels; at most 100"):
        decode_image(png_bytes(gradient(20, 20)), "m", MediaPolicy(max_image_pixels=100))


def test_encoded_byte_cap_is_checked_before_decoding():
    big = data_url(Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)))
    with pytest.raises(HayabusaValidationError, match="more than 1000 bytes"):
        load_image_url(big, "m", MediaPolicy(max_image_bytes=1000))


def test_truncated_png_is_a_validation_error():
    data = png_bytes(Image.fromarray(np.random.default_rng(1).integers(0, 256, (40, 40, 3), dtype=np.uint8)))
    with pytest.raises(HayabusaValidationError, match="could not be decoded"):
        decode_image(data[: len(data) // 2], "m")


# ------------------------------------------------------------------------------------------------ local files
def test_local_files_only_under_the_allowed_folder(tmp_path):
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png_bytes(gradient(5, 6)))
    (tmp_path / "secret.png").write_bytes(png_bytes(gradient(7, 8)))
    os.symlink(tmp_path / "secret.png", media / "link.png")
    url = f"file://{media / 'a.png'}"
    with pytest.raises(HayabusaValidationError, match="--allowed-local-media-path") as e:
        load_image_url(url, "m")                                  # off by default
    assert "allowed_local_media_path" in str(e.value)
    policy = MediaPolicy.from_engine_args(type("A", (), {"allowed_local_media_path": str(media)})())
    assert load_image_url(url, "m", policy).size == (5, 6)
    for outside in (f"file://{tmp_path / 'secret.png'}", f"file://{media}/../secret.png", f"file://{media / 'link.png'}"):
        with pytest.raises(HayabusaValidationError, match="outside the allowed local media folder"):
            load_image_url(outside, "m", policy)


def test_policy_from_engine_args_checks_its_values(tmp_path):
    from hayabusa.config import EngineArgs

    with pytest.raises(HayabusaValidationError) as e:
        MediaPolicy.from_engine_args(EngineArgs(model="x", allowed_local_media_path=str(tmp_path / "nope")))
    assert e.value.parameter == "allowed_local_media_path"
    with pytest.raises(HayabusaValidationError) as e:
        MediaPolicy.from_engine_args(EngineArgs(model="x", allowed_media_domains=[3]))
    assert e.value.parameter == "allowed_media_domains"
    p = MediaPolicy.from_engine_args(EngineArgs(model="x", allowed_media_domains=["Example.COM", "b.org"]))
    assert p.allowed_media_domains == ("example.com", "b.org") and p.allowed_local_media_path is None


def test_server_flags_parse_to_engine_args():
    import argparse

    from hayabusa.config import EngineArgs

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    ns = p.parse_args(["--allowed-media-domains", "a.com", "b.org", "--allowed-local-media-path", "/data"])
    kw = EngineArgs.cli_kwargs(ns)
    assert kw["allowed_media_domains"] == ["a.com", "b.org"] and kw["allowed_local_media_path"] == "/data"


# ------------------------------------------------------------------------------------------------ http(s)
class _Handler(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict, bytes]] = {}

    def do_GET(self):  # noqa: N802
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def http_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", _Handler.routes
    srv.shutdown()
    srv.server_close()


def test_remote_fetching_is_off_by_default_and_names_the_flag(http_server):
    base, routes = http_server
    routes["/a.png"] = (200, {"Content-Type": "image/png"}, png_bytes(gradient(9, 4)))
    with pytest.raises(HayabusaValidationError, match="--allowed-media-domains") as e:
        load_image_url(base + "/a.png", "messages[0].content[0]")
    assert "fetching remote images is off" in str(e.value)
    with pytest.raises(HayabusaValidationError, match="host '127.0.0.1' is not among the allowed"):
        load_image_url(base + "/a.png", "m", MediaPolicy(allowed_media_domains=("example.com",)))
    allowed = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    assert load_image_url(base + "/a.png", "m", allowed).size == (9, 4)


def test_redirects_and_size_are_checked(http_server):
    base, routes = http_server
    routes["/away"] = (302, {"Location": "http://localhost:1/x.png"}, b"")
    routes["/big.png"] = (200, {}, b"\0" * 5000)
    routes["/missing"] = (404, {}, b"")
    allowed = MediaPolicy(allowed_media_domains=("127.0.0.1",), max_image_bytes=4096)
    with pytest.raises(HayabusaValidationError, match="host 'localhost' is not among"):
        load_image_url(base + "/away", "m", allowed)
    with pytest.raises(HayabusaValidationError, match="more than 4096 bytes"):
        load_image_url(base + "/big.png", "m", allowed)
    with pytest.raises(HayabusaValidationError, match="could not fetch the image"):
        load_image_url(base + "/missing", "m", allowed)


# ------------------------------------------------------------------------------------------------ messages
def test_extract_images_keeps_order_and_replaces_parts():
    a, b, c = gradient(3, 4), gradient(5, 6), np.full((7, 8, 3), 200, np.uint8)
    messages = [{"role": "system", "content": "sys"},
                *user({"type": "text", "text": "first"}, image_url_part(data_url(a)), {"type": "image_pil", "image_pil": b}),
                {"role": "assistant", "content": "ok"},
                *user({"type": "image", "image": c}, {"type": "text", "text": "last"})]
    out, images = extract_images(messages, allow_objects=True)
    assert [im.size for im in images] == [(3, 4), (5, 6), (8, 7)]
    assert out[1]["content"] == [{"type": "text", "text": "first"}, {"type": "image"}, {"type": "image"}]
    assert out[3]["content"] == [{"type": "image"}, {"type": "text", "text": "last"}]
    assert out[0] is messages[0] and out[2] is messages[2]        # messages without images untouched
    assert messages[1]["content"][1]["type"] == "image_url"       # the caller's list is not changed
    with pytest.raises(HayabusaValidationError, match="must be URLs here"):
        extract_images(messages)                                  # the server: no Python objects


def test_too_many_images_is_refused_before_decoding():
    bad = image_url_part("data:image/png;base64,@@")              # would fail to decode
    with pytest.raises(HayabusaValidationError, match="at most 2 may be given") as e:
        extract_images(user(bad, bad, bad), MediaPolicy(max_images=2))
    assert e.value.parameter == "limit_mm_per_prompt"


def test_total_pixels_of_a_prompt_are_capped():
    part = image_url_part(data_url(gradient(10, 10)))           # 100 pixels each
    _, images = extract_images(user(part, part, part), MediaPolicy(max_total_pixels=300))
    assert len(images) == 3
    with pytest.raises(HayabusaValidationError) as e:
        extract_images(user(part, part, part, part), MediaPolicy(max_total_pixels=350))
    assert str(e.value).startswith("messages[0].content[3] (the prompt's images may hold 350 pixels in all): ")
    many = user(*[image_url_part("data:image/png;base64,@@")] * 257)   # refused before any decoding
    with pytest.raises(HayabusaValidationError, match="257 images; at most 256"):
        extract_images(many)


def test_chat_prompt_renders_qwen2_vl_placeholders(qwen_tokenizer):
    imgs = [gradient(10, 12), gradient(30, 20)]
    messages = user(image_url_part(data_url(imgs[0])), {"type": "image_pil", "image_pil": imgs[1]},
                    {"type": "text", "text": "Extract the fields as JSON."})
    p = chat_prompt(qwen_tokenizer, messages, chat_template=qwen2_vl_chat_template())
    assert p["prompt"] == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                           "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|><|vision_end|>"
                           "Extract the fields as JSON.<|im_end|>\n<|im_start|>assistant\n")
    pad = qwen_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert p["prompt_token_ids"].count(pad) == 2
    assert p["prompt_token_ids"] == qwen_tokenizer.encode(p["prompt"], add_special_tokens=False)
    assert [np.asarray(i).tolist() for i in p["multi_modal_data"]["image"]] == [np.asarray(i).tolist() for i in imgs]
    text_only = chat_prompt(qwen_tokenizer, user({"type": "text", "text": "hi"}, {"type": "text", "text": "there"}),
                            chat_template=qwen2_vl_chat_template())
    assert "multi_modal_data" not in text_only and "hi\nthere" in text_only["prompt"]   # flattened as before


def test_text_only_template_with_an_image_is_a_clear_error(qwen_tokenizer):
    messages = user({"type": "image_pil", "image_pil": gradient(4, 4)}, {"type": "text", "text": "hi"})
    with pytest.raises(HayabusaValidationError, match="1 image.*multimodal chat template"):
        chat_prompt(qwen_tokenizer, messages)                     # Qwen3's own template renders strings only
    plain = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is string else '' }}{% endfor %}"
    with pytest.raises(HayabusaValidationError, match="wrote 0 image placeholder"):
        chat_prompt(qwen_tokenizer, messages, chat_template=plain)   # renders, but drops the image


def test_check_placeholders_counts():
    check_placeholders("a<|image_pad|>b<|image_pad|>", 2)
    with pytest.raises(HayabusaValidationError, match="wrote 1 image placeholder"):
        check_placeholders("<|image_pad|>", 2)


def test_llm_chat_passes_images_to_generate(stories_dir, monkeypatch):
    from hayabusa import LLM

    llm = LLM(stories_dir, max_model_len=128, max_num_seqs=2)
    seen = []
    monkeypatch.setattr(llm, "generate", lambda prompts, params=None, use_tqdm=True: seen.extend(prompts) or [])
    # chat() alone is under test: the (text-only) model stands in for a vision model
    monkeypatch.setattr(llm.llm_engine.input_processor, "mm_processor", object())
    img = gradient(6, 9)
    llm.chat([user({"type": "text", "text": "once"}, {"type": "image_pil", "image_pil": img}),
              user({"type": "text", "text": "no image"})], chat_template=qwen2_vl_chat_template())
    assert seen[0]["prompt"].count("<|image_pad|>") == 1 and seen[0]["multi_modal_data"]["image"][0].size == (6, 9)
    assert "multi_modal_data" not in seen[1]
    with pytest.raises(HayabusaValidationError, match="--allowed-media-domains"):
        llm.chat(user(image_url_part("https://example.com/a.png")), chat_template=qwen2_vl_chat_template())
