"""Speculative decoding's measured turn-off rule (``disable_by_payoff``, hayabusa/spec_decode/payoff.py): with a
fake clock that makes speculative steps slower per token, a bucket turns speculation off after its stated start-up
samples, back on after a probe once they are faster; seeded sampling requests ignore it; greedy ids unchanged; the
keys' validation."""

from __future__ import annotations

import pytest

from hayabusa import LLM, SamplingParams
from hayabusa.core.request import RequestStatus
from hayabusa.errors import HayabusaValidationError
from hayabusa.spec_decode.config import (DEFAULT_DISABLE_BY_PAYOFF, DEFAULT_PAYOFF_MARGIN, DEFAULT_PAYOFF_PROBE_EVERY,
                                         DEFAULT_PAYOFF_WINDOW, SpeculativeConfig, parse_speculative_config)
from hayabusa.spec_decode.payoff import PayoffRule, bucket_of
from hayabusa.spec_decode.scheduling import SpecDecodeScheduling
from tests.core.test_scheduler import make_scheduler, req

pytestmark = pytest.mark.payoff_default   # the rule at its default (tests/conftest.py turns it off elsewhere)

SPEC, PLAIN = True, False


def _drive(rule, n, steps, timing):
    """Run ``steps`` steps of a bucket: each in the mode the rule picks, measured by ``timing(mode)`` ->
    (tokens per request, seconds). Returns the modes, in order."""
    modes = []
    for _ in range(steps):
        mode = rule.speculate(n)
        rule.scheduled(n, mode)
        rule.record(n, mode, *timing(mode))
        modes.append(mode)
    return modes


def test_bucket_of_is_the_power_of_two_at_or_above():
    assert [bucket_of(n) for n in (0, 1, 2, 3, 4, 5, 9, 16, 17)] == [1, 1, 2, 4, 4, 8, 16, 16, 32]


