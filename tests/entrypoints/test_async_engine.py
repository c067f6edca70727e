"""AsyncLLMEngine: concurrent generate() calls, abort, duplicate ids, errors that stay with their request, a
failing step that does not kill the engine, shutdown. On the trained stories260K checkpoint (CPU)."""

from __future__ import annotations

import asyncio

import pytest

from hayabusa import AsyncEngineArgs, AsyncLLMEngine, HayabusaValidationError, SamplingParams
from hayabusa.entrypoints.async_engine import EngineDeadError, EngineStepError
from tests.entrypoints.conftest import wait_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
LONG = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


async def _final(engine, prompt, params, rid):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
    return outs


def test_concurrent_requests_match_a_solo_run(engine):
    prompts = ["Once upon a time", "Lily had a red ball", "The sun was", "Tom and his dog"]

    async def main():
        solo = [(await _final(engine, p, GREEDY, f"solo-{i}"))[-1] for i, p in enumerate(prompts)]
        together = await asyncio.gather(*[_final(engine, p, GREEDY, f"tog-{i}") for i, p in enumerate(prompts)])
        return solo, together

    solo, together = asyncio.run(main())
    for s, outs in zip(solo, together):
        assert outs[-1].outputs[0].token_ids == s.outputs[0].token_ids
        assert outs[-1].outputs[0].text == s.outputs[0].text
        texts = [o.outputs[0].text for o in outs]                 # cumulative: each extends the previous
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    wait_idle(engine)


def test_abort_ends_the_stream_and_frees_blocks(engine):
    async def main():
        gen = engine.generate("Once upon a time", LONG, "to-abort")
        first = await gen.__anext__()
        await engine.abort("to-abort")
        rest = [o async for o in gen]
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished and rest[-1].finished
    assert rest[-1].outputs[0].finish_reason == "abort" and len(rest[-1].outputs[0].token_ids) < 400
    wait_idle(engine)


def test_duplicate_request_id_is_refused(engine):
    async def main():
        gen = engine.generate("Once upon a time", GREEDY, "dup")
        first = await gen.__anext__()
        with pytest.raises(HayabusaValidationError) as e:
            await engine.generate("Another", GREEDY, "dup").__anext__()
        rest = [o async for o in gen]                        # the first request is not disturbed
        again = await _final(engine, "Once upon a time", GREEDY, "dup")   # the id is free once finished
        return e.value, first, rest, again

    err, first, rest, again = asyncio.run(main())
    assert err.parameter == "request_id"
    assert rest[-1].outputs[0].finish_reason in ("stop", "length")
    assert again[-1].outputs[0].token_ids == rest[-1].outputs[0].token_ids


def test_errors_stay_with_their_request(engine):
    """A bad request raises at generate(); a consumer that raises aborts only its own request."""
    async def bad():
        async for _ in engine.generate({"prompt_token_ids": [10**6]}, GREEDY, "bad-vocab"):
            pass

    async def raising_consumer():
        async for out in engine.generate("Lily had a red ball", LONG, "raises"):
            if len(out.outputs[0].token_ids) >= 3:
                raise KeyError("consumer bug")

    async def main():
        ref = (await _final(engine, "Once upon a time", GREEDY, "ref"))[-1]
        results = await asyncio.gather(bad(), raising_consumer(), _final(engine, "Once upon a time", GREEDY, "ok"),
                                       return_exceptions=True)
        return ref, results

    ref, (bad_err, consumer_err, ok) = asyncio.run(main())
    assert isinstance(bad_err, HayabusaValidationError) and bad_err.parameter == "prompt_token_ids"
    assert isinstance(consumer_err, KeyError)
    assert ok[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    wait_idle(engine)                                        # the abandoned request was aborted


def test_failed_step_fails_requests_in_flight_and_engine_goes_on(engine, monkeypatch):
    real = engine.engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real()

    monkeypatch.setattr(engine.engine, "step", flaky)

    async def main():
        with pytest.raises(EngineStepError, match="injected failure"):
            await _final(engine, "Once upon a time", LONG, "victim")
        return await _final(engine, "Once upon a time", GREEDY, "after")

    after = asyncio.run(main())
    assert after[-1].outputs[0].finish_reason in ("stop", "length") and not engine.errored
    wait_idle(engine)


def test_validation_of_params_and_shutdown(stories_dir):
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=stories_dir, disable_log_requests=True,
                                                          max_model_len=128, max_num_seqs=2))

    async def main():
        with pytest.raises(HayabusaValidationError):
            await eng.generate({"prompt_token_ids": []}, GREEDY, "empty").__anext__()
        with pytest.raises(HayabusaValidationError):
            await eng.generate("x", "not params", "p").__anext__()
        gen = eng.generate("Once upon a time", LONG, "cut")
        await gen.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, eng.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await eng.generate("Once", GREEDY, "late").__anext__()

    asyncio.run(main())
    assert eng.errored and not eng.is_running


@pytest.mark.cuda
def test_cuda_engine_thread_replays_graphs(stories_dir):
    """On CUDA the engine steps (and replays CUDA graphs) in its background thread: the text equals LLM.generate's
    on the same GPU, and a hang fails within 120 s instead of stalling the suite."""
    from hayabusa import LLM

    prompts = ["Once upon a time", "Lily had a red ball", "The sun was", "Tom and his dog"]
    llm = LLM(stories_dir, device="cuda", max_model_len=512, max_num_seqs=16)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    del llm
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    eng = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=stories_dir, device="cuda", max_model_len=512,
                                                          max_num_seqs=16, disable_log_requests=True))
    try:
        async def main():
            return await asyncio.wait_for(asyncio.gather(
                *[_final(eng, p, GREEDY, f"cuda-{i}") for i, p in enumerate(prompts)]), timeout=120)

        outs = asyncio.run(main())
    finally:
        eng.shutdown()
    assert [o[-1].outputs[0].token_ids for o in outs] == ref


def test_cuda_device_index_is_explicit():
    """torch.cuda.set_device rejects torch.device("cuda") without an index (the engine thread died of it on the
    H200): the engine thread is given an index, or None off CUDA."""
    import torch

    from hayabusa.entrypoints.async_engine import cuda_device_index

    assert cuda_device_index(torch.device("cpu")) is None
    assert cuda_device_index(torch.device("cuda", 3)) == 3
    if torch.cuda.is_available():
        assert cuda_device_index(torch.device("cuda")) == torch.cuda.current_device()
