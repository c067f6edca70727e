"""swap_space: the KV cache's CPU tier in the engine. Greedy output is unchanged with swap-based and
recompute-based preemption and with prefix blocks restored from the CPU tier; no block leaks (CPU)."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.engine.llm_engine import LLMEngine
from hayabusa.config import EngineArgs
from hayabusa.errors import HayabusaValidationError

SMALL = dict(block_size=4, num_gpu_blocks_override=20, max_model_len=64, swap_space=0.01)
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def assert_no_leak(engine) -> None:
    kv = engine.kv_cache_manager
    assert not engine.scheduler.has_unfinished_requests()
    assert kv.num_free_blocks == kv.block_pool.num_blocks       # every GPU block back
    assert kv.num_used_cpu_blocks == 0 and not kv.req_to_cpu_blocks and not kv.has_pending_swaps


@pytest.fixture(scope="module")
def base(tiny_qwen2, example_prompts):
    return ids(LLM(tiny_qwen2, swap_space=0).generate(example_prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_mode_does_not_change_greedy_output(tiny_qwen2, example_prompts, base, mode, async_scheduling):
    llm = LLM(tiny_qwen2, preemption_mode=mode, async_scheduling=async_scheduling, **SMALL)
    assert ids(llm.generate(example_prompts, GREEDY, use_tqdm=False)) == base
    engine = llm.llm_engine
    sched, kv = engine.scheduler, engine.kv_cache_manager
    assert sched.num_preemptions > 0
    if mode == "swap":
        assert sched.num_swap_preemptions == sched.num_preemptions
        assert kv.num_blocks_swapped_in > 0 and engine.runner.kv_swapper.num_copies > 0
    else:
        assert sched.num_swap_preemptions == 0
    assert_no_leak(engine)


def test_prefix_blocks_restored_from_the_cpu_tier(tiny_qwen2):
    shared = list(range(1000, 1040))                           # 40 tokens: 10 full blocks
    prompts = [{"prompt_token_ids": shared + [7, 8, 9]}]
    others = [{"prompt_token_ids": list(range(2000 + 50 * i, 2040 + 50 * i))} for i in range(2)]
    again = [{"prompt_token_ids": shared + [5, 6]}]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ref = LLM(tiny_qwen2, dtype="float32", swap_space=0, enable_prefix_caching=False)
    second = [{"prompt_token_ids": shared + [4]}]              # shares the prefix: the tier keeps hit blocks only
    steps = [prompts, second, others[:1], others[1:2], again]  # one by one: no preemption, no other CPU hit
    want = [ids(ref.generate(p, params, use_tqdm=False)) for p in steps]
    for swap_space in (0, 0.01):
        llm = LLM(tiny_qwen2, dtype="float32", block_size=4, num_gpu_blocks_override=20, max_model_len=64,
                  swap_space=swap_space)
        got = [ids(llm.generate(p, params, use_tqdm=False)) for p in steps]
        assert got == want
        kv = llm.llm_engine.kv_cache_manager
        # 20 GPU blocks: the two other prompts (12 blocks each) evict all of the shared prompt's; with a CPU tier
        # its 10 prompt blocks come back from there
        if swap_space:
            assert kv.num_cpu_hit_blocks == 10 and kv.num_blocks_swapped_in == 10
        else:
            assert kv.cpu is None and kv.num_cpu_hit_blocks == 0
        assert_no_leak(llm.llm_engine)


def _engine(model, **kwargs) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=model, preemption_mode="swap", **SMALL, **kwargs))


def _add(engine, prompts) -> None:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)


def test_abort_while_swapped_out_or_swapping_in_leaks_nothing(tiny_qwen2, example_prompts):
    engine = _engine(tiny_qwen2)
    _add(engine, example_prompts)
    kv = engine.kv_cache_manager
    for _ in range(200):                                       # until a request sits in the CPU tier
        engine.step()
        if kv.req_to_cpu_blocks:
            break
    swapped = list(kv.req_to_cpu_blocks)
    assert swapped
    engine.abort_request(swapped)                              # aborted while swapped out
    assert not kv.req_to_cpu_blocks
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)

    engine = _engine(tiny_qwen2)
    _add(engine, example_prompts)
    schedule, resumed = engine.scheduler.schedule, []

    def spy():
        out = schedule()
        if out.blocks_to_swap_in and not resumed:
            resumed.extend(rid for rid, r in zip(out.scheduled_cached_reqs.req_ids,
                                                 out.scheduled_cached_reqs.resumed_from_preemption) if r)
        return out

    engine.scheduler.schedule = spy
    while engine.has_unfinished_requests() and not resumed:
        engine.step()
    assert resumed
    engine.abort_request(resumed)                              # aborted right after its swap-in step
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leak(engine)


def test_bad_swap_space_and_preemption_mode_are_refused_by_name(tiny_qwen2):
    for kwargs, name in [(dict(swap_space=10 ** 6), "swap_space"), (dict(swap_space=-1), "swap_space"),
                         (dict(preemption_mode="evict"), "preemption_mode"),
                         (dict(preemption_mode="swap", swap_space=0), "preemption_mode")]:
        with pytest.raises(HayabusaValidationError) as e:
            EngineArgs(model=tiny_qwen2, device="cpu", **kwargs).create_engine_config()
        assert e.value.parameter == name and name in str(e.value)
    with pytest.raises(HayabusaValidationError, match="host memory available"):
        EngineArgs(model=tiny_qwen2, device="cpu", swap_space=10 ** 6).create_engine_config()


def test_swap_space_is_per_rank_and_checked_over_the_ranks(monkeypatch):
    from hayabusa import config

    monkeypatch.setattr(config, "available_host_memory", lambda: 3 << 30)
    assert config.check_swap_space(1.5, 1) == config.check_swap_space(1.5, 2) == 3 << 29   # bytes per rank
    with pytest.raises(HayabusaValidationError, match="x 3 rank") as e:   # 4.5 GiB over three ranks
        config.check_swap_space(1.5, 3)
    assert e.value.parameter == "swap_space"
    assert config.check_swap_space(EngineArgs.swap_space, 2) == (3 << 30) // 4   # the default shrinks: half, split


def test_swap_counters_reach_metrics(tiny_qwen2, example_prompts):
    from hayabusa.entrypoints.openai.server import _EngineCollector

    llm = LLM(tiny_qwen2, preemption_mode="swap", **SMALL)
    llm.generate(example_prompts, GREEDY, use_tqdm=False)
    kv, sched = llm.llm_engine.kv_cache_manager, llm.llm_engine.scheduler
    stats = kv.swap_stats()
    assert stats["num_blocks_swapped_out"] == kv.num_blocks_swapped_out > 0
    assert stats["num_cpu_kv_blocks"] == kv.cpu.num_blocks > 0 and stats["num_used_cpu_kv_blocks"] == 0

    class FakeEngine:
        def get_stats(self):
            return {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage": 0.0,
                    "num_prompt_tokens": 1, "num_generation_tokens": 2, "num_preemptions": sched.num_preemptions,
                    "num_swap_preemptions": sched.num_swap_preemptions, **stats}

    metrics = {m.name: m.samples[0].value for m in _EngineCollector(FakeEngine(), {"model_name": "m"}).collect()}
    assert metrics["hayabusa:kv_blocks_swapped_in"] == kv.num_blocks_swapped_in > 0
    assert metrics["hayabusa:num_swap_preemptions"] == sched.num_swap_preemptions > 0
    assert metrics["hayabusa:cpu_kv_cache_usage_perc"] == 0.0
    m = llm.get_metrics()   # LLM.get_metrics: the same counters
    assert m["num_blocks_swapped_out"] == kv.num_blocks_swapped_out > 0
    assert m["num_blocks_swapped_in"] == kv.num_blocks_swapped_in > 0
    assert m["num_swap_preemptions"] == sched.num_swap_preemptions > 0
    assert m["cpu_prefix_cache_hit_blocks"] == kv.num_cpu_hit_blocks
    assert m["num_preemptions"] == sched.num_preemptions >= m["num_swap_preemptions"]


def test_get_metrics_has_no_swap_counters_without_the_cpu_tier(tiny_qwen2):
    m = LLM(tiny_qwen2, swap_space=0).get_metrics()
    assert m["num_preemptions"] == 0
    assert not {"num_swap_preemptions", "num_blocks_swapped_out", "num_blocks_swapped_in",
                "cpu_prefix_cache_hit_blocks"} & set(m.keys())


def test_cpu_offload_gb_is_accepted_on_cpu_and_changes_nothing(tiny_qwen2, example_prompts, base, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="hayabusa.config"):
        llm = LLM(tiny_qwen2, cpu_offload_gb=4)
    assert any("cpu_offload_gb=4 is accepted and changes nothing" in r.getMessage() for r in caplog.records)
    assert ids(llm.generate(example_prompts, GREEDY, use_tqdm=False)) == base
    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=tiny_qwen2, device="cpu", cpu_offload_gb=-1).create_engine_config()
    assert e.value.parameter == "cpu_offload_gb"


def test_swap_space_smaller_than_one_block_is_refused_with_swap_preemption(caplog):
    """preemption_mode='swap' with a swap_space that holds no KV block is refused naming swap_space and the least
    that works; without the forced mode the engine warns that the tier is off."""
    import logging

    from hayabusa import LLM
    from hayabusa.assets import demo_model_dir
    from hayabusa.config import EngineArgs
    from hayabusa.errors import HayabusaValidationError

    with pytest.raises(HayabusaValidationError) as e:
        EngineArgs(model=demo_model_dir(), device="cpu", preemption_mode="swap", swap_space=1e-6) \
            .create_engine_config()
    assert e.value.parameter == "swap_space" and "at least" in str(e.value)
    with caplog.at_level(logging.WARNING, logger="hayabusa.engine.llm_engine"):
        llm = LLM(demo_model_dir(), swap_space=1e-6)
    assert llm.llm_engine.kv_cache_manager.cpu is None
    assert any("holds no KV block" in r.getMessage() for r in caplog.records)


def test_write_through_keeps_greedy_output_on_a_w10_like_stream(tiny_qwen2):
    """3 prefixes of 6 blocks, 3 requests each, cycled twice, on a GPU cache too small for all of them: with the
    tier the prefixes are written through when freed and restored on the second cycle; the ids equal the tier-off
    run's (which recomputes them) and prefix caching off."""
    prefixes = [list(range(1000 + 100 * p, 1024 + 100 * p)) for p in range(3)]
    prompts = [{"prompt_token_ids": prefixes[p] + [7 + j, 40 + c, 9]} for c in range(2) for p in range(3)
               for j in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    args = dict(dtype="float32", block_size=4, num_gpu_blocks_override=24, max_model_len=64, max_num_seqs=3,
                preemption_mode="recompute")
    want = ids(LLM(tiny_qwen2, swap_space=0, enable_prefix_caching=False, **args).generate(prompts, params,
                                                                                            use_tqdm=False))
    hit_rate = {}
    for swap_space in (0, 0.01):
        llm = LLM(tiny_qwen2, swap_space=swap_space, **args)
        assert ids(llm.generate(prompts, params, use_tqdm=False)) == want
        kv = llm.llm_engine.kv_cache_manager
        hit_rate[swap_space] = kv.prefix_hit_rate
        if swap_space:   # each prefix's 6 blocks written through once, evicted, restored once in the 2nd cycle
            assert kv.num_blocks_written_through == 18 and kv.num_cpu_hit_blocks == 18
            assert kv.num_blocks_swapped_out == 18                   # so their evictions copied nothing
        assert_no_leak(llm.llm_engine)
    assert hit_rate[0.01] > hit_rate[0]