def test_slower_speculation_is_turned_off_after_start_up_then_probed_and_turned_back_on():
    w, every = 3, 5
    rule = PayoffRule(margin=0.03, window=w, probe_every=every)
    gaps = PayoffRule(margin=0.03, window=w, probe_every=every)    # the same seed: the same probe gaps
    g1, g2 = gaps.next_gap(), gaps.next_gap()
    assert all(every // 2 <= g <= every * 3 // 2 for g in (g1, g2))
    slow = {SPEC: (2.0, 1.0), PLAIN: (1.0, 0.25)}.get     # speculation: 2 tok/s per request, plain 4
    # start-up: 1 + w speculative steps (the first of each run of a mode is not counted), a plain probe of 1 + w,
    # then off; after a gap of g1 plain samples a probe of 1 + w speculative steps, still slower: off again
    modes = _drive(rule, 4, 3 * (w + 1) + g1 + (1 + g2), slow)
    assert modes == [SPEC] * (w + 1) + [PLAIN] * (w + 1) + [PLAIN] * g1 + [SPEC] * (w + 1) + [PLAIN] * (1 + g2)
    assert rule.speculate(4) is SPEC                       # the next probe is due
    st = rule.snapshot()[4]
    assert st["speculating"] is False and st["spec_rate"] == pytest.approx(2.0) and st["plain_rate"] == 4.0
    assert (st["spec_steps"], st["plain_steps"]) == (2 * (w + 1), (w + 1) + g1 + (1 + g2))
    # other buckets are untouched: they start speculating
    assert rule.speculate(1) and rule.speculate(16) and set(rule.buckets) == {4}
    # speculation becomes faster (acceptance went up): 12 tok/s. The probed mode is rated over its last 4 probes,
    # so the first fast probe (3 fast samples beside 6 slow ones: 3.1 tok/s) is not enough, the second (4.0) is
    fast = {SPEC: (3.0, 0.25), PLAIN: (1.0, 0.25)}.get
    g3 = gaps.next_gap()
    modes = _drive(rule, 4, (w + 1) + (1 + g3) + (w + 1), fast)
    assert modes == [SPEC] * (w + 1) + [PLAIN] * (1 + g3) + [SPEC] * (w + 1)
    assert rule.snapshot()[4]["speculating"] is True
    # and from then on it probes plain decoding after each gap of speculative samples, then goes on speculating
    g4, g5 = gaps.next_gap(), gaps.next_gap()
    modes = _drive(rule, 4, g4 + (w + 1) + (1 + g5), fast)
    assert modes == [SPEC] * g4 + [PLAIN] * (w + 1) + [SPEC] * (1 + g5)


def test_one_unlucky_window_does_not_turn_speculation_off():
    """Decisions only at probe ends, on the chosen mode's history: a run of slow speculative steps between probes
    (a request's start, before its copying begins) leaves speculation on when it pays on the whole."""
    w, every = 4, 40
    rule = PayoffRule(margin=0.03, window=w, probe_every=every)
    steps = iter(range(10 ** 6))

    def phases(mode):   # speculation: 1.5 tok per 1 s at the first 10 of every 50 steps, else 4 per 1 s; plain 2
        if mode is PLAIN:
            return 1.0, 0.5
        return (1.5, 1.0) if next(steps) % 50 < 10 else (4.0, 1.0)

    modes = _drive(rule, 1, 1000, phases)
    assert modes.count(SPEC) > 0.75 * len(modes)    # 81 % (the first version, deciding after every sample: 36 %)
    assert rule.snapshot()[1]["speculating"] is True


def test_probe_gaps_vary_within_half_to_one_and_a_half_probe_every():
    rule = PayoffRule(margin=0.03, window=8, probe_every=256)
    gaps = [rule.next_gap() for _ in range(200)]
    assert min(gaps) >= 128 and max(gaps) <= 384 and len(set(gaps)) > 50
    again = PayoffRule(margin=0.03, window=8, probe_every=256)
    assert [again.next_gap() for _ in range(200)] == gaps          # seeded: every run probes at the same steps


@pytest.mark.parametrize("ratio, speculating", [(0.98, True), (0.96, False), (1.5, True)])
def test_margin(ratio, speculating):
    """Speculation stays on unless it is slower than plain decoding by more than the margin (3 %)."""
    rule = PayoffRule(margin=0.03, window=2, probe_every=100)
    _drive(rule, 1, 8, {SPEC: (ratio, 1.0), PLAIN: (1.0, 1.0)}.get)
    assert rule.snapshot()[1]["speculating"] is speculating


def test_seeded_requests_ignore_the_rule_and_the_step_is_measured_in_its_mode():
    s = make_scheduler(max_num_seqs=4)
    cfg = SpeculativeConfig("ngram", 2, 3, 1)
    s.spec = SpecDecodeScheduling(cfg, s.config.max_model_len)

    class Fixed:
        def propose(self, token_ids, k):
            return [50, 51][:k]

    s.spec.proposer = Fixed()
    seeded = req("seeded", 4, max_tokens=20, temperature=0.8, seed=7)
    unseeded = req("unseeded", 4, max_tokens=20, temperature=0.8)
    greedy = req("greedy", 4, max_tokens=20, temperature=0.0, seed=7)   # greedy: a seed changes nothing
    for r in (seeded, unseeded, greedy):
        s.add_request(r)
    s.update_from_output(s.schedule(), {"seeded": [9], "unseeded": [9], "greedy": [9]})   # prefill
    assert s.wants_proposals()
    out = s.schedule()          # bucket 4 starts speculating: everyone proposes
    assert set(out.scheduled_spec_decode_tokens) == {"seeded", "unseeded", "greedy"}
    s.update_from_output(out, {"seeded": [50, 1], "unseeded": [50, 1], "greedy": [50, 1]})
    s.record_step_time(out.step_id, 0.5)
    assert s.spec.payoff.buckets[4].last_mode is True     # recorded (the first of its mode: not a sample)

    s.spec.payoff.state(3).speculating = False             # the bucket measured speculation slower
    assert s.wants_proposals()                             # the seeded request still may propose
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {"seeded": [50, 51]}
    s.update_from_output(out, {"seeded": [50, 51, 1], "unseeded": [3], "greedy": [3]})
    s.record_step_time(out.step_id, 0.5)
    st = s.spec.payoff.buckets[4]
    assert (st.num_spec_steps, st.num_plain_steps, st.last_mode) == (1, 1, False)

    s.finish_requests(["seeded"], RequestStatus.FINISHED_ABORTED)
    assert s.wants_proposals()              # bucket 2 is new: it speculates...
    s.spec.payoff.state(2).speculating = False
    assert not s.wants_proposals()          # ...but off there, no one left may propose: the step may overlap
    out = s.schedule()
    assert out.scheduled_spec_decode_tokens == {} and out.num_scheduled_tokens == {"unseeded": 1, "greedy": 1}


def test_prompt_chunks_are_not_measured():
    s = make_scheduler(max_num_seqs=4)
    s.spec = SpecDecodeScheduling(SpeculativeConfig("ngram", 2, 3, 1), s.config.max_model_len)
    a = req("a", 4, max_tokens=20, temperature=0.0)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"a": [9]})
    s.add_request(req("b", 6, max_tokens=20, temperature=0.0))
    out = s.schedule()                   # a decodes, b's prompt is admitted: not a decode-only step
    assert out.num_scheduled_tokens["b"] == 6 and out.step_id not in s._payoff_steps
    assert s.spec.payoff.buckets[1].num_spec_steps == 1   # counted in its mode all the same


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _timed_llm(path, cost, async_scheduling=False, **spec):
    """An LLM whose steps take ``cost(sched, i)`` fake seconds each (i: the step's index); returns (llm, list of
    the steps' had-proposals)."""
    llm = LLM(path, device="cpu", max_num_seqs=4, async_scheduling=async_scheduling, speculative_config=dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}, **spec))
    engine = llm.llm_engine
    engine.clock = clock = FakeClock()
    launch, trace = engine.runner.launch, []

    def timed_launch(sched):
        clock.t += cost(sched, len(trace))
        trace.append(bool(sched.scheduled_spec_decode_tokens))
        return launch(sched)

    engine.runner.launch = timed_launch
    return llm, trace


