"""pipeline_parallel_size=2 on CPU (gloo, spawned worker processes): greedy token ids and seeded samples equal the
one-process engine (float32), with two micro-batches of disjoint requests in flight, on tiny Llama (3 layers: stages of 2 and 1, each sizing its own KV cache and CPU tier;
swap preemption), GPT-2
(learned positions, tied head on the last stage), Qwen2 (2 KV heads, tied head) and Gemma 2 (4 KV heads, soft-capping,
scaled embedding), under chunked prefill, preemption, prefix
caching and n > 1; tensor_parallel_size=2 x pipeline_parallel_size=2 (4 processes) with a structured-output step;
a stage's worker killed mid-generation (GPT-2's engine, after its checks: one engine start less) fails the next
step within seconds and leaves no process; what stages do not run is refused by name before any process starts."""

from __future__ import annotations

import os
import signal
import time

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.distributed.config import get_pp_indices
from hayabusa.errors import HayabusaValidationError
from hayabusa.executor.mp_executor import WorkerError
from tests.distributed.test_tensor_parallel import ENGINE, GREEDY, PROMPTS, _build, _run


def test_get_pp_indices_is_vllms_split():
    """Even split; the remainder one layer each to the stages before the last, from the second-to-last back."""
    def split(n: int, pp: int) -> list[tuple[int, int]]:
        return [get_pp_indices(n, r, pp) for r in range(pp)]

    assert split(2, 2) == [(0, 1), (1, 2)]
    assert split(3, 2) == [(0, 2), (2, 3)]
    assert split(7, 3) == [(0, 2), (2, 5), (5, 7)]
    assert split(4, 3) == [(0, 1), (1, 3), (3, 4)]
    assert split(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert [e - s for s, e in split(61, 4)] == [15, 15, 16, 15]
    assert split(61, 2) == [(0, 31), (31, 61)]


def _check(got: dict, ref: dict) -> None:
    # micro-batches (two steps in flight, disjoint requests) preempt at other moments than one batch: both do
    assert ref["preemptions"] > 0 and got["preemptions"] > 0
    assert all(len(ids) == 12 for ids in got["greedy"])
    assert got["greedy"] == ref["greedy"]
    assert got["again"] == got["greedy"]                   # prefix-cache hits change nothing
    assert got["seeded"] == ref["seeded"]
    assert all(a != b for a, b in got["seeded"])           # the two samples differ (seed + i)
    assert got["choice"] == ref["choice"]


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gemma2"])
def test_pp2_equals_pp1(arch, tmp_path):
    layers = 3 if arch == "llama" else 2
    path = _build(arch, tmp_path / arch, num_layers=layers)
    ref = _run(LLM(path, **ENGINE))
    engine_args = dict(ENGINE)
    if arch == "llama":
        # Each stage sizes the KV cache of its own layers: 2 layers (stage 0) and 1 (stage 1), 1 KV head of 16,
        # float32, blocks of 4 tokens: 1024 and 512 bytes a block. The engine takes the smaller count (24), the
        # one-process engine's num_gpu_blocks_override. Preemption swaps here (each stage's CPU tier holds its own
        # layers' KV): the same tokens as the reference's recompute.
        engine_args.update(num_gpu_blocks_override=None, kv_cache_memory_bytes=24 * 2 * 2 * 16 * 4 * 4,
                           preemption_mode="swap", swap_space=0.002)
    llm = LLM(path, pipeline_parallel_size=2, **engine_args)
    engine = llm.llm_engine
    try:
        if arch == "llama":
            assert engine.runner.num_blocks_per_rank == [24, 48]
            assert engine.num_blocks == 24
        assert engine.config.parallel_config.driver_rank == 1
        got = _run(llm)
        assert engine.kv_cache_manager.num_hit_tokens > 0
        assert engine.most_steps_in_flight == 2      # stage 0 ran step N + 1 while stage 1 ran step N
        if arch == "llama":
            assert engine.scheduler.num_swap_preemptions == engine.scheduler.num_preemptions > 0
            assert engine.kv_cache_manager.num_blocks_swapped_in > 0
        if arch == "gpt2":
            _kill_stage_worker_mid_generation(llm)
    finally:
        engine.shutdown()
    _check(got, ref)
    assert not any(p.is_alive() for p in engine.runner.procs)


def _kill_stage_worker_mid_generation(llm: LLM) -> None:
    """Stage 0's worker killed between two steps of a generation (the last stage would wait on its recv): the
    next step raises a WorkerError within seconds, every worker is ended, and the engine stays failed."""
    engine = llm.llm_engine
    ex = engine.runner
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"k{i}", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.has_unfinished_requests()
    os.kill(ex.procs[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    with pytest.raises(WorkerError, match="worker 0 .* died|worker 1 failed"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - killed_at < 10.0
    assert not any(p.is_alive() for p in ex.procs)
    with pytest.raises(WorkerError):   # the engine stays failed, it does not hang
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


def test_tp2_pp2_equals_tp1(tmp_path):
    """4 processes: tp ranks inner, stages outer (ranks 2 and 3 are the last stage; rank 2 answers). Qwen2's
    2 KV heads split over each stage's 2 ranks; a choice-constrained step's grammar bitmask reaches the last
    stage."""
    path = _build("qwen2", tmp_path / "m")
    ref = _run(LLM(path, **ENGINE), structured=True)
    llm = LLM(path, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    try:
        assert len(engine.runner.procs) == 4 and engine.config.parallel_config.driver_rank == 2
        got = _run(llm, structured=True)
        assert engine.most_steps_in_flight == 2
    finally:
        engine.shutdown()
    _check(got, ref)
    assert got["choice"] is not None and all(t in ("yes", "no", "maybe so") for t in got["choice"])
    assert not any(p.is_alive() for p in engine.runner.procs)


def test_refusals(tmp_path):
    """What pipeline stages do not run fails at the edge, by name, before any process starts."""
    path = _build("llama", tmp_path / "m")   # 2 decoder layers
    cases = [(dict(pipeline_parallel_size=3), "decoder layers"),
             (dict(pipeline_parallel_size=0), "positive integer"),
             (dict(pipeline_parallel_size=2, distributed_executor_backend="ray"), "'mp' only"),
             (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
              "speculative decoding"),
             (dict(pipeline_parallel_size=2, cpu_offload_gb=1.0), "cpu_offload_gb")]
    for kwargs, why in cases:
        with pytest.raises(HayabusaValidationError, match=why) as e:
            LLM(path, **{**ENGINE, **kwargs})
        assert e.value.parameter == "pipeline_parallel_size", kwargs
        assert e.value.value == kwargs["pipeline_parallel_size"]

