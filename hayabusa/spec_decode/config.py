"""SpeculativeConfig: vLLM's ``speculative_config`` dict (or JSON string), checked once at the edge.

Keys (vLLM's names and defaults):
  method: "ngram" (prompt lookup) or "draft_model" (with "model": a smaller checkpoint of the same vocabulary;
      its greedy proposals). "eagle" / "eagle3" and the other vLLM methods are known but not supported yet (a HayabusaValidationError says so); any other value is an error naming it. With only
      ``"model": DIR`` vLLM infers "draft_model".
  num_speculative_tokens: proposals per request per step, k >= 1 (required).
  prompt_lookup_max / prompt_lookup_min: longest / shortest suffix n-gram the n-gram proposer matches; both unset:
      5 and 5 (vLLM's defaults); one unset: equal to the other.
  disable_by_batch_size: no proposals in a step when more requests than this are running (vLLM's "larger than"
      rule, applied per step): a step that is
      already compute-bound gains nothing from verifying extra tokens. vLLM's default is "never"; hayabusa's
      is DEFAULT_DISABLE_BY_BATCH_SIZE (its rule turns speculation off by itself); 0 = never turn it off.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hayabusa.errors import HayabusaValidationError

# vLLM's methods (vllm/config/speculative.py): known names that are not supported here yet.
KNOWN_UNSUPPORTED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "mtp", "suffix",
                             "deepseek_mtp")
SUPPORTED_METHODS = ("ngram", "draft_model")
# Running requests from which a step gets no proposals (the turn-off rule; see the module docstring).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32
_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
         "disable_by_batch_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """A checked speculative_config.

    Attributes:
        method: "ngram".
        num_speculative_tokens: k, proposals per request per step.
        prompt_lookup_max: longest suffix n-gram matched.
        prompt_lookup_min: shortest suffix n-gram matched.
        disable_by_batch_size: no proposals in a step with more running requests than this (0 = never).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    model: str | None = None            # draft_model: the draft checkpoint (same vocabulary as the target)

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
            raise HayabusaValidationError(f"speculative_config is not valid JSON ({e}).",
                                          parameter="speculative_config", value=value) from None
    if not isinstance(value, dict):
        raise HayabusaValidationError("speculative_config must be a dict (or a JSON object string).",
                                      parameter="speculative_config", value=value)
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise _bad(unknown[0], value[unknown[0]], f"unknown key; known: {', '.join(_KEYS)}.")
    method = value.get("method")
    if method is None:
        method = "draft_model" if value.get("model") else None
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
    model = value.get("model")
    if method == "draft_model" and (not isinstance(model, str) or not model):
        raise _bad("model", model, "method 'draft_model' needs the draft checkpoint's folder or Hub id.")
    lo, hi = _positive_int(value, "prompt_lookup_min"), _positive_int(value, "prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5
    lo, hi = lo or hi, hi or lo
    if lo > hi:
        raise _bad("prompt_lookup_min", lo, f"must be <= prompt_lookup_max ({hi}).")
    off = _positive_int(value, "disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE, allow_zero=True)
    return SpeculativeConfig(method, k, prompt_lookup_max=hi, prompt_lookup_min=lo,
                             disable_by_batch_size=DEFAULT_DISABLE_BY_BATCH_SIZE if off is None else off,
                             model=model if method == "draft_model" else None)