class RepeatProposer:
    def propose(self, token_ids, k):
        return list(token_ids[-k:])


def test_engine_turns_slow_speculation_off_and_back_on_with_greedy_ids_unchanged(tiny_llama):
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    prompt = ["Once upon a time"]
    ref = LLM(tiny_llama, device="cpu").generate(prompt, params, use_tqdm=False)[0]
    switch = 10   # from the 11th step on, speculative steps become cheap

    def cost(sched, i):
        if not sched.scheduled_spec_decode_tokens:
            return 1.0
        return 10.0 if i < switch else 0.1      # <= 4 tokens a step: 0.4 tok/s (plain: 1), then >= 10

    w, every = 2, 4
    llm, trace = _timed_llm(tiny_llama, cost, payoff_window=w, payoff_probe_every=every)
    gaps = PayoffRule(margin=0.03, window=w, probe_every=every)     # the engine's rule draws the same gaps
    oracle = ref.prompt_token_ids + ref.outputs[0].token_ids

    class Oracle:   # the reference continuation: every proposal accepted
        def propose(self, token_ids, k):
            n = len(token_ids)
            return oracle[n:n + k] if list(token_ids) == oracle[:n] else []

    llm.llm_engine.scheduler.spec.proposer = Oracle()
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # step 0: the prompt (not measured); start-up: 1 + w speculative, a plain probe of 1 + w, then off for a gap
    # of plain samples; then a probe of 1 + w speculative steps (cheap by then)
    g1 = gaps.next_gap()
    head = [False] + [True] * (w + 1) + [False] * (w + 1) + [False] * g1 + [True] * (w + 1)
    assert trace[:len(head)] == head
    # the probed mode is rated over its last 4 probes: the slow start-up samples keep speculation off for a few
    # more probes, then it is back on, probing plain decoding for 1 + w steps after each gap
    rule = llm.llm_engine.scheduler.spec.payoff
    assert rule.snapshot()[1]["speculating"] is True
    last_on = max(i for i in range(1, len(trace)) if trace[i] and not trace[i - 1] and
                  all(trace[i:i + w + 2]))
    assert last_on < 40 and trace[-8:].count(True) >= 5
    m = llm.get_metrics()
    assert m["spec_decode_payoff_plain_steps"] == trace[1:].count(False)
    gauge = [x for x in m if x.name == "hayabusa:spec_decode_payoff_speculating"]
    assert [(g.labels["bucket"], g.value) for g in gauge] == [("1", 1.0)]
    from hayabusa.engine.async_llm_engine import AsyncLLMEngine   # the server's snapshot (its /metrics)

    stats = AsyncLLMEngine(llm.llm_engine, start_engine_loop=False).get_stats()
    assert stats["spec_decode_payoff_plain_steps"] == trace[1:].count(False)


