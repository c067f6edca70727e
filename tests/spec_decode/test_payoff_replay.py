"""The payoff rule against the H200's recorded W11 decode steps (benchmarks/payoff_replay.py): on the timings of
two device runs (SmolLM2-135M fp16, n-gram k = 4, 2026-12-03), the rule as configured by default must stay within
a few percent of the better fixed policy. A rule change that flaps (session 17's early probes: 8 % slower at
batch 1, 8 % at batch 4) fails here before it costs device time."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from hayabusa.spec_decode.config import DEFAULT_PAYOFF_MARGIN, DEFAULT_PAYOFF_PROBE_EVERY, DEFAULT_PAYOFF_WINDOW
from hayabusa.spec_decode.payoff import PayoffRule

ROOT = Path(__file__).resolve().parents[2]
_m = runpy.run_path(str(ROOT / "benchmarks" / "payoff_replay.py"), run_name="payoff_replay")
RESULTS = ROOT / "benchmarks" / "results"


@pytest.mark.payoff_default
@pytest.mark.parametrize("trace, max_num_seqs", [("2026-12-03_h200_9f62562.payoff_trace.json", 1),
                                                 ("2026-12-03_h200_9f62562.payoff_trace.json", 4),
                                                 ("2026-12-03_h200_a01ae0d.payoff_trace.json", 4),
                                                 ("2026-12-03_h200_a01ae0d.payoff_trace.json", 16)])
def test_the_default_rule_is_near_the_better_policy_on_recorded_device_steps(trace, max_num_seqs):
    samples = _m["load_samples"](RESULTS / trace, max_num_seqs)
    bucket = max(s["bucket"] for s in samples)
    spec, plain = (_m["replay"](samples, bucket, p) for p in (True, False))
    rule = _m["replay"](samples, bucket, PayoffRule(margin=DEFAULT_PAYOFF_MARGIN, window=DEFAULT_PAYOFF_WINDOW,
                                                     probe_every=DEFAULT_PAYOFF_PROBE_EVERY))
    best = min(spec["ms"], plain["ms"])
    assert spec["ms"] < plain["ms"]                        # on these steps speculation pays per token
    assert rule["ms"] <= 1.03 * best and rule["spec_fraction"] > 0.8, (rule, spec, plain)


def test_a_run_the_file_lacks_is_named():
    with pytest.raises(ValueError, match="max_num_seqs: no speculative run with 2"):
        _m["load_samples"](RESULTS / "2026-12-03_h200_a01ae0d.payoff_trace.json", 2)
