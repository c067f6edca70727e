"""On a GPU: OPT's greedy token ids on CUDA (Triton paged attention, CUDA graphs on and off, prefix-cache hits,
chunked prefill) equal HF Transformers' float32 ids on the CPU, for the three tiny layouts of tests/models/_opt.py
(opt-125m's pre-LN, opt-350m's post-LN with project_in / project_out, no biases / affines / final LayerNorm).
Tiny models: the whole file runs in well under a minute on an H200. Each case prints the count of sequences
identical to HF's."""

from __future__ import annotations

import gc

import pytest
import torch

from hayabusa import LLM, SamplingParams
from tests.conftest import EN_PROMPTS, JA_PROMPTS, LONG_PROMPT
from tests.helpers import assert_greedy_close, hf_greedy
from tests.models._opt import OPT_VARIANTS, save_tiny_opt

pytestmark = pytest.mark.cuda

PROMPTS = (EN_PROMPTS + JA_PROMPTS + [LONG_PROMPT, "a"]) * 2      # 18 requests: decode batches of several sizes
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module", params=OPT_VARIANTS)
def case(request, tmp_path_factory) -> dict:
    d = save_tiny_opt(tmp_path_factory.mktemp(f"opt_{request.param}"), request.param)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(d)
    ids = [tok(p).input_ids for p in PROMPTS]
    return {"dir": d, "variant": request.param, "prompt_ids": ids, "ref": hf_greedy(d, ids, GREEDY.max_tokens)}


def _run(case: dict, **kw) -> tuple[list[list[int]], int]:
    """(each request's ids, prefix-cache hit tokens) of PROMPTS on CUDA in float32, every request checked
    against HF's by the parity rule and at least 90 % identical."""
    llm = LLM(case["dir"], device="cuda", dtype="float32", max_num_seqs=8, kv_cache_memory_bytes=1 << 28, **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine = llm.llm_engine
    if not kw.get("enforce_eager", False):
        assert engine.runner.graphs is not None and engine.runner.graphs.graphs
    equal = 0
    for ids, out, ref in zip(case["prompt_ids"], outs, case["ref"], strict=True):
        c = out.outputs[0]
        assert len(c.token_ids) == GREEDY.max_tokens
        assert_greedy_close(case["dir"], ids, c.token_ids, ref, [set(d) for d in c.logprobs])
        equal += c.token_ids == ref
    print(f"\nOPT {case['variant']} {kw}: {equal}/{len(PROMPTS)} sequences identical to HF float32")
    assert equal >= 0.9 * len(PROMPTS)
    res, hits = [o.outputs[0].token_ids for o in outs], engine.kv_cache_manager.num_hit_tokens
    del llm, engine, outs
    gc.collect()
    torch.cuda.empty_cache()
    return res, hits


def test_cuda_greedy_matches_hf(case):
    graphs, _ = _run(case)
    eager, _ = _run(case, enforce_eager=True)
    assert graphs == eager                     # CUDA graphs change nothing


def test_cuda_chunked_prefill_and_prefix_hits_match_hf(case):
    """16-token steps (chunked prefill) and prefix caching: the second half of PROMPTS repeats the first, so its
    prompts hit the blocks the first half cached."""
    _, hits = _run(case, block_size=16, max_num_batched_tokens=16, enable_prefix_caching=True)
    print(f"prefix-cache hit tokens: {hits}")
    assert hits >= 16