def test_steps_whose_requests_speculation_leaves_alone_are_not_measured(tiny_llama):
    # requests with logprobs never get proposals (static rule): their steps are plain steps whatever the mode, so
    # they are no evidence about speculation; measured as speculative ones, a slow start (here the steps right
    # after the prompt) turned speculation off for the bucket, and the eligible requests after them decoded
    # without proposals until the next probe
    w, every = 2, 64
    llm, trace = _timed_llm(tiny_llama, lambda sched, i: 10.0 if 1 <= i <= 3 else 1.0, payoff_window=w,
                            payoff_probe_every=every)
    llm.generate(["Once upon a time"], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=1),
                 use_tqdm=False)
    assert not any(trace)
    payoff = llm.llm_engine.scheduler.spec.payoff
    assert all(st.num_spec_steps == 0 and not st.spec.samples and not st.plain.samples
               for st in payoff.buckets.values())
    llm.llm_engine.scheduler.spec.proposer = RepeatProposer()
    n = len(trace)
    llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    assert trace[n:n + 3] == [False, True, True]   # the prompt, then verify steps from the first decode step


def test_engine_seeded_sampling_is_the_same_whatever_the_timing(tiny_llama):
    prompts = ["Once upon a time", "The capital of France is"]
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    runs = []
    for spec_cost in (10.0, 0.1):   # speculation slow (the rule turns it off) or fast (it stays on)
        # a step in which both requests propose (speculative mode) costs spec_cost, the others 1
        llm, trace = _timed_llm(tiny_llama, lambda sched, i, c=spec_cost: c if len(sched.scheduled_spec_decode_tokens)
                                > 1 else 1.0, payoff_window=2, payoff_probe_every=100)
        llm.llm_engine.scheduler.spec.proposer = RepeatProposer()
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append([(o.outputs[0].token_ids, o.metrics.spec_num_draft_tokens) for o in outs])
    (seeded_slow, greedy_slow), (seeded_fast, greedy_fast) = runs
    assert seeded_slow == seeded_fast and seeded_slow[1] > 0      # same tokens, same proposals
    assert greedy_slow[0] == greedy_fast[0]
    assert greedy_slow[1] < greedy_fast[1]                         # the rule took the greedy one's proposals


def test_defaults_and_off():
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    assert (cfg.disable_by_payoff, cfg.payoff_margin, cfg.payoff_window, cfg.payoff_probe_every) == \
        (DEFAULT_DISABLE_BY_PAYOFF, DEFAULT_PAYOFF_MARGIN, DEFAULT_PAYOFF_WINDOW, DEFAULT_PAYOFF_PROBE_EVERY) == \
        (True, 0.03, 8, 256)
    assert SpecDecodeScheduling(cfg, 64).payoff is not None
    off = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "disable_by_payoff": False})
    assert SpecDecodeScheduling(off, 64).payoff is None


