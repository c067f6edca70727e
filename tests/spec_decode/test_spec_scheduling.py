"""The scheduler's side of speculative decoding, with pinned ids (no model): proposals in the step budget and KV
slots, num_computed_tokens rolled back past rejected proposals, stops inside an accepted run, the caps."""

from hayabusa.core.request import RequestStatus
from hayabusa.spec_decode.config import SpeculativeConfig
from hayabusa.spec_decode.scheduling import SpecDecodeScheduling
from tests.core.test_scheduler import make_scheduler, req


class FixedProposer:
    def __init__(self, drafts):
        self.drafts = drafts

    def propose(self, token_ids, k):
        return self.drafts[:k]


def spec_scheduler(drafts, k=3, **kw):
    s = make_scheduler(**kw)
    s.spec = SpecDecodeScheduling(SpeculativeConfig("ngram", k, 3, 1), s.config.max_model_len)
    s.spec.proposer = FixedProposer(drafts)
    return s


def test_proposals_are_scheduled_verified_and_rolled_back():
    s = spec_scheduler([50, 51, 52], num_blocks=16, block_size=4)
    a = req("a", 6, max_tokens=20)
    s.add_request(a)
    out = s.schedule()                                   # prefill: no proposals
    assert out.num_scheduled_tokens == {"a": 6} and out.scheduled_spec_decode_tokens == {}
    s.update_from_output(out, {"a": [9]})
    out = s.schedule()                                   # last token + 3 proposals: positions 6..9, a 3rd block
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_decode_tokens == {"a": [50, 51, 52]}
    assert out.new_block_ids == {"a": [2]} and out.sampling_req_ids == {"a"}
    assert a.num_computed_tokens == 10
    s.update_from_output(out, {"a": [50, 60]})           # 1 accepted + the token the target chose instead of 51
    assert a.output_token_ids == [9, 50, 60]
    assert a.num_computed_tokens == 8 == a.num_tokens - 1    # positions 8, 9 (rejected 51, 52) are recomputed
    assert (a.spec_num_draft_tokens, a.spec_num_accepted_tokens, a.spec_num_steps) == (3, 1, 1)
    assert (s.spec_num_draft_tokens, s.spec_num_accepted_tokens) == (3, 1)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.new_block_ids == {"a": []}   # its blocks still hold them


def test_budget_max_tokens_and_stop_inside_run():
    s = spec_scheduler([50, 2, 52], k=3, max_num_batched_tokens=64)
    a, b = req("a", 4, max_tokens=3), req("b", 4, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": [9], "b": [9]})
    out = s.schedule()
    # a may make 2 more tokens: one proposal (+ the bonus) at most; b gets all 3
    assert out.scheduled_spec_decode_tokens == {"a": [50], "b": [50, 2, 52]}
    s.update_from_output(out, {"a": [50, 8], "b": [50, 2, 52, 7]})
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [9, 50, 8]
    # EOS (2) accepted inside b's run ends it there; what followed is dropped
    assert b.status == RequestStatus.FINISHED_STOPPED and b.output_token_ids == [9, 50, 2]


def test_tight_budget_trims_proposals_and_no_kv_room_drops_them():
    s = spec_scheduler([50, 51, 52], k=3, max_num_batched_tokens=7, max_num_seqs=4)
    a, b = req("a", 3, max_tokens=10), req("b", 3, max_tokens=10)
    s.add_request(a)
    s.add_request(b)
    s.update_from_output(s.schedule(), {"a": [9], "b": [9]})
    out = s.schedule()
    # a budget of 7: a's full run (4), then b's token and the 2 proposals that still fit
    assert out.num_scheduled_tokens == {"a": 4, "b": 3}
    assert out.scheduled_spec_decode_tokens == {"a": [50, 51, 52], "b": [50, 51]}
    # one free block for two requests that each need a new one: proposals go before anyone is preempted
    s2 = spec_scheduler([50, 51, 52], k=3, num_blocks=2, block_size=4)
    c = req("c", 3, max_tokens=10)
    s2.add_request(c)
    s2.update_from_output(s2.schedule(), {"c": [9]})
    s2.kv.block_pool.take(1)                                     # someone else holds the last free block
    out = s2.schedule()
    assert out.num_scheduled_tokens == {"c": 1} and out.scheduled_spec_decode_tokens == {}
    assert s2.num_preemptions == 0


def test_low_acceptance_rule_backs_off_then_tries_again():
    # window 6 proposals, rate 0.5, back-off 4 output tokens; k = 3, every proposal wrong (target says 70 + i)
    s = make_scheduler(num_blocks=64, block_size=4)
    cfg = SpeculativeConfig("ngram", 3, 3, 1, min_acceptance_rate=0.5, acceptance_window=6, acceptance_backoff=4)
    s.spec = SpecDecodeScheduling(cfg, s.config.max_model_len)
    s.spec.proposer = FixedProposer([50, 51, 52])
    a = req("a", 6, max_tokens=40)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"a": [9]})
    proposed = []
    for i in range(12):
        out = s.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("a", [])
        proposed.append(len(drafts))
        s.update_from_output(out, {"a": [70 + i]})     # nothing accepted: one token per step
    # two verify steps fill the window (6 proposals, 0 accepted): the next 4 output tokens come without proposals,
    # then a new window of two verify steps, then another back-off
    assert proposed == [3, 3, 0, 0, 0, 0, 3, 3, 0, 0, 0, 0]
    assert a.spec_num_draft_tokens == 12 and a.spec_num_accepted_tokens == 0


