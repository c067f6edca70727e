"""The measured turn-off rule of speculative decoding (``disable_by_payoff``): per batch-size bucket, speculation
stays on only while its measured output rate is not below plain decoding's by more than a margin.

Plain numbers only (no clock, no requests): the engine times each step and the scheduler hands this rule, per
decode-only step, its bucket, whether the step was scheduled in speculative mode, the tokens it emitted per request
and its wall seconds (``record``). The scheduler asks ``speculate(num_running)`` before it schedules a step.

Per bucket (the running requests rounded up to a power of two: 1, 2, 4, 8, 16, ...) the rule keeps, per mode, the
last ``history`` samples (speculative-mode steps; plain ones); a mode's rate is its tokens per request summed over
its seconds summed (a ratio of sums: a throughput, not a mean of per-step rates). A bucket:

- starts speculating (it has to measure): after ``window`` speculative samples it runs a plain probe of ``window``
  steps, then decides;
- decides only at the end of a probe: speculate unless speculation's rate is below plain's by more than
  ``margin`` (a fraction). The chosen mode's rate is over its last ``history`` samples (its recent steps); the
  other mode's over its last ``PROBES_KEPT`` probes' samples, so one probe at an unlucky moment does not decide
  alone;
- probes the other mode for ``window`` steps after a gap of its chosen mode's steps drawn uniformly from
  [``probe_every`` / 2, 3 ``probe_every`` / 2] (a generator seeded per rule: the same sequence every run), so
  probes do not fall at the same point of every request when the requests are as long as the gap;
- drops the first sample after each change of mode: with async scheduling the first plain step after a verify
  step does not overlap its predecessor, and would make plain decoding look slower than it is.

Why decide only at probe ends (measured on an H200, SmolLM2-135M, W11 at batch 1, 2026-12-03): the first version
decided after every sample. Copy-heavy requests accept little until the copying starts, so a few speculative
steps at a request's start turned speculation off, and it came back only at a probe, every 512 steps, which at
128 tokens a request fell on a request's start again: off for 93 % of the steps (0.88x of speculation left on).

A step in speculative mode that finds no proposal (n-gram misses, low-acceptance back-offs) still counts as
speculative: that is what speculation costs; the comparison is of the two modes, not of steps with and without
proposals. A step none of whose requests speculation would ever propose for (``scheduling.eligible``: logprobs,
penalties, logit edits, ...) is not measured at all: it is a plain step in either mode, no evidence either way.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field


def bucket_of(num_running: int) -> int:
    """The batch-size bucket of a step with ``num_running`` running requests: the power of two >= it (1 for 0)."""
    return 1 << max(num_running - 1, 0).bit_length()


PROBES_KEPT = 4   # probes whose samples estimate the mode not chosen (a choice: long enough to average a request's
                  # phases at random probe times, short enough to notice a change within a few probes)


@dataclass
class _Window:
    """The last ``maxlen`` samples of one mode: (tokens per request, seconds) each."""

    maxlen: int
    samples: deque = field(default_factory=deque)

    def add(self, tokens: float, seconds: float) -> None:
        self.samples.append((tokens, seconds))
        if len(self.samples) > self.maxlen:
            self.samples.popleft()

    def rate(self, last: int | None = None) -> float | None:
        """Tokens per request per second over the window's ``last`` samples (all when None; a ratio of sums);
        None when empty or timeless."""
        samples = list(self.samples)[-last:] if last else self.samples
        seconds = sum(s for _, s in samples)
        return sum(t for t, _ in samples) / seconds if seconds > 0 else None


@dataclass
class BucketState:
    """One bucket's estimates and mode (see the module docstring)."""

    spec: _Window
    plain: _Window
    speculating: bool = True        # the chosen mode
    probe_left: int = 0             # samples still to take in the other mode (a probe)
    until_probe: int = 0            # samples of the chosen mode before the next probe starts
    last_mode: bool | None = None   # the mode of the last step recorded (the first after a change is dropped)
    num_plain_steps: int = 0        # steps scheduled without proposals for unseeded requests (the rule's doing)
    num_spec_steps: int = 0         # steps scheduled in speculative mode

    def mode(self) -> bool:
        """Whether the next step speculates: the chosen mode, or the other one during a probe."""
        return self.speculating != bool(self.probe_left)


