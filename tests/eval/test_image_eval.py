"""hayabusa eval with images: the bundled document-image set (its gold is the generator's seeded draw; its pages
are the generator's rendering), items with image parts resolve against the JSONL file's folder only, and the HF
reference runs the VL model. hayabusa's own run needs the VL model (tests/entrypoints/test_image_chat_e2e.py)."""

from __future__ import annotations

import base64
import importlib.util
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from hayabusa.eval import data
from hayabusa.eval.runner import engine_prompt
from hayabusa.errors import HayabusaValidationError

DOC_IMAGES = Path(__file__).resolve().parents[2] / "examples" / "doc_images"


def _generator():
    spec = importlib.util.spec_from_file_location("make_doc_images", DOC_IMAGES / "make_doc_images.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from hayabusa.bench.vl_models import make_vl_model

    out = str(tmp_path_factory.mktemp("vl") / "qwen2.5-vl-tiny")
    make_vl_model("qwen2.5-vl-tiny", out, device="cpu")
    return out


def test_bundled_set_is_the_generators_seeded_draw():
    rows = [json.loads(line) for line in (DOC_IMAGES / "items.jsonl").read_text(encoding="utf-8").splitlines()]
    docs = _generator().draw_documents(0)
    assert [r["id"] for r in rows] == [d["id"] for d in docs] == [
        "receipt-en-0", "receipt-en-1", "notice-en-0", "notice-en-1",
        "receipt-ja-0", "receipt-ja-1", "notice-ja-0", "notice-ja-1"]
    assert [r["gold"] for r in rows] == [d["gold"] for d in docs]
    assert rows[0]["gold"] == {"store": "Copperleaf Coffee", "date": "2025-09-18", "total": 59.51, "currency": "USD",
                               "payment_method": "e-money"}
    assert rows[6]["gold"]["changes"][0] == {"name": "佐藤 美咲", "company": "あおば食品工業株式会社",
                                             "old_position": "品質保証部長", "new_position": "取締役 営業本部長",
                                             "effective_date": "2025-09-07"}
    pages = sorted((DOC_IMAGES / "pages").glob("*.png"))
    assert len(pages) == 12 and sum(p.stat().st_size for p in pages) < 1_000_000


def test_rendering_reproduces_the_committed_pages(tmp_path):
    gen = _generator()
    if gen.find_cjk_font() is None:
        pytest.skip("no CJK font here (apt-get install fonts-ipaexfont-gothic); the committed pages stand")
    gen.build(str(tmp_path))
    assert (tmp_path / "items.jsonl").read_text(encoding="utf-8") == \
        (DOC_IMAGES / "items.jsonl").read_text(encoding="utf-8")
    for page in sorted((DOC_IMAGES / "pages").glob("*.png")):
        assert np.array_equal(np.asarray(Image.open(page)), np.asarray(Image.open(tmp_path / "pages" / page.name)))


def test_items_load_with_their_images_in_order(tiny_vl):
    from transformers import AutoTokenizer

    items = data.load_items(str(DOC_IMAGES / "items.jsonl"), "extraction")
    data.render_items(items, AutoTokenizer.from_pretrained(tiny_vl))
    assert [len(it.images) for it in items] == [1, 1, 2, 2, 1, 1, 2, 2]
    assert all(im.size == (620, 820) and im.mode == "RGB" for it in items for im in it.images)
    first = np.asarray(Image.open(DOC_IMAGES / "pages" / "notice-ja-0-2.png").convert("RGB"))
    assert np.array_equal(np.asarray(items[6].images[1]), first)                 # page 2 of that notice
    pad = 151655
    assert [it.prompt_token_ids.count(pad) for it in items] == [1, 1, 2, 2, 1, 1, 2, 2]
    assert items[2].prompt_text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    p = engine_prompt(items[2])
    assert p["prompt_token_ids"] == items[2].prompt_token_ids and p["multi_modal_data"]["image"] == items[2].images


def _write(tmp_path: Path, content: list) -> str:
    path = tmp_path / "set" / "items.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": content}], "gold": {"x": 1}})
                    + "\n", encoding="utf-8")
    return str(path)


def test_paths_outside_the_files_folder_are_refused(tmp_path, tiny_vl):
    from transformers import AutoTokenizer

    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")
    tok = AutoTokenizer.from_pretrained(tiny_vl)
    for src in ("../outside.png", str(tmp_path / "outside.png"), f"file://{tmp_path / 'outside.png'}"):
        items = data.load_items(_write(tmp_path, [{"type": "image", "image": src}]), "extraction")
        with pytest.raises(HayabusaValidationError, match="item a: messages\\[0\\].content\\[0\\]: .*outside"):
            data.render_items(items, tok)
    items = data.load_items(_write(tmp_path, [{"type": "image", "image": "missing.png"}]), "extraction")
    with pytest.raises(HayabusaValidationError, match="cannot read the image file"):
        data.render_items(items, tok)


def test_data_urls_and_image_url_parts_in_eval_items(tmp_path, tiny_vl):
    from transformers import AutoTokenizer

    buf = io.BytesIO()
    Image.new("RGB", (30, 20), (255, 0, 0)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    Image.new("RGB", (5, 5)).save(tmp_path / "set_page.png")
    (tmp_path / "set").mkdir(exist_ok=True)
    Image.new("RGB", (9, 7)).save(tmp_path / "set" / "page.png")
    items = data.load_items(_write(tmp_path, [{"type": "image_url", "image_url": {"url": url}},
                                              {"type": "image_url", "image_url": {"url": "page.png"}},
                                              {"type": "text", "text": "read"}]), "extraction")
    data.render_items(items, AutoTokenizer.from_pretrained(tiny_vl))
    assert [im.size for im in items[0].images] == [(30, 20), (9, 7)]
    assert items[0].images[0].getpixel((0, 0)) == (255, 0, 0)


def test_images_need_a_template_that_places_them(tmp_path):
    from transformers import AutoTokenizer

    from tests.conftest import TOKENIZERS

    Image.new("RGB", (8, 8)).save(tmp_path / "p.png")
    items = data.load_items(_write(tmp_path, [{"type": "image", "image": "../p.png"}]), "extraction")
    (tmp_path / "set" / "p.png").write_bytes((tmp_path / "p.png").read_bytes())
    items = data.load_items(_write(tmp_path, [{"type": "image", "image": "p.png"}, {"type": "text", "text": "x"}]),
                            "extraction")
    tok = AutoTokenizer.from_pretrained(str(TOKENIZERS / "qwen3"))
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"     # drops every content part
    with pytest.raises(HayabusaValidationError, match="item a: the chat template wrote 0 image placeholder"):
        data.render_items(items, tok)


def test_hf_reference_runs_the_vl_model_on_image_items(tiny_vl):
    from transformers import AutoTokenizer

    from hayabusa.eval.runner import run_hf

    tok = AutoTokenizer.from_pretrained(tiny_vl)
    items = data.load_items(str(DOC_IMAGES / "items.jsonl"), "extraction")[:2]
    data.render_items(items, tok)
    run = run_hf(tiny_vl, items, tok, max_tokens=3, dtype="float32", device="cpu")
    assert run.error is None, run.error
    assert all(isinstance(t, list) and len(t) == 1 for t in run.texts)
    assert 0 < run.output_tokens <= 6
    assert run.prompt_tokens > 2 * 500      # a 620 x 820 page is 22 x 29 merged patches = 638 tokens
