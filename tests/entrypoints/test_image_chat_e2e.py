"""End to end with a real (tiny, random-weight) Qwen2.5-VL: LLM.chat with image parts, the OpenAI server with the
real openai client, `hayabusa eval` on the bundled page images with a max_num_seqs sweep, and W8 on hayabusa.

These need the vision-language core of issue 16 (the Qwen2.5-VL model, ``multi_modal_data`` in the engine,
``limit_mm_per_prompt``); until it is in, the module is skipped with that reason. Everything around the core is
tested without it in test_media.py, test_image_chat_server.py, tests/eval/test_image_eval.py and
tests/bench/test_w8.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hayabusa.model.registry import supported_architectures

if "Qwen2_5_VLForConditionalGeneration" not in supported_architectures():
    pytest.skip("needs the Qwen2.5-VL core of issue 16 (model, multi_modal_data in the engine)",
                allow_module_level=True)

from hayabusa import LLM, SamplingParams  # noqa: E402
from hayabusa.errors import HayabusaValidationError  # noqa: E402
from tests.entrypoints.conftest import Served  # noqa: E402
from tests.entrypoints.test_media import data_url, gradient, image_url_part  # noqa: E402

DOC_IMAGES = Path(__file__).resolve().parents[2] / "examples" / "doc_images"
ENGINE = dict(dtype="float32", device="cpu", max_model_len=4096, max_num_seqs=4, limit_mm_per_prompt={"image": 5})


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    from hayabusa.bench.vl_models import make_vl_model

    out = str(tmp_path_factory.mktemp("vl") / "qwen2.5-vl-tiny")
    make_vl_model("qwen2.5-vl-tiny", out, device="cpu")
    return out


@pytest.fixture(scope="module")
def llm(tiny_vl):
    return LLM(tiny_vl, **ENGINE)


def _messages(*images, text="Extract the fields."):
    return [{"role": "user", "content": [*(image_url_part(data_url(im)) for im in images),
                                         {"type": "text", "text": text}]}]


def test_llm_chat_with_images_equals_hf_greedy(llm, tiny_vl):
    import torch

    from hayabusa.bench.hf_vl import hf_vl_generate, hf_vl_inputs, load_hf_vl

    images = [gradient(120, 90), gradient(60, 200)]
    out = llm.chat(_messages(*images), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)[0]
    model, ip, tok = load_hf_vl(tiny_vl, "float32", torch.device("cpu"))
    inputs = hf_vl_inputs(ip, tok, out.prompt, images)
    assert list(out.outputs[0].token_ids) == hf_vl_generate(model, inputs, 8, ignore_eos=True)


def test_server_image_chat_equals_llm_chat(llm, tiny_vl):
    from hayabusa.entrypoints.media import MediaPolicy

    images = [gradient(64, 48)]
    want = llm.chat(_messages(*images), SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)[0]
    s = Served(tiny_vl, "tiny-vl", app_kwargs={"media_policy": MediaPolicy(max_images=5)},
               **{k: v for k, v in ENGINE.items()})
    try:
        got = s.client().chat.completions.create(model="tiny-vl", messages=_messages(*images), max_tokens=6,
                                                 temperature=0.0)
        assert got.choices[0].message.content == want.outputs[0].text
        import openai

        with pytest.raises(openai.BadRequestError) as e:
            s.client().chat.completions.create(model="tiny-vl", max_tokens=2, messages=[
                {"role": "user", "content": [image_url_part("https://example.com/p.png")]}])
        assert "--allowed-media-domains" in e.value.body["message"]
    finally:
        s.close()


def test_seed_script_shape_runs(tiny_vl):
    """The issue's script: processor chat template text + PIL images, limit 5; 6 images is a clear error and the
    engine serves the next request; multi_modal_data={} is a text-only request."""
    import torch
    from PIL import Image
    from transformers import AutoTokenizer

    llm = LLM(model=tiny_vl, gpu_memory_utilization=0.95, trust_remote_code=True, max_model_len=4096,
              tensor_parallel_size=1, dtype=torch.bfloat16, limit_mm_per_prompt={"image": 5}, seed=0,
              max_num_seqs=14, device="cpu")
    tok = AutoTokenizer.from_pretrained(tiny_vl)

    def prompt(k):
        msgs = [{"role": "user", "content": [{"type": "image"}] * k + [{"type": "text", "text": "JSON please"}]}]
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)

    pages = [Image.fromarray(np.full((80, 60, 3), 30 * i, np.uint8)) for i in range(6)]
    sp = SamplingParams(temperature=0.0, top_p=1, top_k=1, max_tokens=4)
    with pytest.raises(HayabusaValidationError, match="limit_mm_per_prompt"):
        llm.generate([{"prompt": prompt(6), "multi_modal_data": {"image": pages}}], sp)
    outs = llm.generate([{"prompt": prompt(2), "multi_modal_data": {"image": pages[:2]}},
                         {"prompt": prompt(0), "multi_modal_data": {}}], sp)
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]


def test_hayabusa_eval_on_the_bundled_images_with_a_sweep(tiny_vl, capsys):
    from hayabusa.eval.cli import main

    rc = main(["eval", "--model", tiny_vl, "--data", str(DOC_IMAGES / "items.jsonl"), "--task", "extraction",
               "--sweep", "max_num_seqs=1,4,16", "--max-tokens", "8", "--device", "cpu", "--dtype", "float32",
               "--max-model-len", "4096", "--no-tqdm"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "max_num_seqs=1" in out and "max_num_seqs=4" in out and "max_num_seqs=16" in out


def test_bench_w8_on_hayabusa(tiny_vl, tmp_path):
    from hayabusa.bench import cli

    path = tmp_path / "w8.json"
    rc = cli.main(["--workload", "W8", "--model", tiny_vl, "--scale", "0.02", "--device", "cpu", "--no-tqdm",
                   "--sweep", "max_num_seqs=1,4", "--max-model-len", "8192", "--json", str(path)])
    assert rc == 0
    recs = json.loads(path.read_text())
    assert [r["variant"] for r in recs] == [{"max_num_seqs": 1}, {"max_num_seqs": 4}]
    assert all(r["num_requests"] == 2 and r["output_tokens"] == 2 * 5 for r in recs)
