"""W10 (prefixes that outgrow the GPU) at its scale of record exercises the CPU KV tier: its GPU cache is
``num_gpu_blocks_override`` blocks whatever the GPU's memory, the 8 prefixes do not stay on the GPU through a
cycle, and with swap_space their blocks come back from the CPU tier. The engine's scheduling only: CPU, the
forward faked (fixed logits), so the whole workload runs in seconds."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.bench.models import make_model
from hayabusa.bench.workloads import get_workload


@pytest.fixture(scope="module")
def tiny_bench_model(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("w10") / "tiny-llama")
    make_model("tiny-llama", out, device="cpu")
    return out


# the forward faked as benchmarks/w10_host.py fakes it (its input copies and fixed logits): one definition
_fake_forward = runpy.run_path(str(Path(__file__).resolve().parents[2] / "benchmarks" / "w10_host.py"),
                               run_name="w10_host")["fake_forward"]


def _run_w10(model: str, swap_space: float, scale: float = 1.0) -> LLM:
    w = get_workload("W10", scale)
    llm = LLM(model, device="cpu", skip_tokenizer_init=True, **{**w.engine_defaults, "swap_space": swap_space})
    _fake_forward(llm.llm_engine.runner)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in w.requests]
    llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in w.requests], params, use_tqdm=False)
    return llm


def test_w10_sizes_the_gpu_cache_in_blocks_and_cycles_eight_prefixes():
    w = get_workload("W10")
    # one running round (its prefix: 64 blocks, 16 requests' own 12 each) plus 2 idle prefixes: 384 blocks, fewer
    # than the 8 prefixes alone need (512), as W10's definition says ("too small for all 8 prefixes")
    assert w.engine_defaults["num_gpu_blocks_override"] == 64 + 16 * 12 + 2 * 64 < 8 * 64
    assert w.engine_defaults["enable_prefix_caching"]
    assert [v["swap_space"] > 0 for v in w.variants] == [True, False]
    prefixes = {tuple(r.prompt_token_ids[:1024]) for r in w.requests}
    assert len(w.requests) == 512 and len(prefixes) == 8
    # rounds of 16 requests per prefix, the 8 prefixes cycled 4 times
    order = [tuple(r.prompt_token_ids[:1024]) for r in w.requests[::16]]
    assert order[:8] == order[8:16] and len(set(order[:8])) == 8


def test_w10_brings_evicted_prefixes_back_from_the_cpu_tier(tiny_bench_model):
    # swap_space 0.25 GiB instead of the variant's 4 (CI's host memory): 32,768 blocks of this model, room for all
    on = _run_w10(tiny_bench_model, 0.25)
    off = _run_w10(tiny_bench_model, 0)
    kv_on, kv_off = on.llm_engine.kv_cache_manager, off.llm_engine.kv_cache_manager
    assert kv_on.block_pool.num_blocks == kv_off.block_pool.num_blocks == 384
    # 24 rounds come back to a prefix seen before (3 more cycles of 8); with the tier most restore all 64 of its
    # blocks from the CPU; without it the GPU has evicted them, so the rounds' first requests recompute them
    assert kv_on.num_cpu_hit_blocks >= 16 * 64
    assert kv_on.prefix_hit_rate > kv_off.prefix_hit_rate
    assert on.llm_engine.runner.kv_swapper.num_copies > 0 and kv_off.num_cpu_hit_blocks == 0


@pytest.mark.parametrize("scale", [0.05, 0.1])
def test_w10_at_a_tiny_scale_still_brings_prefixes_back_from_the_cpu_tier(tiny_bench_model, scale):
    """`hayabusa bench --workload W10 --scale 0.1` on CPU (CI) must still exercise the tier. Lengths and the cache
    scale together, but rounds scaled to 2 requests (of 1-2 own blocks each) never filled the cache: the 8
    prefixes stayed on the GPU and the tier restored nothing. Rounds keep 16 requests at every scale (as W1P keeps
    its request count), so the running requests evict the prefixes between cycles as at scale 1."""
    w = get_workload("W10", scale)
    assert len(w.requests) == 512 and len({tuple(r.prompt_token_ids[:10]) for r in w.requests[::16]}) == 8
    on = _run_w10(tiny_bench_model, 0.25, scale)
    off = _run_w10(tiny_bench_model, 0, scale)
    kv_on, kv_off = on.llm_engine.kv_cache_manager, off.llm_engine.kv_cache_manager
    assert kv_on.num_cpu_hit_blocks > 0 and kv_off.num_cpu_hit_blocks == 0
    assert kv_on.prefix_hit_rate > kv_off.prefix_hit_rate
