"""Report 003 (receipt extraction with T5: T5-base -> T5-small, fp32 -> fp16 with TensorRT, 0.742 s -> 0.131 s per
receipt). The report shows no vLLM code (it served T5 through TensorRT on Vertex AI); this module holds the
vLLM-style script such a user would write against hayabusa's T5 support (written here, not copied: the report's
own code blocks are a Dockerfile), run on a tiny random T5 v1.0 (T5-small's architecture: ReLU FFN, tied head)
with a real SentencePiece tokenizer, over hayabusa's bundled receipts set. Checks: one output per receipt in input
order; fp32 greedy equals HF Transformers' float32 greedy on the same weights (up to and including EOS); fp16 (the
report's TensorRT precision) equals HF's fp16 greedy and lies within a near-tie of the float32 argmax; the
receipts' latency is measured."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.helpers import assert_near_greedy, greedy_margins
from tests.models._t5 import hf_t5, hf_t5_greedy, save_tiny_t5

MAX_TOKENS = 24   # the tiny model's JSON is random text; 24 tokens keep the tier fast


def run_user_script(MODEL_DIR, DTYPE):
    """A vLLM user's receipt extractor (offline batch, greedy, as the TensorRT service decodes)."""
    from hayabusa import LLM, SamplingParams   # a vLLM user writes ``from vllm import LLM, SamplingParams``
    from hayabusa.assets import receipts_data_path

    llm = LLM(model=MODEL_DIR, dtype=DTYPE, max_num_seqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    with open(receipts_data_path(), encoding="utf-8") as f:
        receipts = [json.loads(line) for line in f]
    prompts = [r["prompt"] for r in receipts]

    start = time.time()
    outputs = llm.generate(prompts, params)
    per_receipt = (time.time() - start) / len(receipts)
    print(f"{DTYPE}: {per_receipt:.4f} s per receipt")
    for r, o in zip(receipts, outputs):
        print(r["id"], o.outputs[0].text)
    return prompts, outputs, llm


@pytest.fixture(scope="module")
def t5_small_dir(tmp_path_factory) -> str:
    return save_tiny_t5(tmp_path_factory.mktemp("seed003_t5"), "v1.0", initializer_factor=1.0)


def _check_shape(prompts, outputs, eos):
    assert len(outputs) == len(prompts) == 5
    for p, o in zip(prompts, outputs):
        c = o.outputs[0]
        assert o.prompt == p and o.finished and len(o.outputs) == 1 and c.token_ids
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1]
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS and eos not in c.token_ids


def test_seed003_fp32_equals_hf_and_fp16_near_argmax(t5_small_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(t5_small_dir)
    prompts, outs32, llm = run_user_script(t5_small_dir, "float32")
    eos = tok.eos_token_id
    _check_shape(prompts, outs32, eos)
    enc = [tok(p).input_ids for p in prompts]
    ref = hf_t5_greedy(t5_small_dir, enc, MAX_TOKENS)       # HF ignores EOS: ours stops at its first EOS
    for o, r in zip(outs32, ref):
        ids = list(o.outputs[0].token_ids)
        assert ids == r[:len(ids)] and (eos not in r[:len(ids) - 1])
    del llm

    prompts, outs16, llm = run_user_script(t5_small_dir, "float16")
    _check_shape(prompts, outs16, eos)
    hf, margins = hf_t5(t5_small_dir), []
    with torch.no_grad():
        for e, o in zip(enc, outs16):
            ids = list(o.outputs[0].token_ids)
            dec = torch.tensor([[hf.config.decoder_start_token_id] + ids[:-1]])
            lp = hf(input_ids=torch.tensor([e]), decoder_input_ids=dec).logits[0].float().log_softmax(-1)
            margins.append(greedy_margins(lp, ids))
    assert_near_greedy(margins)
    # and exactly HF's own fp16 greedy (transformers' T5 fp16 clamping), EOS ignored there: ours stops at it
    from transformers import AutoModelForSeq2SeqLM

    hf16 = AutoModelForSeq2SeqLM.from_pretrained(t5_small_dir, dtype=torch.float16).eval()
    with torch.no_grad():
        for e, o in zip(enc, outs16):
            r = hf16.generate(torch.tensor([e]), max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=hf16.config.pad_token_id, use_cache=False)[0, 1:].tolist()
            assert list(o.outputs[0].token_ids) == r[:len(o.outputs[0].token_ids)]
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs16, outs32))
    print(f"seed003: {same} of 5 fp16 receipts give the fp32 ids exactly")
