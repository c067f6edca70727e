"""vLLM arguments that scripts pass and hayabusa does not act on, in one place.

``UNSUPPORTED_ENGINE_ARGS``: engine arguments of vLLM features hayabusa does not have yet. An "off" value (None,
False, 0, an empty dict or list) is accepted silently, so configs that spell out the default run unchanged; any
other value is a HayabusaValidationError saying the feature is not supported yet (not "unknown").
``LLM_IGNORED_KWARGS``: ``LLM(...)`` keyword arguments that mean nothing offline; one warning names them.
``check_priority``: vLLM's per-request ``priority`` (0 accepted; priority scheduling is not supported).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from hayabusa.errors import HayabusaValidationError

logger = logging.getLogger(__name__)

UNSUPPORTED_ENGINE_ARGS: dict[str, str] = {
    "enable_lora": "LoRA adapters",
    "max_loras": "LoRA adapters",
    "max_lora_rank": "LoRA adapters",
    "max_cpu_loras": "LoRA adapters",
    "lora_extra_vocab_size": "LoRA adapters",
    "speculative_model": "speculative decoding",
    "num_speculative_tokens": "speculative decoding",
    "mm_processor_kwargs": "multimodal inputs",
    "enable_expert_parallel": "expert parallelism",
    "data_parallel_size": "data parallelism",
    "kv_transfer_config": "KV-cache transfer (disaggregated prefill)",
    "hf_overrides": "overriding the checkpoint's config",
    "override_generation_config": "overriding generation_config.json",
    "task": "pooling / embedding tasks",
    "runner": "pooling / embedding runners",
}

LLM_IGNORED_KWARGS: dict[str, str] = {
    "disable_log_requests": "LLM logs no requests",
    "use_tqdm_on_load": "loading shows no progress bar",
}


def _is_off(value: Any) -> bool:
    return value is None or value is False or (not isinstance(value, bool) and value == 0) or value in ({}, [], "")


def pop_unsupported_engine_args(kwargs: dict[str, Any]) -> None:
    """Remove vLLM feature arguments given their "off" value from ``kwargs``; refuse any other value.

    Raises:
        HayabusaValidationError: naming the argument and the missing feature.
    """
    for name in [k for k in kwargs if k in UNSUPPORTED_ENGINE_ARGS]:
        value = kwargs.pop(name)
        if not _is_off(value):
            raise HayabusaValidationError(
                f"{name}={value!r}: {UNSUPPORTED_ENGINE_ARGS[name]} are not supported yet in hayabusa; leave "
                f"{name} out (or None).", parameter=name, value=value)


def pop_llm_ignored_kwargs(kwargs: dict[str, Any]) -> None:
    """Remove ``LLM_IGNORED_KWARGS`` from ``kwargs``, with one warning naming those given."""
    given = [k for k in kwargs if k in LLM_IGNORED_KWARGS]
    for name in given:
        kwargs.pop(name)
    if given:
        logger.warning("accepted for vLLM compatibility and ignored: %s.",
                       "; ".join(f"{k} ({LLM_IGNORED_KWARGS[k]})" for k in given))


# generation_config.json keys -> SamplingParams fields (vLLM's get_diff_sampling_param)
_GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_config_defaults(model_dir: str) -> dict[str, Any]:
    """The sampling defaults a checkpoint's generation_config.json sets (only when it samples: ``do_sample`` is
    not false), as SamplingParams fields."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        cfg = json.load(f)
    if cfg.get("do_sample") is False:
        cfg = {k: v for k, v in cfg.items() if k in ("repetition_penalty", "max_new_tokens")}
    return {field: cfg[key] for key, field in _GENERATION_CONFIG_FIELDS.items() if cfg.get(key) is not None}


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_priority(priority: Any, num_prompts: int | None) -> None:
    """vLLM's ``priority`` argument: None, or (``num_prompts`` given) a list of one int per prompt, (else) one int;
    every value 0, since requests run first come, first served (vLLM raises for a non-zero priority unless its
    scheduling_policy is "priority").

    Raises:
        HayabusaValidationError: naming ``priority``: a wrong type or length, or a non-zero value.
    """
    if priority is None:
        return
    if num_prompts is None:
        values = [priority]
    elif not isinstance(priority, (list, tuple)) or len(priority) != num_prompts:
        raise HayabusaValidationError(f"priority must be a list of one int per prompt ({num_prompts}), got "
                                      f"{_short_repr(priority)}.", parameter="priority", value=_short_repr(priority))
    else:
        values = list(priority)
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise HayabusaValidationError(f"priority must be an int, got {_short_repr(v)} ({type(v).__name__}).",
                                          parameter="priority", value=_short_repr(v))
        if v != 0:
            raise HayabusaValidationError(f"got priority {v}, but priority scheduling is not supported (vLLM's "
                                          "scheduling_policy='priority'): requests run first come, first served, "
                                          "so priority must be 0.", parameter="priority", value=v)
