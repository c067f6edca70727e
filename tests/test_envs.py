"""hayabusa/envs.py: the one parser of on/off environment switches."""

import pytest

from hayabusa.envs import env_flag
from hayabusa.errors import HayabusaValidationError


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), (" On ", True), ("YES", True),
                                      ("0", False), ("false", False), ("off", False), ("", False), ("No", False)])
def test_env_flag_values(monkeypatch, raw, want):
    monkeypatch.setenv("HAYABUSA_TEST_FLAG", raw)
    assert env_flag("HAYABUSA_TEST_FLAG", not want) is want


def test_env_flag_default_and_bad_value(monkeypatch):
    monkeypatch.delenv("HAYABUSA_TEST_FLAG", raising=False)
    assert env_flag("HAYABUSA_TEST_FLAG", True) is True and env_flag("HAYABUSA_TEST_FLAG", False) is False
    monkeypatch.setenv("HAYABUSA_TEST_FLAG", "2")
    with pytest.raises(HayabusaValidationError, match="HAYABUSA_TEST_FLAG='2'") as e:
        env_flag("HAYABUSA_TEST_FLAG", False)
    assert e.value.parameter == "HAYABUSA_TEST_FLAG" and e.value.value == "2"


def test_env_flag_refusal_lists_every_value_it_takes(monkeypatch):
    """The refusal names what the parser accepts (true / yes / on and false / no / off and empty are accepted too,
    so "use 1 or 0" alone misled: a user who wrote `true` elsewhere could not tell it works)."""
    monkeypatch.setenv("HAYABUSA_TEST_FLAG", "garbage")
    with pytest.raises(HayabusaValidationError) as e:
        env_flag("HAYABUSA_TEST_FLAG", False)
    for word in ("1", "true", "yes", "on", "0", "false", "no", "off", "empty"):
        assert word in str(e.value), (word, str(e.value))


def test_parse_sweep_switch_takes_the_environment_spellings_and_none_only_where_the_default_is_none():
    from hayabusa.envs import parse_sweep_switch

    assert [parse_sweep_switch(v, "k") for v in ("1", " On", "YES", "true", "0", "off", "No", "FALSE")] == \
        [True] * 4 + [False] * 4
    assert parse_sweep_switch("null", "k", nullable=True) is None
    for bad, nullable in (("none", False), ("", True), ("2", True), ("maybe", False)):
        with pytest.raises(ValueError, match=f"--sweep k={bad!r}: use 1 / true / yes / on") as e:
            parse_sweep_switch(bad, "k", nullable)
        assert e.value.parameter == "sweep" and e.value.value == bad


def test_switches_list_every_switch_the_code_reads():
    """envs.SWITCHES holds every HAYABUSA_* variable the package reads as an on/off switch: each env_flag("...")
    literal, and the module constants that name a switch (PDL_SWITCH, SMALL_M_SWITCH, batch_invariant.ENV_VAR)."""
    import re
    from pathlib import Path

    from hayabusa.envs import SWITCHES

    root = Path(__file__).resolve().parents[1] / "hayabusa"
    read = set()
    for path in root.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        read |= set(re.findall(r'env_flag\("(HAYABUSA_[A-Z0-9_]+)"', text))
        read |= set(re.findall(r'^(?:PDL_SWITCH|SMALL_M_SWITCH|ENV_VAR) = "(HAYABUSA_[A-Z0-9_]+)"', text, re.M))
    assert len(read) >= 16 and read == set(SWITCHES), read ^ set(SWITCHES)


def test_a_bad_switch_is_refused_when_an_engine_is_configured(monkeypatch):
    """A switch read only by a scheme's kernels (HAYABUSA_WO_MID_M: int4 / int8) is refused by name for an
    unquantized model too, when its config is made."""
    from hayabusa.assets import demo_model_dir
    from hayabusa.config import EngineArgs

    monkeypatch.setenv("HAYABUSA_WO_MID_M", "maybe")
    with pytest.raises(HayabusaValidationError, match="HAYABUSA_WO_MID_M") as e:
        EngineArgs(model=demo_model_dir(), device="cpu").create_engine_config()
    assert e.value.parameter == "HAYABUSA_WO_MID_M"
    monkeypatch.setenv("HAYABUSA_WO_MID_M", "1")
    EngineArgs(model=demo_model_dir(), device="cpu").create_engine_config()
