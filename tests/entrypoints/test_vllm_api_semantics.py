"""vLLM offline-API semantics found missing by driving LLM / AsyncLLMEngine as vLLM users do: ``use_tqdm`` as a
callable (vLLM's ``use_tqdm: bool | Callable[..., tqdm]``), the ``priority`` keyword (0 accepted, as vLLM does
without priority scheduling; another value refused by name)."""

from __future__ import annotations

import asyncio

import pytest

from hayabusa import LLM, HayabusaValidationError, SamplingParams
from tests.entrypoints.conftest import wait_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = ["Once upon a time", "One day, Tom", "Lily"]


@pytest.fixture(scope="module")
def llm(stories_dir):
    return LLM(stories_dir, max_num_seqs=8)


class _Bar:
    """A tqdm stand-in that records how it was made and driven."""

    made: list["_Bar"] = []

    def __init__(self, **kwargs):
        self.kwargs, self.n, self.closed = kwargs, 0, False
        _Bar.made.append(self)

    def update(self, k):
        self.n += k

    def set_postfix_str(self, s, refresh=True):
        self.postfix = s

    def close(self):
        self.closed = True


def test_use_tqdm_callable_makes_the_bar(llm):
    _Bar.made.clear()
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=_Bar)
    assert len(outs) == 3 and len(_Bar.made) == 1
    bar = _Bar.made[0]
    assert bar.kwargs["total"] == 3 and bar.n == 3 and bar.closed
    assert [o.outputs[0].token_ids for o in outs] == \
        [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_priority_zero_is_accepted_and_changes_nothing(llm):
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0, 0, 0])]
    assert got == want and len(want[0]) == 6


@pytest.mark.parametrize("priority, words", [([0, 1, 0], "priority 1"), ([0, 0], "one int per prompt (3)"),
                                             (0, "one int per prompt"), ([0, 0.0, 0], "must be an int")])
def test_bad_priority_is_refused_by_name_and_nothing_is_queued(llm, priority, words):
    with pytest.raises(HayabusaValidationError, match="priority") as e:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False, priority=priority)
    assert e.value.parameter == "priority" and words in str(e.value)
    assert not llm.llm_engine.has_unfinished_requests()


def test_async_generate_takes_priority_zero_and_refuses_others(engine):
    async def main():
        outs = [o async for o in engine.generate("Once upon a time", GREEDY, "p0", priority=0, trace_headers=None)]
        with pytest.raises(HayabusaValidationError, match="priority 2") as e:
            async for _ in engine.generate("Once upon a time", GREEDY, "p2", priority=2):
                pass
        return outs, e.value

    outs, err = asyncio.run(main())
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6
    assert err.parameter == "priority"
    wait_idle(engine)


def _collect(engine, prompt, params, rid, slow=False):
    async def main():
        outs = []
        async for o in engine.generate(prompt, params, rid):
            outs.append(o)
            if slow:
                await asyncio.sleep(0.05)      # the engine runs ahead: deltas pile up and must be merged
        return outs

    return asyncio.run(main())


@pytest.mark.parametrize("slow", [False, True])
def test_delta_outputs_add_up_to_the_cumulative_output(engine, slow):
    from hayabusa.sampling_params import RequestOutputKind

    kw = dict(temperature=1.0, seed=11, n=2, max_tokens=24, logprobs=1, prompt_logprobs=1, stop=["park"])
    full = _collect(engine, "Once upon a time", SamplingParams(**kw), "cum")[-1]
    deltas = _collect(engine, "Once upon a time", SamplingParams(**kw, output_kind=RequestOutputKind.DELTA),
                      f"delta{slow}", slow=slow)
    assert deltas[-1].finished and not any(o.finished for o in deltas[:-1])
    for c in full.outputs:
        parts = [d for o in deltas for d in o.outputs if d.index == c.index]
        assert "".join(d.text for d in parts) == c.text and len(c.text) > 0
        assert [t for d in parts for t in d.token_ids] == c.token_ids
        assert [lp for d in parts for lp in d.logprobs] == c.logprobs
        assert parts[-1].finish_reason == c.finish_reason and parts[-1].stop_reason == c.stop_reason
        assert parts[-1].cumulative_logprob == pytest.approx(c.cumulative_logprob)
        assert all(d.finish_reason is None for d in parts[:-1])
    # the prompt logprobs come once, in the first output
    assert deltas[0].prompt_logprobs == full.prompt_logprobs and len(full.prompt_logprobs) == 5
    assert all(o.prompt_logprobs is None for o in deltas[1:])
    if slow:       # fewer outputs than steps: deltas were merged
        assert len(deltas) < max(len(c.token_ids) for c in full.outputs)
    else:          # one token per step: no output repeats a token
        assert sum(len(d.token_ids) for o in deltas for d in o.outputs) == sum(len(c.token_ids) for c in full.outputs)
    wait_idle(engine)


