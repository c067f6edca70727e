"""swap_space on a GPU: the CPU tier's copies (pinned memory, a side stream, non-blocking) inside the engine.

In batch-invariant mode a request's greedy ids and logprobs do not depend on batching, chunking, prefix hits or
recompute after preemption (hayabusa/batch_invariant.py), so with swap-based preemption and with prefix blocks
restored from the CPU tier they must be the same bits as without the tier: a block restored wrong (a wrong layer,
block, or a copy racing the forward on its stream) changes them. ``_check_*`` also run on CPU (``device="cpu"``)."""

from __future__ import annotations

import random

import pytest

from hayabusa import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
COMMON = dict(dtype="bfloat16", batch_invariant=True, seed=0, block_size=16, max_model_len=128)


def _prompts(n: int, seed: int, lo: int, hi: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(3, 512) for _ in range(rng.randrange(lo, hi))]} for _ in range(n)]


def _keys(outs) -> list[tuple]:
    return [(tuple(o.outputs[0].token_ids),
             tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in o.outputs[0].logprobs))
            for o in outs]


def _assert_no_leak(llm: LLM) -> None:
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    assert not engine.scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.block_pool.num_blocks
    assert kv.num_used_cpu_blocks == 0 and not kv.req_to_cpu_blocks and not kv.has_pending_swaps


def _check_swap_preemption(model: str, device: str, async_scheduling: bool) -> None:
    # 8 requests of 60-100 tokens (4-7 blocks) in 12 blocks: decode runs out of blocks and preempts by swapping
    prompts = _prompts(8, 0, 20, 60)
    ref = _keys(LLM(model, device=device, swap_space=0, **COMMON).generate(prompts, PARAMS, use_tqdm=False))
    llm = LLM(model, device=device, preemption_mode="swap", swap_space=0.05, num_gpu_blocks_override=12,
              async_scheduling=async_scheduling, **COMMON)
    assert _keys(llm.generate(prompts, PARAMS, use_tqdm=False)) == ref
    sched, kv = llm.llm_engine.scheduler, llm.llm_engine.kv_cache_manager
    assert sched.num_swap_preemptions == sched.num_preemptions > 0
    assert kv.num_blocks_swapped_in > 0 and llm.llm_engine.runner.kv_swapper.num_copies > 0
    _assert_no_leak(llm)


def _check_prefix_restores(model: str, device: str) -> None:
    # 10 GPU blocks. The shared prompt's 4 full blocks are cached; the first other prompt (6 blocks) takes free
    # blocks, the second has to evict cached ones, the oldest first: the shared prompt's, which go to the CPU tier
    # (swap_space > 0) and come back on the last request's hit.
    rng = random.Random(1)
    shared = [rng.randrange(3, 512) for _ in range(64)]
    steps = [[{"prompt_token_ids": shared + [7, 8, 9]}], [{"prompt_token_ids": shared + [4]}],   # a hit: kept
             _prompts(1, 2, 80, 81), _prompts(1, 3, 80, 81),
             [{"prompt_token_ids": shared + [5, 6]}]]
    got = {}
    for swap_space in (0, 0.05):
        llm = LLM(model, device=device, swap_space=swap_space, num_gpu_blocks_override=10, **COMMON)
        got[swap_space] = [_keys(llm.generate(p, PARAMS, use_tqdm=False)) for p in steps]
        kv = llm.llm_engine.kv_cache_manager
        if swap_space:
            assert kv.num_cpu_hit_blocks > 0 and kv.num_blocks_swapped_in == kv.num_cpu_hit_blocks
        _assert_no_leak(llm)
    assert got[0.05] == got[0]


def _check_write_through_stream(model: str, device: str) -> None:
    # A W10-like stream: 3 prefixes of 4 blocks (64 tokens), 3 requests each, cycled twice, 3 at a time, in 16 GPU
    # blocks (room for about one prefix beside its requests): each prefix is written through to the CPU tier when
    # its group ends (copies the forward does not wait for), evicted without a copy, and restored in the second
    # cycle; later steps reuse the written-through blocks (fences). The bits equal the tier-off run's.
    rng = random.Random(4)
    prefixes = [[rng.randrange(3, 512) for _ in range(64)] for _ in range(3)]
    prompts = [{"prompt_token_ids": prefixes[p] + [7 + j, 40 + c]} for c in range(2) for p in range(3)
               for j in range(3)]
    got = {}
    for swap_space in (0, 0.05):
        llm = LLM(model, device=device, swap_space=swap_space, num_gpu_blocks_override=16, max_num_seqs=3,
                  preemption_mode="recompute", **COMMON)
        got[swap_space] = _keys(llm.generate(prompts, PARAMS, use_tqdm=False))
        kv = llm.llm_engine.kv_cache_manager
        if swap_space:
            assert kv.num_blocks_written_through > 0 and kv.num_cpu_hit_blocks > 0
            assert kv.num_blocks_swapped_out == kv.num_blocks_written_through   # no eviction copied a block
        _assert_no_leak(llm)
    assert got[0.05] == got[0]


@pytest.mark.cuda
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_swap_preemption_gives_the_same_bits_as_no_tier_on_cuda(stories_qwen2_dir, async_scheduling):
    _check_swap_preemption(stories_qwen2_dir, "cuda", async_scheduling)


@pytest.mark.cuda
def test_prefix_blocks_restored_from_the_cpu_tier_give_the_same_bits_on_cuda(stories_qwen2_dir):
    _check_prefix_restores(stories_qwen2_dir, "cuda")


@pytest.mark.cuda
def test_write_through_stream_gives_the_same_bits_on_cuda(stories_qwen2_dir):
    _check_write_through_stream(stories_qwen2_dir, "cuda")