@pytest.mark.parametrize("key, value", [
    ("disable_by_payoff", 1), ("disable_by_payoff", "yes"), ("payoff_margin", 1.0), ("payoff_margin", -0.01),
    ("payoff_margin", True), ("payoff_margin", "0.03"), ("payoff_window", 0), ("payoff_window", 2.5),
    ("payoff_window", None), ("payoff_probe_every", 0), ("payoff_probe_every", True),
])
def test_bad_keys_are_named(key, value):
    with pytest.raises(HayabusaValidationError) as e:
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, key: value})
    assert e.value.parameter == f"speculative_config.{key}" and e.value.value == value
    assert key in str(e.value) and repr(value) in str(e.value)


def test_engine_with_async_scheduling_overlaps_the_steps_the_rule_turns_off(tiny_llama):
    """Under async scheduling a step without proposals overlaps the one before; once the rule has turned slow
    speculation off, the steps overlap as with speculation off (what the rule is for on the device)."""
    prompts = ["Once upon a time", "The capital of France is"]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(tiny_llama, device="cpu").generate(prompts, params, use_tqdm=False)]
    llm, trace = _timed_llm(tiny_llama, lambda sched, i: 10.0 if sched.scheduled_spec_decode_tokens else 1.0,
                            async_scheduling=True, payoff_window=2, payoff_probe_every=1000)
    llm.llm_engine.scheduler.spec.proposer = RepeatProposer()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == ref
    # start-up: 3 speculative steps, a plain probe of 3; then plain to the end (a bucket of 2 requests)
    assert trace[1:7] == [True] * 3 + [False] * 3 and not any(trace[7:])
    stats = llm.llm_engine.stats
    assert stats["num_overlapped_steps"] >= len(trace) - 10
    assert llm.get_metrics()["spec_decode_payoff_plain_steps"] == len(trace) - 4


def test_metrics_endpoint_exports_the_rules_plain_steps():
    from hayabusa.entrypoints.openai.server import _EngineCollector

    class FakeEngine:
        def get_stats(self):
            return {"num_requests_running": 1, "num_requests_waiting": 0, "kv_cache_usage": 0.5,
                    "num_prompt_tokens": 10, "num_generation_tokens": 20, "num_preemptions": 0,
                    "spec_decode_num_draft_tokens": 12, "spec_decode_num_accepted_tokens": 7,
                    "spec_decode_payoff_plain_steps": 5}

    families = {f.name: f for f in _EngineCollector(FakeEngine(), {"model_name": "m"}).collect()}
    assert families["hayabusa:spec_decode_payoff_plain_steps"].samples[0].value == 5


def test_a_decode_step_whose_window_holds_an_admission_is_not_a_sample():
    """Async scheduling: a decode step is timed from its schedule to its collection, which comes after the next
    step's launch. When that next step admits a request (a prompt chunk: an eager launch of 15-25 ms on an H200
    for SmolLM2), the decode step's time is mostly the admission's, so it is not given to the rule."""
    s = make_scheduler(max_num_seqs=4)
    s.spec = SpecDecodeScheduling(SpeculativeConfig("ngram", 2, 3, 1), s.config.max_model_len)
    recorded = []
    real = s.spec.payoff.record
    s.spec.payoff.record = lambda *a: recorded.append(a[:2]) or real(*a)
    for name in ("a", "b"):
        s.add_request(req(name, 4, max_tokens=20))
    s.update_from_output(s.schedule(), {"a": [9], "b": [9]})           # prefill
    s.spec.payoff.state(2).speculating = False                          # plain steps: they overlap
    d0 = s.schedule()
    d1 = s.schedule()                                                   # scheduled while d0 is in flight
    assert d0.num_scheduled_tokens == d1.num_scheduled_tokens == {"a": 1, "b": 1}
    s.update_from_output(d0, {"a": [3], "b": [3]})
    s.record_step_time(d0.step_id, 0.001)
    assert recorded == [(2, False)]                                     # a decode step's window: a sample
    s.add_request(req("c", 6, max_tokens=20))
    d2 = s.schedule()                                                   # admits c while d1 is in flight
    assert d2.num_scheduled_tokens["c"] == 6
    s.update_from_output(d1, {"a": [4], "b": [4]})
    s.record_step_time(d1.step_id, 0.020)
    assert recorded == [(2, False)]                                     # its window held the admission