def test_final_only_yields_one_output_equal_to_the_last_cumulative_one(engine):
    from hayabusa.sampling_params import RequestOutputKind

    kw = dict(temperature=0.0, max_tokens=12)
    cum = _collect(engine, "One day, Tom", SamplingParams(**kw), "c2")
    final = _collect(engine, "One day, Tom", SamplingParams(**kw, output_kind=2), "f2")
    # (a cumulative stream may skip outputs its consumer was too slow to read: only the newest is kept)
    assert 1 <= len(cum) <= 12 and cum[-1].finished and len(cum[-1].outputs[0].token_ids) == 12
    assert len(final) == 1 and final[0].finished
    assert final[0].outputs[0].token_ids == cum[-1].outputs[0].token_ids
    assert final[0].outputs[0].text == cum[-1].outputs[0].text != ""
    assert SamplingParams(output_kind=2).output_kind is RequestOutputKind.FINAL_ONLY


def test_delta_abort_ends_with_an_abort_delta(engine):
    from hayabusa.sampling_params import RequestOutputKind

    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def main():
        gen = engine.generate("Once upon a time", params, "da")
        first = await gen.__anext__()
        await engine.abort("da")
        return first, [o async for o in gen]

    first, rest = asyncio.run(main())
    assert len(first.outputs[0].token_ids) >= 1 and not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    wait_idle(engine)


def test_llm_generate_returns_final_outputs_whatever_the_kind(llm):
    from hayabusa.sampling_params import RequestOutputKind

    want = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    got = llm.generate(PROMPTS, GREEDY.clone(output_kind=RequestOutputKind.DELTA), use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.parametrize("value", [3, -1, "delta", 1.0, True])
def test_bad_output_kind_is_refused_by_name(value):
    with pytest.raises(TypeError, match="output_kind") as e:
        SamplingParams(output_kind=value)
    assert isinstance(e.value, HayabusaValidationError) and e.value.parameter == "output_kind"


def test_request_metrics_timestamps_are_set_in_order(llm):
    """vLLM's RequestMetrics: arrival <= first scheduled <= first token <= last token <= finished, all set (the
    first scheduling time was left None)."""
    m = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)[0].metrics
    times = [m.arrival_time, m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time]
    assert None not in times and times == sorted(times)
    assert m.num_generation_tokens == 5


def test_delta_add_keeps_prompt_logprobs_sent_in_two_outputs():
    """RequestOutput.add of DELTA outputs: prompt logprobs that came in two outputs (the rest of them follow when a
    request's samples reach their first token in different steps) are joined, not cut to the first part."""
    from hayabusa.outputs import CompletionOutput, RequestOutput

    def out(prompt_lps, ids, finished=False):
        return RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2, 3],
                             outputs=[CompletionOutput(index=0, text="x" * len(ids), token_ids=ids,
                                                       cumulative_logprob=None, logprobs=None, finish_reason=None)],
                             finished=finished, prompt_logprobs=prompt_lps)

    first = out([None, {2: 0.5}], [7])
    first.add(out([{3: 0.25}], [8], finished=True))
    assert first.prompt_logprobs == [None, {2: 0.5}, {3: 0.25}]
    assert first.outputs[0].token_ids == [7, 8] and first.outputs[0].text == "xx" and first.finished
    later = out(None, [9])
    later.add(out([None, {2: 0.5}], [10]))
    assert later.prompt_logprobs == [None, {2: 0.5}]
