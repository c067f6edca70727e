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
