"""The runner alone: a SchedulerOutput is plain data (it pickles, with no scheduler ``Request`` inside), and a fresh
ModelRunner fed the pickled SchedulerOutputs of a real engine run, with no scheduler at all, reproduces the
engine's tokens (greedy and seeded; chunked prefill, prefix hits, preemption and resume, penalties, min_tokens,
async-scheduling placeholders in the recorded run)."""

from __future__ import annotations

import io
import pickle

import pytest

from hayabusa import LLM, EngineArgs, SamplingParams
from hayabusa.core.request import Request
from hayabusa.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from hayabusa.worker.model_runner import ModelRunner

ENGINE_KW = dict(skip_tokenizer_init=True, block_size=4, num_gpu_blocks_override=26, max_model_len=64,
                 max_num_batched_tokens=8, max_num_seqs=6, enable_prefix_caching=True)


class _NoRequestPickler(pickle.Pickler):
    """Pickles like pickle.dumps, but fails on a scheduler Request anywhere inside."""

    def persistent_id(self, obj):
        if isinstance(obj, Request):
            raise AssertionError(f"a scheduler Request inside a SchedulerOutput: {obj!r}")
        return None


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    _NoRequestPickler(buf).dump(obj)
    return buf.getvalue()


def _workload():
    shared = [5, 9, 13, 17, 21, 25, 29, 33, 37]              # two full blocks and one token: prefix hits
    prompts = [shared + [40 + i] * (i % 3) for i in range(6)] + [list(range(60, 73)), [7, 8]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    params = [greedy] * 3 + [
        SamplingParams(temperature=0.0, max_tokens=20, min_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=14, repetition_penalty=1.4, frequency_penalty=0.3,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, max_tokens=25, seed=3, presence_penalty=0.5, ignore_eos=True),
        greedy]
    return [{"prompt_token_ids": p} for p in prompts], params


def _record(stories_dir, async_scheduling: bool):
    """Run the workload; returns (the launched steps' pickled SchedulerOutputs, request id -> output ids)."""
    llm = LLM(stories_dir, async_scheduling=async_scheduling, **ENGINE_KW)
    engine = llm.llm_engine
    runner = engine.runner
    recorded: list[bytes] = []
    launch = runner.launch

    def recording_launch(out):
        recorded.append(_dumps(out))
        return launch(out)

    runner.launch = recording_launch
    prompts, params = _workload()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.num_hit_tokens > 0
    return recorded, {o.request_id: o.outputs[0].token_ids for o in outs}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_runner_alone_replays_a_recorded_run(stories_dir, async_scheduling):
    recorded, expected = _record(stories_dir, async_scheduling)
    # A fresh runner built from the config alone: no scheduler, no engine.
    runner = ModelRunner(EngineArgs(model=stories_dir, **ENGINE_KW).create_engine_config())
    runner.initialize_kv_cache()
    got: dict[str, list[int]] = {}
    for blob in recorded:
        out = pickle.loads(blob)
        assert isinstance(out, SchedulerOutput)
        result = runner.execute_model(out)
        for rid, ids in result.sampled_token_ids.items():
            got.setdefault(rid, []).extend(ids)
    assert got == expected
    assert any(any(c.resumed_from_preemption) for c in map(lambda b: pickle.loads(b).scheduled_cached_reqs,
                                                            recorded))


def test_scheduler_output_pickles(stories_dir):
    """A real step's SchedulerOutput (new requests, running ones, a resumed one, finished and preempted ids)
    round-trips through pickle to an equal object, and holds no scheduler Request."""
    llm = LLM(stories_dir, **ENGINE_KW)
    engine = llm.llm_engine
    seen = {"new": 0, "cached": 0, "resumed": 0, "finished": 0, "preempted": 0}
    schedule = engine.scheduler.schedule

    def checked_schedule():
        out = schedule()
        copy = pickle.loads(_dumps(out))
        assert copy == out and copy is not out
        assert copy.scheduled_req_ids == out.scheduled_req_ids
        assert copy.num_computed_tokens == out.num_computed_tokens
        assert all(isinstance(r, NewRequestData) for r in copy.scheduled_new_reqs)
        assert isinstance(copy.scheduled_cached_reqs, CachedRequestData)
        seen["new"] += len(out.scheduled_new_reqs)
        seen["cached"] += out.scheduled_cached_reqs.num_reqs
        seen["resumed"] += sum(out.scheduled_cached_reqs.resumed_from_preemption)
        seen["finished"] += len(out.finished_req_ids)
        seen["preempted"] += len(out.preempted_req_ids)
        return out

    engine.scheduler.schedule = checked_schedule
    prompts, params = _workload()
    llm.generate(prompts, params, use_tqdm=False)
    assert all(seen.values()), seen
