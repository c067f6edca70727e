"""Speculative decoding under async scheduling: a step in which no running request may propose (the batch is
above disable_by_batch_size, every request is in a back-off) is scheduled while the previous one is still in
flight, as without speculation; a step that may carry proposals waits for the previous step's tokens. Greedy
token ids equal speculation off either way."""

from __future__ import annotations

from hayabusa import LLM, SamplingParams
from hayabusa.core.request import RequestStatus
from hayabusa.spec_decode.config import SpeculativeConfig
from hayabusa.spec_decode.scheduling import SpecDecodeScheduling
from tests.core.test_scheduler import make_scheduler, req
from tests.spec_decode.test_spec_scheduling import FixedProposer

PROMPTS = ["Once upon a time", "The capital of France is", "One day, Lily and Tom", "The little dog"]
MAX_TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _run(path: str, **kwargs):
    llm = LLM(path, device="cpu", async_scheduling=True, max_num_seqs=4, **kwargs)
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def test_batch_above_threshold_overlaps_like_speculation_off(tiny_llama):
    off, llm_off = _run(tiny_llama)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "disable_by_batch_size": 2}   # 4 running requests > 2: no step may propose
    on, llm_on = _run(tiny_llama, speculative_config=spec)
    assert on == off
    s_off, s_on = llm_off.llm_engine.stats, llm_on.llm_engine.stats
    # all four requests run together from the first step to the last: every step but the first is scheduled
    # while the one before it is in flight, with speculation on exactly as off
    assert s_off["num_steps"] == MAX_TOKENS and s_off["num_overlapped_steps"] == MAX_TOKENS - 1
    assert (s_on["num_steps"], s_on["num_overlapped_steps"]) == (s_off["num_steps"], s_off["num_overlapped_steps"])
    assert llm_on.get_metrics()["spec_decode_num_draft_tokens"] == 0


class WrongProposer:
    """Proposes, after a known sequence, its true next tokens plus one: never accepted under greedy."""

    def __init__(self, sequences: list[list[int]]) -> None:
        self.sequences = sequences

    def propose(self, token_ids, k: int) -> list[int]:
        ids = [int(t) for t in token_ids]
        for seq in self.sequences:
            if seq[:len(ids)] == ids and len(seq) > len(ids):
                return [t + 1 for t in seq[len(ids):len(ids) + k]]
        return []


def test_back_off_overlaps_and_keeps_greedy_output(tiny_llama):
    llm_off = LLM(tiny_llama, device="cpu", max_num_seqs=1)
    outs = llm_off.generate(PROMPTS, PARAMS, use_tqdm=False)
    off = [o.outputs[0].token_ids for o in outs]
    # k = 2, window 4, back-off 8: two rejected verify steps start a back-off of 8 output tokens, during which
    # the request's steps overlap
    spec = {"method": "ngram", "num_speculative_tokens": 2, "acceptance_window": 4, "acceptance_backoff": 8,
            "disable_by_payoff": False}   # (the measured rule off: the counts below follow the back-off alone)
    llm = LLM(tiny_llama, device="cpu", async_scheduling=True, max_num_seqs=1, speculative_config=spec)
    llm.llm_engine.scheduler.spec.proposer = WrongProposer([o.prompt_token_ids + o.outputs[0].token_ids
                                                            for o in outs])
    on = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert on == off
    stats, m = llm.llm_engine.stats, llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0 and m["spec_decode_num_accepted_tokens"] == 0
    assert stats["num_steps"] == len(PROMPTS) * MAX_TOKENS            # one token per step: nothing accepted
    # a verify step and the step after it run synchronously; back-off steps overlap
    assert 0 < stats["num_overlapped_steps"] < stats["num_steps"] - m["spec_decode_num_draft_tokens"] // 2


def test_proposals_with_async_scheduling_keep_greedy_output(stories_dir):
    # the trained stories model repeats itself: n-gram proposals get accepted
    off, _ = _run(stories_dir)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
            "min_acceptance_rate": 0, "disable_by_payoff": False}   # (every step may propose: no measured rule)
    on, llm = _run(stories_dir, speculative_config=spec)
    assert on == off
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] > 0
    # every step may carry proposals: each waits for the one before (none overlaps), and proposes exactly what
    # the synchronous engine proposes
    assert llm.llm_engine.stats["num_overlapped_steps"] == 0
    sync = LLM(stories_dir, device="cpu", async_scheduling=False, max_num_seqs=4, speculative_config=spec)
    assert [o.outputs[0].token_ids for o in sync.generate(PROMPTS, PARAMS, use_tqdm=False)] == off
    assert sync.get_metrics() == m


def test_wants_proposals_decided_before_scheduling():
    s = make_scheduler(num_blocks=64, block_size=4)
    cfg = SpeculativeConfig("ngram", 2, 3, 1, disable_by_batch_size=2, min_acceptance_rate=0.5,
                            acceptance_window=4, acceptance_backoff=3)
    s.spec = SpecDecodeScheduling(cfg, s.config.max_model_len)
    s.spec.proposer = FixedProposer([50, 51])
    assert not s.wants_proposals()                        # nothing running
    a = req("a", 6, max_tokens=40)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"a": [9]})
    assert s.wants_proposals()
    # two verify steps (k = 2 each) fill the window of 4 with nothing accepted: back-off for 3 output tokens
    for token in (10, 11):
        out = s.schedule()
        assert out.scheduled_spec_decode_tokens == {"a": [50, 51]}
        s.update_from_output(out, {"a": [token]})
    assert a.spec_backoff_until == 2 + 1 + 3 and not s.wants_proposals()
    for token in (12, 13, 14):
        out = s.schedule()
        assert out.scheduled_spec_decode_tokens == {}
        s.update_from_output(out, {"a": [token]})
    assert a.num_output_tokens == 6 and s.wants_proposals()
    # more running requests than disable_by_batch_size: no proposals whatever the requests' state
    for rid in ("b", "c"):
        s.add_request(req(rid, 6, max_tokens=40))
    s.update_from_output(s.schedule(), {"a": [15], "b": [9], "c": [9]})     # a's proposals (if any) rejected
    assert len(s.running) == 3 and not s.wants_proposals()
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    assert s.wants_proposals()
