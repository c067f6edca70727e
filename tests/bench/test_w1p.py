"""W1P (a W1-like batch that must preempt on 8k-token contexts: swap vs recompute preemption, issue #20): its
definition of record, and at a small scale on CPU (the lengths and the GPU cache shrunk alike) both of its runs
preempt, by swapping and by recompute respectively, give the same greedy ids and leak no block."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.bench.models import make_model
from hayabusa.bench.workloads import DESCRIPTIONS, WORKLOADS, get_workload

SCALE = 1 / 32   # 224 prompt + 32 output tokens, 256-token contexts, 128 blocks: still 32 requests


@pytest.fixture(scope="module")
def tiny_bench_model(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("w1p") / "tiny-llama")
    make_model("tiny-llama", out, device="cpu")
    return out


def test_w1p_of_record_has_8k_contexts_on_a_cache_of_eight():
    w = get_workload("w1p")
    assert w.name == "W1P" and "W1P" in WORKLOADS and "W1P" in DESCRIPTIONS
    assert len(w.requests) == 32
    assert {len(r.prompt_token_ids) for r in w.requests} == {7168} and {r.max_tokens for r in w.requests} == {1024}
    assert w.max_seq_len == 8192 == w.engine_defaults["max_model_len"]
    assert w.engine_defaults["num_gpu_blocks_override"] == 4096          # 8 x 8192 tokens in 16-token blocks
    assert w.engine_defaults["swap_space"] == 4
    assert w.variants == [{"preemption_mode": "swap"}, {"preemption_mode": "recompute"}]
    # distinct random prompts: no prefix hit makes a recompute cheap
    assert len({tuple(r.prompt_token_ids[:16]) for r in w.requests}) == 32
    small = get_workload("W1P", SCALE)
    assert len(small.requests) == 32 and small.max_seq_len == 256
    assert small.engine_defaults["num_gpu_blocks_override"] == 128 and small.engine_defaults["max_model_len"] == 256


def _run(model: str, mode: str):
    w = get_workload("W1P", SCALE)
    # swap_space 0.25 GiB instead of the workload's 4 (CI's host memory); the same for both modes
    llm = LLM(model, device="cpu", skip_tokenizer_init=True, dtype="float32",
              **{**w.engine_defaults, "swap_space": 0.25, "preemption_mode": mode})
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
    outs = llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in w.requests], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [r.max_tokens for r in w.requests]
    return llm, [o.outputs[0].token_ids for o in outs]


def test_w1p_preempts_by_swap_and_by_recompute_with_the_same_greedy_ids(tiny_bench_model):
    swap, swap_ids = _run(tiny_bench_model, "swap")
    rec, rec_ids = _run(tiny_bench_model, "recompute")
    assert swap_ids == rec_ids
    s, r = swap.llm_engine, rec.llm_engine
    assert s.kv_cache_manager.block_pool.num_blocks == r.kv_cache_manager.block_pool.num_blocks == 128
    # about 9 prompts of 14 blocks fit, each grows to 16: the cache must preempt in both runs
    assert s.scheduler.num_preemptions > 0 and r.scheduler.num_preemptions > 0
    assert s.scheduler.num_swap_preemptions == s.scheduler.num_preemptions
    assert s.kv_cache_manager.num_blocks_swapped_out > 0
    assert s.kv_cache_manager.num_blocks_swapped_in == s.kv_cache_manager.num_blocks_swapped_out
    assert r.scheduler.num_swap_preemptions == 0 and r.kv_cache_manager.num_blocks_swapped_out == 0
    for e in (s, r):   # no block leaked on either tier
        kv = e.kv_cache_manager
        assert kv.num_free_blocks == kv.block_pool.num_blocks
        assert kv.num_used_cpu_blocks == 0 and not kv.req_to_cpu_blocks and not kv.has_pending_swaps
