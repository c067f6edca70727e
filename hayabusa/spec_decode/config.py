"""SpeculativeConfig: vLLM's ``speculative_config`` dict (or JSON string), checked once at the edge.

Keys (vLLM's names and defaults):
  method: "ngram" (prompt lookup), "draft_model" (with "model": a smaller checkpoint of the same vocabulary;
      its greedy proposals), "eagle" / "eagle3" (with "model": a public EAGLE / EAGLE-3 head checkpoint for a
      Llama / Qwen2 target; hayabusa/model/eagle.py). The other vLLM methods are known but not supported yet (a
      HayabusaValidationError says so); any other value is an error naming it. With only ``"model": DIR`` vLLM
      infers "draft_model" (``"model": "[ngram]"`` or ``"ngram"``: n-gram, as in vLLM; a checkpoint with method
      "ngram" would go unused and is refused by name).
  num_speculative_tokens: proposals per request per step, k >= 1 (required); less than max_model_len (checked
    by EngineArgs, which knows it).
  prompt_lookup_max / prompt_lookup_min: longest / shortest suffix n-gram the n-gram proposer matches; both unset:
      5 and 5 (vLLM's defaults); one unset: equal to the other.
  disable_by_batch_size: no proposals in a step when more requests than this are running (vLLM's "larger than"
      rule, applied per step): a step that is
      already compute-bound gains nothing from verifying extra tokens. vLLM's default is "never"; hayabusa's
      is DEFAULT_DISABLE_BY_BATCH_SIZE (its rule turns speculation off by itself); 0 = never turn it off.

hayabusa's own keys (vLLM has no low-acceptance rule), the per-request low-acceptance turn-off rule:
  min_acceptance_rate (float in [0, 1], default DEFAULT_MIN_ACCEPTANCE_RATE; 0 = rule off),
  acceptance_window (proposed tokens per window, default DEFAULT_ACCEPTANCE_WINDOW),
  acceptance_backoff (output tokens, default DEFAULT_ACCEPTANCE_BACKOFF):
      each request counts its verified proposals and accepted ones; when a window of at least acceptance_window
      proposals has an acceptance rate below min_acceptance_rate, the request gets no proposals for its next
      acceptance_backoff output tokens (plain one-token decode steps), then a new window starts. With async
      scheduling a step in which some running request may propose waits for the previous step's tokens (even
      when its n-gram lookup then finds nothing); steps in which none may propose overlap as without
      speculation.
      Why: a verify step of 1 + k tokens costs about one decode step when memory-bound, plus the proposer's
      work; at acceptance rate a it emits (1 - a^(k+1)) / (1 - a) tokens, about 1 + a for small a, so
      below roughly 0.1-0.2 the proposals (a draft model's k forwards above all) cost more than they save.
      The default 0.1 is that estimate; the crossover has not been measured on the device yet.

hayabusa's own keys, the measured turn-off rule (hayabusa/spec_decode/payoff.py; vLLM has none):
  disable_by_payoff (bool, default DEFAULT_DISABLE_BY_PAYOFF = True): the engine times every step (host clock,
      from the step's schedule to its collected output; with async scheduling from the previous step's collection
      when later) and, per batch-size bucket (the running requests rounded up to a power of two), keeps the output
      rate (tokens per request per second) of decode-only steps scheduled with speculation and of those without
      (steps with a prompt chunk are not measured). A bucket starts speculating (it has to measure): its first
      1 + payoff_window steps speculate, the next 1 + payoff_window are a plain probe (the first step after each
      change of mode is not counted: with async scheduling it does not overlap its predecessor), then it decides.
      After that it probes the other mode for 1 + payoff_window steps after gaps of about
      ``payoff_probe_every`` steps of its chosen mode (drawn in [1/2, 3/2] of it from a seeded generator) and
      decides at each probe's end, the chosen mode's rate over its last max(4 x payoff_window,
      payoff_probe_every) steps against the other's over its last 4 probes: speculation is off in the bucket
      while its rate is below plain's by more than ``payoff_margin``. Decisions only at probe ends and rates
      over several probes: see hayabusa/spec_decode/payoff.py for the W11 measurement that made them so.
      Why: the loss of speculation at a batch size is host work of synchronous verify steps and the verify
      step's extra tokens, which depend on the model, the GPU and the acceptance; measured on an H200
      (SmolLM2-135M, W11, n-gram k=4, acceptance 0.60) speculation gave 1.33x output tok/s at batch 1 but 0.87x
      at 4 and 0.64x at 16, below disable_by_batch_size's default, while a 7b model probably gains at 16: no
      fixed threshold fits every model and GPU, a measurement does.
      Determinism: greedy output never depends on it (verification is exact). Requests that sample
      (temperature > 0) with a per-request ``seed`` ignore it (only the static rules decide their proposals), so
      timing never changes their tokens; unseeded sampling and greedy requests follow it.
  payoff_margin (float in [0, 1), default DEFAULT_PAYOFF_MARGIN = 0.03): the issue asks that speculation "never
      costs more than a few percent where it cannot help"; losses measured were 13 % and 36 %, gains 33 %, so a
      3 % margin keeps speculation where it roughly breaks even (its latency gain per request is worth a little
      throughput) and is above the step-time noise of a window (an estimate; not yet measured on the device).
  payoff_window (int >= 1, default DEFAULT_PAYOFF_WINDOW = 8): samples per probe and per start-up; at
      0.64x a bucket's start-up spends about 8 x 0.56 = 4.5 steps' time on speculation before turning it off,
      about 1 % of W11's ~500 steps at batch 16 (64 x 128 tokens, 16 a step); fewer samples would let one slow
      step (a GC pause, a prompt chunk next door) decide.
  payoff_probe_every (int >= 1, default DEFAULT_PAYOFF_PROBE_EVERY = 256): a probe of the losing mode costs
      about payoff_window x its loss (4.5 steps' time at 0.64x), under 2 % of 256 steps; a change is noticed
      within a few probes (2-4 s at 2-3 ms a step); 512 (the first version's) gave the other mode's estimate
      only ~16 probes on W11 at batch 1 (8,192 steps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hayabusa.errors import HayabusaValidationError

# vLLM's methods (vllm/config/speculative.py): known names that are not supported here yet.
KNOWN_UNSUPPORTED_METHODS = ("medusa", "mlp_speculator", "mtp", "suffix", "deepseek_mtp")
SUPPORTED_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# methods whose proposals come from a model in the runner (the scheduler sends k -1 slots)
MODEL_METHODS = ("draft_model", "eagle", "eagle3")
# "model" values that mean the n-gram proposer (vLLM: {"model": "[ngram]"} without a method is n-gram)
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
# Running requests from which a step gets no proposals (the turn-off rule; see the module docstring).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
DEFAULT_MIN_ACCEPTANCE_RATE = 0.1
DEFAULT_ACCEPTANCE_WINDOW = 32
DEFAULT_ACCEPTANCE_BACKOFF = 64
# the measured turn-off rule (module docstring: why these values)
DEFAULT_DISABLE_BY_PAYOFF = True
DEFAULT_PAYOFF_MARGIN = 0.03
DEFAULT_PAYOFF_WINDOW = 8
DEFAULT_PAYOFF_PROBE_EVERY = 256
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size", "min_acceptance_rate", "acceptance_window", "acceptance_backoff",
         "disable_by_payoff", "payoff_margin", "payoff_window", "payoff_probe_every")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative_config.

    Attributes:
        method: "ngram", "draft_model", "eagle" or "eagle3".
        num_speculative_tokens: k, proposals per request per step.
        prompt_lookup_max: longest suffix n-gram matched.
        prompt_lookup_min: shortest suffix n-gram matched.
        disable_by_batch_size: no proposals in a step with more running requests than this (0 = never).
        min_acceptance_rate / acceptance_window / acceptance_backoff: the per-request low-acceptance rule (rate
            in [0, 1], 0 = off; window in proposed tokens; back-off in output tokens).
        disable_by_payoff / payoff_margin / payoff_window / payoff_probe_every: the measured turn-off rule (on or
            off; margin a fraction in [0, 1); window in decode-only steps per estimate and per probe; probe period
            in steps of a bucket's chosen mode).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None            # draft_model / eagle / eagle3: the draft or head checkpoint
    min_acceptance_rate: float = DEFAULT_MIN_ACCEPTANCE_RATE    # the low-acceptance rule (module docstring)
    acceptance_window: int = DEFAULT_ACCEPTANCE_WINDOW
    acceptance_backoff: int = DEFAULT_ACCEPTANCE_BACKOFF
    disable_by_payoff: bool = DEFAULT_DISABLE_BY_PAYOFF          # the measured rule (module docstring)
    payoff_margin: float = DEFAULT_PAYOFF_MARGIN
    payoff_window: int = DEFAULT_PAYOFF_WINDOW
    payoff_probe_every: int = DEFAULT_PAYOFF_PROBE_EVERY

    def enabled_for_batch(self, num_running: int) -> bool:
        """The turn-off rule: proposals only while at most ``disable_by_batch_size`` requests run."""
        return not self.disable_by_batch_size or num_running <= self.disable_by_batch_size


def _bad(name: str, value: Any, why: str) -> HayabusaValidationError:
    return HayabusaValidationError(f"speculative_config {name}={value!r}: {why}", parameter=f"speculative_config.{name}",
                                   value=value)


def _positive_int(cfg: dict, name: str, default: Any = None, allow_zero: bool = False) -> Any:
    value = cfg.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < (0 if allow_zero else 1):
        raise _bad(name, value, "must be a " + ("non-negative" if allow_zero else "positive") + " integer.")
    return value


def parse_speculative_config(value: Any) -> SpeculativeConfig | None:
    """``speculative_config`` as given (None / {} = off, a dict, or a JSON string) -> SpeculativeConfig or None.

    Raises:
        HayabusaValidationError: an unknown key or method, a method not supported yet, or a bad number (named).
    """
    if value is None or value == {} or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise HayabusaValidationError(
                f"speculative_config must be a dict, or a JSON object string such as '{{\"method\": \"ngram\", "
                f"\"num_speculative_tokens\": 4}}'; got {value!r}, which is not JSON ({e}).",
                parameter="speculative_config", value=value) from None
        if value is None or value == {}:   # "null" / "{}" on the command line: off, as None in Python
            return None
    if not isinstance(value, dict):
        raise HayabusaValidationError("speculative_config must be a dict (or a JSON object string).",
                                      parameter="speculative_config", value=value)
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise _bad(unknown[0], value[unknown[0]], f"unknown key; known: {', '.join(_KEYS)}.")
    method = value.get("method")
    model = value.get("model")
    if method is None and model in _NGRAM_MODEL_NAMES:   # vLLM's older spelling of the n-gram proposer
        method = "ngram"
    if method == "[ngram]":
        method = "ngram"
    if method is None:
        method = "draft_model" if model else None
    if method is None:
        raise _bad("method", None, f"give a method ({', '.join(SUPPORTED_METHODS)}).")
    if method in KNOWN_UNSUPPORTED_METHODS:
        raise _bad("method", method, f"speculative decoding with {method!r} is not supported yet in hayabusa; "
                                     f"supported: {', '.join(SUPPORTED_METHODS)}.")
    if method not in SUPPORTED_METHODS:
        raise _bad("method", method, f"unknown method; supported: {', '.join(SUPPORTED_METHODS)}.")
    k = _positive_int(value, "num_speculative_tokens")
    if k is None:
        raise _bad("num_speculative_tokens", None, f"required for method {method!r}.")
    if method == "ngram" and model is not None and model not in _NGRAM_MODEL_NAMES:
        raise _bad("model", model, "method 'ngram' uses no model (it looks up the request's own tokens); drop "
                                   "\"model\", or give method \"draft_model\" to propose with this checkpoint.")
    if method in MODEL_METHODS and (not isinstance(model, str) or not model):
        raise _bad("model", model, f"method {method!r} needs the "
                                   f"{'draft checkpoint' if method == 'draft_model' else 'head checkpoint'}'s folder "
                                   "or Hub id.")
    lo, hi = _positive_int(value, "prompt_lookup_min"), _positive_int(value, "prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo, hi = lo or hi, hi or lo
    if lo > hi:
        raise _bad("prompt_lookup_min", lo, f"must be <= prompt_lookup_max ({hi}).")
    off = _positive_int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, allow_zero=True)
    rate = value.get("min_acceptance_rate", DEFAULT_MIN_ACCEPTANCE_RATE)
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise _bad("min_acceptance_rate", rate, "must be a number in [0, 1] (0 turns the rule off).")
    window = _positive_int(value, "acceptance_window", DEFAULT_ACCEPTANCE_WINDOW)
    backoff = _positive_int(value, "acceptance_backoff", DEFAULT_ACCEPTANCE_BACKOFF)
    by_payoff = value.get("disable_by_payoff", DEFAULT_DISABLE_BY_PAYOFF)
    if not isinstance(by_payoff, bool):
        raise _bad("disable_by_payoff", by_payoff, "must be true or false.")
    margin = value.get("payoff_margin", DEFAULT_PAYOFF_MARGIN)
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0.0 <= margin < 1.0:
        raise _bad("payoff_margin", margin, "must be a number in [0, 1) (a fraction of plain decoding's rate).")
    payoff_window = _positive_int(value, "payoff_window", DEFAULT_PAYOFF_WINDOW)
    probe_every = _positive_int(value, "payoff_probe_every", DEFAULT_PAYOFF_PROBE_EVERY)
    for name, got in (("payoff_window", payoff_window), ("payoff_probe_every", probe_every)):
        if got is None:
            raise _bad(name, None, "must be a positive integer.")
    return SpeculativeConfig(method, k, prompt_lookup_max=hi, prompt_lookup_min=lo,
                             min_acceptance_rate=float(rate), acceptance_window=window, acceptance_backoff=backoff,
                             disable_by_payoff=by_payoff, payoff_margin=float(margin), payoff_window=payoff_window,
                             payoff_probe_every=probe_every,
                             disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE if off is None else off,
                             model=model if method in MODEL_METHODS else None)
