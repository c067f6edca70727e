"""Speculation configured but turned off by batch size (issue #21, W1): a step in which no request may propose
takes exactly the path of speculation off. Spies count the speculative work: no proposal is asked for (the
scheduler's ``SpecDecodeScheduling.propose`` / ``may_propose`` and the n-gram proposer are never called), every
running request is scheduled by the plain decode loop (``Scheduler._schedule_decodes``), no step carries proposals,
and the runner never builds a verify step (``write_drafts`` / ``plan_verify``); the engine asks one O(1) question
per step (``wants_proposals``, answered by ``enabled_for_batch``). Greedy ids equal speculation off."""

from __future__ import annotations

import functools

import hayabusa.worker.model_runner as model_runner
from hayabusa import LLM, SamplingParams
from hayabusa.spec_decode.ngram import NgramProposer
from hayabusa.spec_decode.scheduling import SpecDecodeScheduling

PROMPTS = ["Once upon a time", "The capital of France is", "One day, Lily and Tom", "The little dog",
           "吾輩は猫である。", "東京は日本の首都で、"]
MAX_TOKENS = 20
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# prompt_lookup_min 1: a proposal would be found almost every step, if one were asked for
# (the measured turn-off rule off: these tests follow the static rules' path, step by step)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4,
         "disable_by_batch_size": 2, "disable_by_payoff": False}


class Spies:
    """Call counters around functions of the speculative path (patched with monkeypatch: undone after the test)."""

    def __init__(self, monkeypatch) -> None:
        self.calls: dict[str, int] = {}
        self.mp = monkeypatch

    def spy(self, owner, name: str, key: str | None = None) -> None:
        fn = getattr(owner, name)
        key = key or name
        self.calls[key] = 0

        @functools.wraps(fn)
        def counted(*a, **kw):
            self.calls[key] += 1
            return fn(*a, **kw)

        self.mp.setattr(owner, name, counted)


def spy_speculative_path(monkeypatch, llm) -> tuple[Spies, list[tuple[int, int, int]]]:
    """Spies on the speculative path, and per scheduled step (running requests before it, of them scheduled by
    the decode loop, proposals carried)."""
    spies = Spies(monkeypatch)
    spies.spy(SpecDecodeScheduling, "propose")
    spies.spy(SpecDecodeScheduling, "may_propose")
    spies.spy(SpecDecodeScheduling, "lookup_all")
    spies.spy(NgramProposer, "propose", "ngram_propose")
    spies.spy(NgramProposer, "propose_batch", "ngram_propose_batch")
    spies.spy(model_runner, "write_drafts")
    spies.spy(model_runner, "plan_verify")
    spies.spy(llm.llm_engine.scheduler.__class__, "wants_proposals")
    sched = llm.llm_engine.scheduler
    steps: list[tuple[int, int, int]] = []
    decodes = sched._schedule_decodes
    schedule = sched.schedule
    last = {}

    def counted_decodes(plan, budget):
        i, left = decodes(plan, budget)
        last["decoded"] = i
        return i, left

    def recording_schedule():
        last.clear()
        running = len(sched.running)
        out = schedule()
        if not out.is_empty:
            steps.append((running, last.get("decoded", 0), sum(map(len, out.scheduled_spec_decode_tokens.values()))))
        return out

    monkeypatch.setattr(sched, "_schedule_decodes", counted_decodes)
    monkeypatch.setattr(sched, "schedule", recording_schedule)
    return spies, steps


def _run(path: str, monkeypatch=None, **kwargs):
    llm = LLM(path, device="cpu", async_scheduling=True, max_num_seqs=len(PROMPTS), **kwargs)
    spied = spy_speculative_path(monkeypatch, llm) if monkeypatch is not None else None
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm, spied


def test_disabled_by_batch_size_takes_the_plain_path(tiny_llama, monkeypatch):
    off, llm_off, _ = _run(tiny_llama)
    on, llm_on, (spies, steps) = _run(tiny_llama, monkeypatch, speculative_config=NGRAM)
    assert on == off
    assert all(len(ids) == MAX_TOKENS for ids in on)
    # 6 requests run together (> disable_by_batch_size = 2) from the first step: nothing speculative runs
    assert spies.calls["propose"] == spies.calls["may_propose"] == spies.calls["ngram_propose"] == 0
    assert spies.calls["lookup_all"] == spies.calls["ngram_propose_batch"] == 0
    assert spies.calls["write_drafts"] == spies.calls["plan_verify"] == 0
    # the engine's one question per step() with a step in flight (the 19 overlapped ones and the last, which
    # schedules nothing), answered by the batch-size rule without looking at requests (may_propose: 0 calls)
    s_on, s_off = llm_on.llm_engine.stats, llm_off.llm_engine.stats
    assert spies.calls["wants_proposals"] == s_on["num_steps"] == MAX_TOKENS
    assert (s_on["num_steps"], s_on["num_overlapped_steps"]) == (s_off["num_steps"], s_off["num_overlapped_steps"])
    # every step after the prefill: all running requests through the plain decode loop, no proposals carried
    assert len(steps) == s_on["num_steps"] == MAX_TOKENS
    assert steps[0] == (0, 0, 0)                                  # the prefill: nothing running yet
    assert steps[1:] == [(len(PROMPTS), len(PROMPTS), 0)] * (MAX_TOKENS - 1)
    assert llm_on.get_metrics()["spec_decode_num_draft_tokens"] == 0


def test_spies_see_proposals_below_the_threshold(tiny_llama, monkeypatch):
    """The spies are not blind: with the batch within disable_by_batch_size the same run proposes."""
    on, llm, (spies, steps) = _run(tiny_llama, monkeypatch, speculative_config=dict(NGRAM, disable_by_batch_size=0))
    assert spies.calls["propose"] > 0 and spies.calls["may_propose"] > 0
    assert spies.calls["lookup_all"] > 0 and spies.calls["ngram_propose_batch"] > 0   # the step's lookups, batched
    assert spies.calls["write_drafts"] > 0 and spies.calls["plan_verify"] > 0
    assert any(n for _, _, n in steps) and llm.get_metrics()["spec_decode_num_draft_tokens"] > 0
    off, _, _ = _run(tiny_llama)
    assert on == off