class PayoffRule:
    """The measured turn-off rule over all buckets.

    Args:
        margin: speculation is turned off in a bucket when its rate < plain's x (1 - margin); in [0, 1).
        window: samples per probe, and the speculative samples of a bucket's start-up (>= 1).
        probe_every: the mean gap, in samples of a bucket's chosen mode, between probes of the other (>= 1).
        history: samples kept per mode and bucket; the chosen mode's rate is over them (default
            max(PROBES_KEPT x window, probe_every)).
        seed: the probe gaps' generator.
    """

    def __init__(self, margin: float, window: int, probe_every: int, history: int | None = None,
                 seed: int = 0) -> None:
        self.margin = margin
        self.window = window
        self.probe_every = probe_every
        self.history = history if history is not None else max(PROBES_KEPT * window, probe_every)
        self._rng = random.Random(seed)
        self.buckets: dict[int, BucketState] = {}

    def next_gap(self) -> int:
        """The next gap between probes, in samples of the chosen mode (advances the seeded generator)."""
        lo = max(self.probe_every // 2, 1)
        return self._rng.randint(lo, max(lo, self.probe_every * 3 // 2))

    def state(self, num_running: int) -> BucketState:
        b = bucket_of(num_running)
        st = self.buckets.get(b)
        if st is None:   # start-up: `window` speculative samples, then a plain probe
            st = self.buckets[b] = BucketState(_Window(self.history), _Window(self.history), until_probe=self.window)
        return st

    def speculate(self, num_running: int) -> bool:
        """Whether a step with ``num_running`` running requests may carry proposals for unseeded requests
        (no side effect: the scheduler may ask more than once per step)."""
        st = self.buckets.get(bucket_of(num_running))
        return True if st is None else st.mode()

    def scheduled(self, num_running: int, speculative: bool) -> None:
        """Count a step scheduled under the rule (the metrics' steps per mode)."""
        st = self.state(num_running)
        if speculative:
            st.num_spec_steps += 1
        else:
            st.num_plain_steps += 1

    def record(self, num_running: int, speculative: bool, tokens_per_request: float, seconds: float) -> None:
        """One decode-only step's measurement.

        Args:
            num_running: running requests when the step was scheduled (its bucket).
            speculative: whether it was scheduled in speculative mode.
            tokens_per_request: tokens it emitted / requests it ran (>= 0).
            seconds: its wall time (host clock, its schedule to its collected output; >= 0).
        """
        st = self.state(num_running)
        if speculative != st.last_mode:   # the first step after a change of mode: not a steady one
            st.last_mode = speculative
            return
        (st.spec if speculative else st.plain).add(tokens_per_request, seconds)
        if st.probe_left:
            if speculative != st.speculating:
                st.probe_left -= 1
                if not st.probe_left:
                    self._decide(st)
                    st.until_probe = self.next_gap()
            return
        if speculative != st.speculating:
            return   # a step scheduled before the last probe ended (async scheduling): a sample, nothing more
        st.until_probe -= 1
        if st.until_probe <= 0:
            st.probe_left = self.window

    def _decide(self, st: BucketState) -> None:
        """At a probe's end: the chosen mode over its history, the probed one over its last PROBES_KEPT probes."""
        probed = PROBES_KEPT * self.window
        spec = st.spec.rate(None if st.speculating else probed)
        plain = st.plain.rate(probed if st.speculating else None)
        if spec is None or plain is None:
            return
        st.speculating = spec >= plain * (1.0 - self.margin)

    def snapshot(self) -> dict[int, dict]:
        """Per bucket: ``speculating`` (the chosen mode), ``plain_steps`` / ``spec_steps`` (steps scheduled in
        each mode), ``spec_rate`` / ``plain_rate`` (tokens per request per second over the windows, or None)."""
        return {b: {"speculating": st.speculating, "plain_steps": st.num_plain_steps, "spec_steps": st.num_spec_steps,
                    "spec_rate": st.spec.rate(), "plain_rate": st.plain.rate()}
                for b, st in sorted(self.buckets.items())}
