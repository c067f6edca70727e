"""W8 (page images to JSON) and the Qwen2.5-VL model shapes: the workload is BENCHMARKS.md's exactly (its prompt
token count is the one vLLM measured for the issue), random-weight VL checkpoints load with transformers' own
pieces offline, and the HF baseline runs. hayabusa's own W8 run needs the VL model (test_image_chat_e2e.py)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from hayabusa.bench import cli
from hayabusa.bench.vl_models import VL_SHAPES, make_vl_model, vl_shape_config
from hayabusa.bench.workloads import W8_HF_REQUESTS, W8_TEXT, get_workload, image_chat_messages


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("vl") / "qwen2.5-vl-tiny")
    make_vl_model("qwen2.5-vl-tiny", out, device="cpu")
    return out


def test_w8_is_benchmarks_md_exactly(tiny_vl):
    """k, sizes and pixels from one default_rng(0) in BENCHMARKS.md's order; with Qwen2.5-VL's image processor
    limits and chat template the 100 prompts hold 194,935 tokens: the count vLLM 0.25.0 reported for this run."""
    from transformers import AutoTokenizer
    try:   # transformers >= 5.2x: the PIL backend (no torchvision needed); before: beside the torchvision one
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    w = get_workload("W8")
    assert len(w.requests) == 100 and sum(len(r.images) for r in w.requests) == 338
    assert [len(r.images) for r in w.requests[:10]] == [5, 4, 2, 5, 5, 3, 4, 3, 5, 5]
    assert [im.shape for im in w.requests[0].images] == [(580, 838, 3), (702, 992, 3), (534, 690, 3),
                                                         (458, 991, 3), (624, 674, 3)]
    assert w.requests[0].images[0][0, 0].tolist() == [248, 189, 16] and w.requests[0].images[0].dtype == np.uint8
    assert all(r.max_tokens == 256 and r.temperature == 0.0 and r.text == W8_TEXT for r in w.requests)
    assert w.variants == [{"max_num_seqs": m} for m in (1, 4, 8, 14, 16, 32)]
    assert w.engine_defaults == {"max_model_len": 8192, "limit_mm_per_prompt": {"image": 5}}
    tok = AutoTokenizer.from_pretrained(tiny_vl)
    total = 0
    for r in w.requests:
        text = tok.apply_chat_template(image_chat_messages(r), tokenize=False, add_generation_prompt=True)
        total += len(tok(text, add_special_tokens=False).input_ids) - len(r.images)
        for im in r.images:   # the processor's default pixel limits; one token per 28 x 28 pixels after resizing
            h, w_ = smart_resize(im.shape[0], im.shape[1], factor=28, min_pixels=3136, max_pixels=12845056)
            total += (h // 28) * (w_ // 28)
    assert total == 194_935


def test_vl_shapes_have_the_published_parameter_counts():
    """Qwen2.5-VL-7B-Instruct: 8.29 B parameters (676.6 M in the vision tower); 3B-Instruct: 3.75 B."""
    import transformers

    counts = {}
    for name in ("qwen2.5-vl-7b-shape", "qwen2.5-vl-3b-shape"):
        cfg = vl_shape_config(name)
        with torch.device("meta"):
            m = getattr(transformers, cfg.architectures[0])._from_config(cfg)
        counts[name] = (sum(p.numel() for p in m.parameters()),
                        sum(p.numel() for n, p in m.named_parameters() if "visual" in n))
    assert counts == {"qwen2.5-vl-7b-shape": (8_292_166_656, 676_550_144),
                      "qwen2.5-vl-3b-shape": (3_754_622_976, 668_684_288)}
    cfg = vl_shape_config("qwen2.5-vl-7b-shape")
    assert (cfg.vision_config.depth, cfg.vision_config.hidden_size, cfg.vision_config.out_hidden_size) == \
        (32, 1280, 3584)
    assert cfg.get_text_config().num_hidden_layers == 28 and cfg.get_text_config().hidden_size == 3584


def test_tiny_vl_checkpoint_loads_offline_with_transformers_pieces(tiny_vl):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from hayabusa.bench.hf_vl import hf_vl_generate, hf_vl_inputs, load_hf_vl

    ip = AutoImageProcessor.from_pretrained(tiny_vl)
    assert type(ip).__name__.startswith("Qwen2VLImageProcessor") and ip.merge_size == 2 and ip.patch_size == 14
    tok = AutoTokenizer.from_pretrained(tiny_vl)
    text = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                                  {"type": "text", "text": "hi"}]}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 2
    images = [Image.new("RGB", (56, 56)), Image.new("RGB", (112, 84))]
    inputs = hf_vl_inputs(ip, tok, text, images)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]]   # 14-pixel patches
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert int((inputs["input_ids"] == pad).sum()) == 4 + 12               # / (2 x 2 merge)
    model, _, _ = load_hf_vl(tiny_vl, "float32", torch.device("cpu"))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    ids = hf_vl_generate(model, inputs, 4, ignore_eos=True)
    assert len(ids) == 4 and all(0 <= t < 151936 for t in ids)


def test_w8_variants_and_engine_args():
    w = get_workload("W8", 0.01)
    assert len(w.requests) == 1 and w.requests[0].max_tokens == 3
    assert cli._variants(w, None, "hf") == [{"hf_batch_size": 1}]
    assert w.hf_batch1_requests == W8_HF_REQUESTS == 5   # the HF baseline (batch 1) times the first 5 requests
    assert cli._variants(w, None, "hayabusa") == [{"max_num_seqs": m} for m in (1, 4, 8, 14, 16, 32)]
    p = argparse.ArgumentParser()
    cli._add_args(p)
    ns = p.parse_args(["--workload", "W8", "--device", "cpu", "--max-model-len", "4096"])
    args = cli._engine_args(ns, w, {"max_num_seqs": 4})
    assert args["limit_mm_per_prompt"] == {"image": 5} and args["max_model_len"] == 4096   # the flag wins
    assert args["max_num_seqs"] == 4 and args["skip_tokenizer_init"] is False           # the template needs it


def test_bench_hf_w8_runs_on_the_tiny_checkpoint(tiny_vl, tmp_path, capsys, monkeypatch):
    from hayabusa.bench import workloads

    monkeypatch.setattr(workloads, "W8_HF_REQUESTS", 1)   # of the 2 requests at scale 0.02, HF times the first
    out = tmp_path / "w8.json"
    rc = cli.main(["--workload", "W8", "--model", tiny_vl, "--engine", "hf", "--scale", "0.02", "--device", "cpu",
                   "--no-tqdm", "--no-warmup", "--json", str(out)])
    assert rc == 0
    (rec,) = json.loads(out.read_text())
    assert rec["workload"] == "W8" and rec["engine"] == "hf" and rec["variant"] == {"hf_batch_size": 1}
    assert rec["num_requests"] == 1 and rec["output_tokens"] == round(256 * 0.02)   # the first request only
    assert rec["prompt_tokens"] > 1000          # 5 images of ~600 x 800 pixels: hundreds of tokens each
    assert rec["seconds_per_request"] == pytest.approx(rec["elapsed_s"], rel=1e-3)


def test_make_model_cli_writes_a_vl_checkpoint(tmp_path, capsys):
    rc = cli.main(["--make-model", "qwen2-vl-tiny", str(tmp_path / "q2vl"), "--device", "cpu"])
    assert rc == 0
    cfg = json.loads((tmp_path / "q2vl" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2VLForConditionalGeneration"] and cfg["image_token_id"] == 151655
    pp = json.loads((tmp_path / "q2vl" / "preprocessor_config.json").read_text())
    assert pp["processor_class"] == "Qwen2VLProcessor" and pp["max_pixels"] == 12845056
    assert "qwen2.5-vl-7b-shape" in VL_SHAPES
