"""The measured turn-off rule of speculative decoding (``disable_by_payoff``): per batch-size bucket, speculation
stays on only while its measured output rate is not below plain decoding's by more than a margin.

Plain numbers only (no clock, no requests): the engine times each step and the scheduler hands this rule, per
decode-only step, its bucket, whether the step was scheduled in speculative mode, the tokens it emitted per request
and its wall seconds (``record``). The scheduler asks ``speculate(num_running)`` before it schedules a step.

Per bucket (the running requests rounded up to a power of two: 1, 2, 4, 8, 16, ...) the rule keeps two windows of
the last ``window`` samples, one of speculative-mode steps and one of plain ones; a window's rate is its tokens
per request summed over its seconds summed (a ratio of sums: a throughput, not a mean of per-step rates). A bucket:

- starts speculating (it has to measure); once its speculative window is full it runs a plain probe of ``window``
  steps, then decides;
- decides whenever both windows are full and no probe runs: speculate unless speculation's rate is below plain's
  by more than ``margin`` (a fraction);
- after every ``probe_every`` steps of its chosen mode runs ``window`` steps of the other mode (a probe), so a
  change of acceptance, context length or load is noticed (the chosen mode's own window is always fresh);
- drops the first sample after each change of mode: with async scheduling the first plain step after a verify
  step does not overlap its predecessor, and would make plain decoding look slower than it is.

A step in speculative mode that finds no proposal (n-gram misses, low-acceptance back-offs) still counts as
speculative: that is what speculation costs; the comparison is of the two modes, not of steps with and without
proposals. A step none of whose requests speculation would ever propose for (``scheduling.eligible``: logprobs,
penalties, logit edits, ...) is not measured at all: it is a plain step in either mode, no evidence either way.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


def bucket_of(num_running: int) -> int:
    """The batch-size bucket of a step with ``num_running`` running requests: the power of two >= it (1 for 0)."""
    return 1 << max(num_running - 1, 0).bit_length()


@dataclass
class _Window:
    """The last ``maxlen`` samples of one mode: (tokens per request, seconds) each."""

    maxlen: int
    samples: deque = field(default_factory=deque)

    def add(self, tokens: float, seconds: float) -> None:
        self.samples.append((tokens, seconds))
        if len(self.samples) > self.maxlen:
            self.samples.popleft()

    @property
    def full(self) -> bool:
        return len(self.samples) >= self.maxlen

    def rate(self) -> float | None:
        """Tokens per request per second over the window (a ratio of sums); None when empty or timeless."""
        seconds = sum(s for _, s in self.samples)
        return sum(t for t, _ in self.samples) / seconds if seconds > 0 else None


@dataclass
class BucketState:
    """One bucket's estimates and mode (see the module docstring)."""

    spec: _Window
    plain: _Window
    speculating: bool = True        # the chosen mode
    probe_left: int = 0             # samples still to take in the other mode (a probe)
    since_probe: int = 0            # samples of the chosen mode since the last probe
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
        window: samples per estimate, and the length of a probe (>= 1).
        probe_every: steps of a bucket's chosen mode between probes of the other (>= 1).
    """

    def __init__(self, margin: float, window: int, probe_every: int) -> None:
        self.margin = margin
        self.window = window
        self.probe_every = probe_every
        self.buckets: dict[int, BucketState] = {}

    def state(self, num_running: int) -> BucketState:
        b = bucket_of(num_running)
        st = self.buckets.get(b)
        if st is None:
            st = self.buckets[b] = BucketState(_Window(self.window), _Window(self.window))
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
            return
        if speculative != st.speculating:
            return   # a step scheduled before the last probe ended (async scheduling): a sample, nothing more
        st.since_probe += 1
        mine, other = (st.spec, st.plain) if st.speculating else (st.plain, st.spec)
        if (mine.full and not other.full) or st.since_probe >= self.probe_every:
            st.probe_left, st.since_probe = self.window, 0
            return
        self._decide(st)

    def _decide(self, st: BucketState) -> None:
        if not (st.spec.full and st.plain.full):
            return
        spec, plain = st.spec.rate(), st.plain.rate()
        if spec is None or plain is None:
            return
        speculating = spec >= plain * (1.0 - self.margin)
        if speculating != st.speculating:
            st.speculating, st.since_probe = speculating, 0

    def snapshot(self) -> dict[int, dict]:
        """Per bucket: ``speculating`` (the chosen mode), ``plain_steps`` / ``spec_steps`` (steps scheduled in
        each mode), ``spec_rate`` / ``plain_rate`` (tokens per request per second over the windows, or None)."""
        return {b: {"speculating": st.speculating, "plain_steps": st.num_plain_steps, "spec_steps": st.num_spec_steps,
                    "spec_rate": st.spec.rate(), "plain_rate": st.plain.rate()}
                for b, st in sorted(self.buckets.items())}