def test_low_acceptance_rule_keeps_proposing_when_accepted():
    s = make_scheduler(num_blocks=64, block_size=4)
    cfg = SpeculativeConfig("ngram", 2, 3, 1, min_acceptance_rate=0.5, acceptance_window=4, acceptance_backoff=4)
    s.spec = SpecDecodeScheduling(cfg, s.config.max_model_len)
    s.spec.proposer = FixedProposer([50, 51])
    a = req("a", 6, max_tokens=40)
    s.add_request(a)
    s.update_from_output(s.schedule(), {"a": [9]})
    for i in range(6):   # one of two accepted each time: rate 0.5, not below the threshold
        out = s.schedule()
        assert out.scheduled_spec_decode_tokens == {"a": [50, 51]}
        s.update_from_output(out, {"a": [50, 80 + i]})
    assert a.spec_backoff_until == 0


def test_low_acceptance_rule_config():
    from hayabusa.spec_decode.config import (DEFAULT_ACCEPTANCE_BACKOFF, DEFAULT_ACCEPTANCE_WINDOW,
                                             DEFAULT_MIN_ACCEPTANCE_RATE, parse_speculative_config)
    from hayabusa.errors import HayabusaValidationError
    import pytest

    c = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2})
    assert (c.min_acceptance_rate, c.acceptance_window, c.acceptance_backoff) == (
        DEFAULT_MIN_ACCEPTANCE_RATE, DEFAULT_ACCEPTANCE_WINDOW, DEFAULT_ACCEPTANCE_BACKOFF)
    c = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "min_acceptance_rate": 0}')
    assert c.min_acceptance_rate == 0.0
    for key, value in (("min_acceptance_rate", 1.5), ("min_acceptance_rate", float("nan")),
                       ("min_acceptance_rate", True), ("acceptance_window", 0), ("acceptance_backoff", -1)):
        with pytest.raises(HayabusaValidationError) as e:
            parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, key: value})
        assert e.value.parameter == f"speculative_config.{key}"


def test_ngram_config_model_key():
    import pytest

    from hayabusa.errors import HayabusaValidationError
    from hayabusa.spec_decode.config import parse_speculative_config

    # vLLM's spellings of the n-gram proposer as a "model"
    for spec in ({"model": "[ngram]", "num_speculative_tokens": 2}, {"model": "ngram", "num_speculative_tokens": 2},
                 {"method": "[ngram]", "num_speculative_tokens": 2},
                 {"method": "ngram", "model": "[ngram]", "num_speculative_tokens": 2}):
        c = parse_speculative_config(spec)
        assert (c.method, c.model, c.num_speculative_tokens) == ("ngram", None, 2)
    # a checkpoint given with method ngram would be silently unused: refused by name
    with pytest.raises(HayabusaValidationError) as e:
        parse_speculative_config({"method": "ngram", "model": "/some/draft", "num_speculative_tokens": 2})
    assert e.value.parameter == "speculative_config.model" and "draft_model" in str(e.value)


def test_batched_ngram_lookups_schedule_the_same_proposals_as_single_ones():
    """The scheduler's n-gram lookups run batched (SpecDecodeScheduling.lookup_all); per request (a proposer
    without propose_batch) they give the same proposals, budget-trimmed the same way."""
    import random

    from hayabusa import SamplingParams
    from hayabusa.core.request import Request
    from hayabusa.spec_decode.ngram import NgramProposer

    class SingleOnly:   # the same lookups, one request at a time
        def __init__(self, p):
            self.p = p

        def propose(self, token_ids, k):
            return self.p.propose(token_ids, k)

    rng = random.Random(3)
    for budget in (64, 9):     # 9: the later requests' proposals are trimmed by the step's budget
        outs = []
        for single in (False, True):
            s = make_scheduler(max_num_batched_tokens=budget, max_num_seqs=6, num_blocks=64, block_size=4)
            s.spec = SpecDecodeScheduling(SpeculativeConfig("ngram", 3, 3, 1), s.config.max_model_len)
            if single:
                s.spec.proposer = SingleOnly(s.spec.proposer)
            assert isinstance(s.spec.proposer, NgramProposer) != single
            rng.seed(budget)
            for i in range(6):
                s.add_request(Request(f"r{i}", [rng.randrange(3, 6) for _ in range(8)], SamplingParams(max_tokens=12),
                                      eos_token_ids=(2,), max_tokens=12))
            steps = []
            while s.running or s.waiting:
                out = s.schedule()
                steps.append((dict(out.num_scheduled_tokens), dict(out.scheduled_spec_decode_tokens)))
                sampled = {}
                for rid, n in out.num_scheduled_tokens.items():
                    drafts = out.scheduled_spec_decode_tokens.get(rid, [])
                    # accept the first proposal when there are two or more, then a token of its own
                    sampled[rid] = drafts[:1 if len(drafts) > 1 else 0] + [3 + (n + len(rid)) % 3]
                s.update_from_output(out, sampled)
            outs.append(steps)
        assert outs[0] == outs[1]
        assert sum(len(d) for _, spec in outs[0] for d in spec.values()) > 10      # proposals were made


def test_null_and_empty_json_mean_off_and_a_plain_word_says_what_is_wanted():
    """``--speculative-config null`` / ``{}`` turn speculation off as ``None`` does in Python; a word that is not
    JSON (a Python user passing "ngram") is told a dict or a JSON object is wanted."""
    import pytest

    from hayabusa.errors import HayabusaValidationError
    from hayabusa.spec_decode.config import parse_speculative_config

    assert parse_speculative_config("null") is None and parse_speculative_config("{}") is None
    with pytest.raises(HayabusaValidationError, match="must be a dict, or a JSON object string") as e:
        parse_speculative_config("ngram")
    assert e.value.parameter == "speculative_config" and "got 'ngram'" in str(e.value)
