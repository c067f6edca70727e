"""Replay a device run's recorded decode-step samples through the payoff rule (issue #21), on any machine.

    python benchmarks/payoff_replay.py benchmarks/results/2026-12-03_h200_9f62562.payoff_trace.json
    python benchmarks/payoff_replay.py TRACE.json --max-num-seqs 1 --window 8 --probe-every 256 --margin 0.03

``benchmarks/payoff_trace.py`` records, per run, every decode-only step the rule measured: its bucket, mode
(speculative or plain), tokens per request and milliseconds. This replays one run's bucket open loop: a position
counter (tokens per request so far) stands in for the requests' progress, and each step takes, from the mode the
rule picks, the recorded sample at that position (so the requests' phases, e.g. low acceptance before a copy
starts, line up in both modes). Printed per policy (always speculate, never, the rule as configured): simulated
ms, steps, and the fraction of steps that speculated.

It is a check of rule changes against real timings before spending device time, not a benchmark: the closed loop
(a mode changes the batch's later composition) is not modelled. Session 17 used it to reject early probes
(gaps of ~2, 4, 8, 16 windows): 8 % slower than the rule at batch 1 and 2-8 % at batch 4 on two recorded runs.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from itertools import accumulate
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hayabusa.spec_decode.payoff import PayoffRule  # noqa: E402


def load_samples(path: str | Path, max_num_seqs: int) -> list[dict]:
    """The samples of the speculative run at ``max_num_seqs`` in a payoff_trace.py JSON file ([{"bucket", "spec",
    "tokens", "ms", ...}]). Raises ValueError naming ``max_num_seqs`` when the file has no such run."""
    runs = [r for r in json.loads(Path(path).read_text()) if r.get("speculative")]
    for r in runs:
        if r.get("max_num_seqs") == max_num_seqs:
            return r["samples"]
    raise ValueError(f"max_num_seqs: no speculative run with {max_num_seqs} in {path} "
                     f"(it has {sorted(r.get('max_num_seqs') for r in runs)})")


def replay(samples: list[dict], bucket: int, policy: bool | PayoffRule) -> dict:
    """Run ``bucket``'s samples through ``policy`` (True: always speculate, False: never, or a PayoffRule) until
    the speculative samples' tokens are produced. Returns {"ms", "steps", "spec_fraction"}. Raises ValueError when
    the bucket has no samples of a mode."""
    by = {m: [s for s in samples if s["bucket"] == bucket and s["spec"] is m] for m in (True, False)}
    if not by[True] or not by[False]:
        raise ValueError(f"bucket {bucket}: {len(by[True])} speculative / {len(by[False])} plain samples; both are "
                         "needed")
    cum = {m: list(accumulate(s["tokens"] for s in by[m])) for m in by}
    total, pos, ms, steps, spec_steps = cum[True][-1], 0.0, 0.0, 0, 0
    while pos < total:
        mode = policy.speculate(bucket) if isinstance(policy, PayoffRule) else policy
        s = by[mode][min(bisect.bisect_left(cum[mode], pos), len(by[mode]) - 1)]
        if isinstance(policy, PayoffRule):
            policy.scheduled(bucket, mode)
            policy.record(bucket, mode, s["tokens"], s["ms"] / 1e3)
        pos, ms, steps, spec_steps = pos + s["tokens"], ms + s["ms"], steps + 1, spec_steps + mode
    return {"ms": round(ms, 1), "steps": steps, "spec_fraction": round(spec_steps / steps, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="a payoff_trace.py --json file")
    p.add_argument("--max-num-seqs", type=int, nargs="+", default=None, help="runs to replay (default: all)")
    p.add_argument("--margin", type=float, default=0.03)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--probe-every", type=int, default=256)
    ns = p.parse_args()
    runs = [r["max_num_seqs"] for r in json.loads(Path(ns.trace).read_text()) if r.get("speculative")]
    print(f"{'max_num_seqs':>12} {'policy':>13} {'ms':>9} {'steps':>6} {'speculating':>11}")
    for n in ns.max_num_seqs or runs:
        samples = load_samples(ns.trace, n)
        bucket = max(s["bucket"] for s in samples)      # the full batch's bucket
        rule = PayoffRule(margin=ns.margin, window=ns.window, probe_every=ns.probe_every)
        for name, policy in (("always spec", True), ("never", False), ("rule", rule)):
            r = replay(samples, bucket, policy)
            print(f"{n:>12} {name:>13} {r['ms']:>9.1f} {r['steps']:>6} {r['spec_fraction']:>11.3f}")


if __name__ == "__main__":
    main()
