"""hayabusa's switches read from the environment (as vLLM's ``vllm/envs.py``): one parser for every on/off flag."""

from __future__ import annotations

import os

from hayabusa.errors import HayabusaValidationError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")


def env_flag(name: str, default: bool) -> bool:
    """The on/off switch ``name`` (e.g. ``HAYABUSA_EAGLE_GRAPHS``): ``default`` when unset; 1 / true / yes / on
    and 0 / false / no / off (any case, spaces ignored; empty = off) otherwise.

    Raises:
        HayabusaValidationError: any other value, naming the variable and the values it takes.
    """
    raw = os.environ.get(name)
    return default if raw is None else parse_switch(raw, name, f"environment variable {name}")


def parse_switch(raw: str, parameter: str, what: str | None = None) -> bool:
    """An on/off value as the environment variables take it: 1 / true / yes / on and 0 / false / no / off (any case,
    spaces ignored; empty = off). ``parameter`` is what the error names (``what``: how it reads in the message,
    default the parameter).

    Raises:
        HayabusaValidationError: any other value, naming the parameter and the values it takes.
    """
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise HayabusaValidationError(f"{what or parameter}={raw!r}: use 1 / true / yes / on (on) or "
                                  f"0 / false / no / off or empty (off), any case.", parameter=parameter, value=raw)


def parse_sweep_switch(raw: str, key: str, nullable: bool = False) -> bool | None:
    """One value of a switch in ``--sweep KEY=V1,V2`` (``hayabusa bench`` and ``hayabusa eval``): the environment
    variables' spellings, and none / null (the argument's default, e.g. batch_invariant=None: the environment
    variable decides) where ``nullable``. Empty entries never get here (a sweep drops them).

    Raises:
        HayabusaValidationError: any other value, naming ``--sweep KEY`` and the spellings it takes.
    """
    value = raw.strip().lower()
    if nullable and value in ("none", "null"):
        return None
    if value and value in _TRUE + _FALSE:
        return value in _TRUE
    raise HayabusaValidationError(f"--sweep {key}={raw!r}: use 1 / true / yes / on or 0 / false / no / off (any "
                                  f"case){', or none (the default)' if nullable else ''}.", parameter="sweep",
                                  value=raw)


# Every on/off switch hayabusa reads with env_flag (where each is read: docs/structure.md). Most are read when their
# module is imported, which for the kernels of one scheme or model kind happens only when that scheme or model
# loads; check_switches reads them all when an engine's config is made, so a value that is not a switch is refused
# at once whatever the model (tests/test_envs.py checks the list against the code).
SWITCHES = (
    "HAYABUSA_BATCH_INVARIANT", "HAYABUSA_DRAFT_MIRROR_GRAPHS", "HAYABUSA_EAGLE_GRAPHS", "HAYABUSA_FP8_PREQUANT",
    "HAYABUSA_FP8_SMALL_M", "HAYABUSA_FUSED_ACT_QUANT", "HAYABUSA_GREEDY_VERIFY_TRITON", "HAYABUSA_MIXED_GRAPHS",
    "HAYABUSA_PDL", "HAYABUSA_SHORT_QUERY_SPLIT", "HAYABUSA_SMALL_M_LINEAR", "HAYABUSA_T5_ENCODER_GRAPHS",
    "HAYABUSA_T5_FP16_FUSED_NORM", "HAYABUSA_WO_GEMM_T", "HAYABUSA_WO_MID_M", "HAYABUSA_WO_SMALL_M",
)


def check_switches() -> None:
    """Parse every SWITCHES variable that is set.

    Raises:
        HayabusaValidationError: the first one whose value is not a switch, naming it (env_flag's message)."""
    for name in SWITCHES:
        env_flag(name, False)


__all__ = ["SWITCHES", "check_switches", "env_flag", "parse_switch", "parse_sweep_switch"]
