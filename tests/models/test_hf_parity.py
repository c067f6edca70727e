"""Greedy token ids equal HF Transformers' (float32, CPU) on trained and tiny random checkpoints, for several
batch sizes, with chunked prefill and with preemption forced."""

from __future__ import annotations

import json
import os

import pytest

from hayabusa import LLM, SamplingParams
from tests.conftest import EN_PROMPTS, JA_PROMPTS
from tests.helpers import assert_greedy_close, hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)


def _expected_cases(stories_dir):
    with open(os.path.join(stories_dir, "expected_greedy.json")) as f:
        return json.load(f)["cases"]


@pytest.mark.parametrize("max_num_seqs", [1, 3, 16])
def test_stories260k_matches_expected_greedy(stories_dir, max_num_seqs):
    cases = _expected_cases(stories_dir)
    llm = LLM(stories_dir, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": c["input_ids"]} for c in cases], params, use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["greedy_new_ids"]
        assert out.prompt_token_ids == case["input_ids"]


def test_stories260k_text_prompt_matches_expected_text(stories_dir):
    case = _expected_cases(stories_dir)[1]
    llm = LLM(stories_dir)
    out = llm.generate(case["prompt"], SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == case["input_ids"]
    assert case["prompt"] + out.outputs[0].text == case["greedy_text"]


def test_stories260k_qwen2_layout_matches_expected(stories_dir, stories_qwen2_dir):
    cases = _expected_cases(stories_dir)
    # The Qwen2 copy ships Llama SentencePiece tokenizer files that AutoTokenizer misreads (see its SOURCE.md):
    # take the tokenizer from the Llama folder.
    llm = LLM(stories_qwen2_dir, tokenizer=stories_dir, max_num_seqs=3)
    outs = llm.generate([c["prompt"] or {"prompt_token_ids": c["input_ids"]} for c in cases],
                        SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    for case, out in zip(cases, outs):
        assert out.outputs[0].token_ids == case["greedy_new_ids"]


def test_top5_logprobs_match_expected(stories_dir):
    case = _expected_cases(stories_dir)[2]
    llm = LLM(stories_dir)
    out = llm.generate({"prompt_token_ids": case["input_ids"]},
                       SamplingParams(temperature=0.0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    first = out.outputs[0].logprobs[0]
    ref = case["last_position_top5"]
    assert list(first)[0] == ref[0]["id"]                         # sampled token first
    for rank, r in enumerate(ref, 1):
        assert first[r["id"]].logprob == pytest.approx(r["logprob"], abs=1e-4)
        assert first[r["id"]].rank == rank


CONFIGS = {
    "max_num_seqs=1": dict(max_num_seqs=1),
    "max_num_seqs=3": dict(max_num_seqs=3),
    "max_num_seqs=16": dict(max_num_seqs=16),
    "chunked_prefill": dict(max_num_seqs=16, max_num_batched_tokens=16),   # every prompt is chunked
    "preemption": dict(max_num_seqs=16, block_size=4, num_gpu_blocks_override=24, max_model_len=64),
}


@pytest.fixture(scope="module")
def hf_refs(request):
    return {}


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_tiny_random_models_match_hf(arch, config, request, hf_refs):
    model_dir = request.getfixturevalue(arch)
    llm = LLM(model_dir, **CONFIGS[config])
    tok = llm.get_tokenizer()
    prompts = EN_PROMPTS + JA_PROMPTS
    prompt_ids = [tok(p).input_ids for p in prompts]
    if arch not in hf_refs:
        hf_refs[arch] = hf_greedy(model_dir, prompt_ids, GREEDY.max_tokens)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    if config == "preemption":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    for ids, out, ref in zip(prompt_ids, outs, hf_refs[arch]):
        assert out.prompt_token_ids == ids
        c = out.outputs[0]
        assert_greedy_close(model_dir, ids, c.token_ids, ref, [set(d) for d in c.logprobs])
