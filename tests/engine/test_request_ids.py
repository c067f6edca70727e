"""Issue #14: request ids and failures that must stay with their request.

A request with n > 1 has internal child ids ``{i}_{request_id}``; a request_id equal to any id in flight (a user's
or an internal one) is refused with a HayabusaValidationError naming request_id, before anything is queued, and the
requests in flight finish as if nothing happened. A scheduler that cannot schedule anything fails the request that
blocks instead of failing every step; a failed step fails the requests it was running, not the waiting ones; the
same error repeated is logged once per interval. Through LLMEngine and AsyncLLMEngine, on stories260K (CPU)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from hayabusa import LLM, AsyncEngineArgs, AsyncLLMEngine, HayabusaValidationError, SamplingParams
from hayabusa.core.request import Request
from hayabusa.engine.llm_engine import RateLimitedLog
from hayabusa.entrypoints.async_engine import EngineStepError

PAIR = SamplingParams(temperature=0.8, max_tokens=10, seed=7, n=2, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _run_all(engine) -> dict:
    """Step until idle; request id -> its final output."""
    finished = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    return finished


def _solo(stories_dir, prompt, params, **kw):
    return LLM(stories_dir, **kw).generate([prompt], params, use_tqdm=False)[0]


def _ids(out):
    return [c.token_ids for c in out.outputs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ids_that_collide_with_ids_in_flight_are_refused(stories_dir, async_scheduling):
    engine = LLM(stories_dir, async_scheduling=async_scheduling).llm_engine
    engine.add_request("x", "Once upon a time", PAIR)             # children 0_x and 1_x
    engine.add_request("0_y", "The dog", GREEDY)                   # a user id of the child form
    engine.step()
    engine.step()
    refused = [("0_x", GREEDY), ("1_x", GREEDY), ("x", GREEDY), ("0_y", GREEDY),
               ("y", SamplingParams(temperature=0.0, max_tokens=4, n=2))]   # y's child 0_y is in flight
    for rid, params in refused:
        with pytest.raises(HayabusaValidationError, match="request_id") as e:
            engine.add_request(rid, "Lily", params)
        assert e.value.parameter == "request_id" and e.value.value == rid
    assert engine.get_num_unfinished_requests() == 2                 # nothing was queued
    finished = _run_all(engine)
    assert set(finished) == {"x", "0_y"}
    assert _ids(finished["x"]) == _ids(_solo(stories_dir, "Once upon a time", PAIR))
    assert _ids(finished["0_y"]) == _ids(_solo(stories_dir, "The dog", GREEDY))
    assert all(c.finish_reason == "length" for c in finished["x"].outputs)
    # once they are done, the ids are free again, and the engine serves them
    engine.add_request("0_x", "The dog", GREEDY)
    engine.add_request("y", "The dog", SamplingParams(temperature=0.0, max_tokens=4, n=2))
    again = _run_all(engine)
    assert _ids(again["0_x"]) == _ids(finished["0_y"])
    assert [len(t) for t in _ids(again["y"])] == [4, 4]
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_a_request_that_cannot_be_scheduled_is_failed_not_spun(stories_dir, caplog):
    """A request the scheduler holds but nothing will ever move (here: one waiting on a token that no step
    will bring, as the id collision left behind) is aborted once; the requests behind it are served."""
    engine = LLM(stories_dir).llm_engine
    ghost = Request("ghost", [5, 6, 7], GREEDY, (2,), 8)
    ghost.num_output_placeholders = 1
    engine.scheduler.add_request(ghost)
    engine.add_request("b", "The dog", GREEDY)
    with caplog.at_level(logging.ERROR, logger="hayabusa.engine.llm_engine"):
        finished = _run_all(engine)
    assert ghost.is_finished() and "ghost" not in engine.scheduler.requests
    assert _ids(finished["b"]) == _ids(_solo(stories_dir, "The dog", GREEDY))
    assert sum("cannot schedule" in r.getMessage() for r in caplog.records) == 1
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_a_failed_step_fails_the_running_requests_only(stories_dir):
    engine = LLM(stories_dir, max_num_seqs=1).llm_engine          # one row: "b" waits while "a" runs
    engine.add_request("a", "Once upon a time", GREEDY)
    engine.add_request("b", "The dog", GREEDY)
    engine.step()
    engine.step()
    runner = engine.runner
    launch = runner.launch

    def failing_launch(out):
        raise RuntimeError("injected failure")

    runner.launch = failing_launch
    with pytest.raises(RuntimeError):
        engine.step()
    runner.launch = launch
    assert engine.abort_after_failed_step() == ["a"]
    finished = _run_all(engine)
    assert list(finished) == ["b"]
    assert _ids(finished["b"]) == _ids(_solo(stories_dir, "The dog", GREEDY))
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks


def test_rate_limited_log(caplog):
    log = RateLimitedLog(logging.getLogger("test.ratelimit"), interval=60.0)
    with caplog.at_level(logging.ERROR, logger="test.ratelimit"):
        written = [log.log(logging.ERROR, "same failure") for _ in range(5)]
        written.append(log.log(logging.ERROR, "another failure"))
    assert written == [True, False, False, False, False, True]
    assert [r.getMessage() for r in caplog.records] == ["same failure", "another failure"]
    log._last["same failure"] = (log._last["same failure"][0] - 61.0, 4)    # an interval later
    with caplog.at_level(logging.ERROR, logger="test.ratelimit"):
        assert log.log(logging.ERROR, "same failure")
    assert caplog.records[-1].getMessage() == "same failure (and 4 more times in the last 60 s)"


@pytest.fixture()
def async_engine(stories_dir):
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=stories_dir, disable_log_requests=True,
                                                          max_model_len=256, max_num_seqs=8))
    yield eng
    eng.shutdown()


async def _final(engine, prompt, params, rid):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    assert outs and outs[-1].finished
    return outs[-1]


def test_async_engine_refuses_colliding_ids_and_goes_on(async_engine, stories_dir):
    from tests.entrypoints.conftest import wait_idle

    async def main():
        pair = asyncio.ensure_future(_final(async_engine, "Once upon a time", PAIR, "x"))
        other = asyncio.ensure_future(_final(async_engine, "The dog", GREEDY, "other"))
        for _ in range(200):                                        # until x is in the engine
            if "x" in async_engine.engine.output_processor.states:
                break
            await asyncio.sleep(0.005)
        errors = []
        for rid in ("0_x", "1_x"):
            with pytest.raises(HayabusaValidationError) as e:
                await _final(async_engine, "Lily", GREEDY, rid)
            errors.append(e.value)
        results = await asyncio.gather(pair, other)
        after = await _final(async_engine, "The dog", GREEDY, "0_x")   # free once x is done
        return errors, results, after

    errors, (pair, other), after = asyncio.run(main())
    assert all(e.parameter == "request_id" and "request_id" in str(e) for e in errors)
    assert _ids(pair) == _ids(_solo(stories_dir, "Once upon a time", PAIR))
    assert _ids(other) == _ids(after) == _ids(_solo(stories_dir, "The dog", GREEDY))
    assert not async_engine.errored
    wait_idle(async_engine)


def test_async_engine_logs_a_repeated_step_failure_once(async_engine, caplog):
    from tests.entrypoints.conftest import wait_idle

    real = async_engine.engine.step
    failing = {"on": True}

    def flaky():
        if failing["on"]:
            raise RuntimeError("injected failure")
        return real()

    async_engine.engine.step = flaky

    async def main():
        for i in range(4):
            with pytest.raises(EngineStepError, match="injected failure"):
                await _final(async_engine, "Once upon a time", GREEDY, f"victim-{i}")
        failing["on"] = False
        return await _final(async_engine, "The dog", GREEDY, "after")

    with caplog.at_level(logging.ERROR, logger="hayabusa.engine.llm_engine"):
        after = asyncio.run(main())
    assert after.outputs[0].finish_reason == "length" and not async_engine.errored
    assert sum("injected failure" in r.getMessage() for r in caplog.records) == 1
    wait_idle(async_engine)
