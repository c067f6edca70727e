"""The verify step's greedy path (worker/spec_verify.py, kernels/greedy_verify.py): greedy output identical with it
on and off (n-gram, an oracle proposer with rejections, a draft model) and to speculation off; the steps it takes
counted; its aten op count per verify call against the general path's; steps where a sampled request has
proposals keep the exact rejection-sampling path."""

from __future__ import annotations

import pytest
import torch

import hayabusa.worker.model_runner as model_runner
import hayabusa.worker.spec_verify as spec_verify
from hayabusa import LLM, SamplingParams
from hayabusa.bench.common import AtenOpCounter
from tests.spec_decode.test_spec_engine import (  # noqa: F401  (reference: a fixture)
    MAX_TOKENS, NGRAM, PROMPTS, RepeatProposer, _ids, _oracle_llm, reference)

# Each test runs one engine twice (greedy fast path on, then off) and compares what the runs verified: the
# measured turn-off rule (which would carry its timing-dependent decisions from the first run into the second) off.
STATIC = {"disable_by_payoff": False}

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# aten ops per verify call of an all-greedy n-gram step: argmax, the plan's gather, compare, cumsum, compare,
# masked fill, plus views (the kernel on CUDA: argmax, the plan's copy, the output's allocation)
GREEDY_MAX_OPS = 10


def _run(llm: LLM, prompts, params, fast: bool) -> list[list[int]]:
    runner = llm.llm_engine.runner
    runner.greedy_verify_fast_path = fast
    runner.num_greedy_verify_steps = 0
    return _ids(llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
def test_greedy_path_on_and_off_equal_speculation_off(reference, proposer):
    path, outs = reference["qwen2"]
    if proposer == "ngram":
        llm = LLM(path, max_num_seqs=3, device="cpu", speculative_config=dict(NGRAM, **STATIC))
    else:
        llm, _ = _oracle_llm(path, outs, spec=STATIC, max_num_seqs=4)
    on = _run(llm, PROMPTS, GREEDY, fast=True)
    steps_on = llm.llm_engine.runner.num_greedy_verify_steps
    off = _run(llm, PROMPTS, GREEDY, fast=False)
    assert on == off == _ids(outs)
    assert steps_on > 0 and llm.llm_engine.runner.num_greedy_verify_steps == 0
    m = llm.get_metrics()
    assert m["spec_decode_num_draft_tokens"] > 0
    if proposer == "oracle":   # runs accepted in full, in part and not at all (n-gram on random weights: none)
        assert 0 < m["spec_decode_num_accepted_tokens"] < m["spec_decode_num_draft_tokens"]


def test_draft_model_takes_the_greedy_path(tiny_llama):
    base = _ids(LLM(tiny_llama, max_num_seqs=4, device="cpu").generate(PROMPTS, GREEDY, use_tqdm=False))
    # the target as its own draft: every proposal accepted, proposals read from the device
    llm = LLM(tiny_llama, max_num_seqs=4, device="cpu",
              speculative_config={"model": tiny_llama, "num_speculative_tokens": 3})
    on = _run(llm, PROMPTS, GREEDY, fast=True)
    steps_on = llm.llm_engine.runner.num_greedy_verify_steps
    off = _run(llm, PROMPTS, GREEDY, fast=False)
    assert on == off == base
    assert steps_on > 0 and llm.llm_engine.runner.num_greedy_verify_steps == 0
    m = llm.get_metrics()
    assert m["spec_decode_num_accepted_tokens"] == m["spec_decode_num_draft_tokens"] > 0


def test_mixed_steps_keep_rejection_sampling_for_sampled_requests(reference, monkeypatch):
    """Greedy and seeded sampled requests with proposals in the same steps: the steps with a sampled proposing
    request go through rejection_sample (with its target probabilities), the greedy requests' ids are the
    reference's, and every id is the same with the greedy path off."""
    path, outs = reference["llama"]
    calls = []
    original = spec_verify.rejection_sample

    def spy(*args, **kwargs):
        calls.append(args[3] is not None)    # target_probs: some row samples
        return original(*args, **kwargs)

    monkeypatch.setattr(spec_verify, "rejection_sample", spy)
    # the sampled requests end early: the later steps are greedy only
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=6, ignore_eos=True),
              GREEDY, SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)]
    prompts = PROMPTS[:4]
    llm, _ = _oracle_llm(path, outs, spec=STATIC, max_num_seqs=4)
    llm.llm_engine.scheduler.spec.proposer = RepeatProposer()    # proposals for the sampled requests too
    on = _run(llm, prompts, params, fast=True)
    assert llm.llm_engine.runner.num_greedy_verify_steps > 0
    calls_on = list(calls)
    calls.clear()
    off = _run(llm, prompts, params, fast=False)
    assert on == off
    assert on[0] == _ids(outs)[0] and on[2] == _ids(outs)[2]
    assert llm.llm_engine.runner.num_greedy_verify_steps == 0
    assert any(calls_on) and all(calls_on)      # only steps with a sampled proposing request, all of them
    assert len(calls) > len(calls_on)           # off: the greedy-only steps too


def _count_verify_ops(llm: LLM, fast: bool, monkeypatch) -> list[int]:
    counts = []
    original = spec_verify.verify   # the unwrapped function

    def counted(*args, **kwargs):
        with AtenOpCounter() as mode:
            result = original(*args, **kwargs)
        counts.append(len(mode.ops))
        return result

    monkeypatch.setattr(model_runner, "verify", counted)
    _run(llm, PROMPTS, GREEDY, fast=fast)
    return counts


def test_greedy_path_launches_few_ops(reference, monkeypatch, capsys):
    path, outs = reference["llama"]
    llm, _ = _oracle_llm(path, outs, spec=STATIC, max_num_seqs=16)
    fast = _count_verify_ops(llm, True, monkeypatch)
    general = _count_verify_ops(llm, False, monkeypatch)
    assert fast and general
    with capsys.disabled():
        print(f"\naten ops per verify call: greedy path max {max(fast)}, general path min {min(general)} "
              f"max {max(general)}")
    assert max(fast) <= GREEDY_MAX_OPS
    assert max(fast) * 2 < min(general)
