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
