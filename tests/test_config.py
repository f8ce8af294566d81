"""Settings: defaults, environment, overrides, and one clear message per invalid value."""

from __future__ import annotations

import pytest

import attnguard
from attnguard.config import FALLBACK_BACKENDS, INTEGRATIONS, REMEDIES, load


def test_defaults_without_environment() -> None:
    s = load({})
    assert (s.enabled, s.mode, s.dtype, s.fallback, s.fp32_policy) == (
        True,
        "fix",
        "auto",
        ("sdpa", "eager"),
        "cast",
    )
    assert s.log == "stderr" and s.disable == frozenset()


def test_environment_values_are_read_and_normalised() -> None:
    s = load(
        {
            "ATTNGUARD": "1",
            "ATTNGUARD_MODE": " Warn ",
            "ATTNGUARD_DISABLE": "cast, place,xformers",
            "ATTNGUARD_LOG": "/tmp/ag-{rank}-{pid}.jsonl",
            "ATTNGUARD_DTYPE": "FP16",
            "ATTNGUARD_FALLBACK": "eager,sdpa",
            "ATTNGUARD_FP32_POLICY": "fallback",
        }
    )
    assert s.mode == "warn" and s.dtype == "fp16" and s.fp32_policy == "fallback"
    assert s.disable == {"cast", "place", "xformers"}
    assert not s.allows("cast") and s.allows("fallback")
    assert s.fallback == ("eager", "sdpa")
    assert s.log_format == "json"  # files default to JSON lines


def test_mode_off_disables() -> None:
    assert not load({"ATTNGUARD_MODE": "off"}).enabled
    assert not load({"ATTNGUARD": "0"}).enabled


def test_overrides_win_over_environment() -> None:
    s = load({"ATTNGUARD_MODE": "warn"}, {"mode": "strict", "fallback": ["eager"]})
    assert s.mode == "strict" and s.fallback == ("eager",)


@pytest.mark.parametrize(
    ("var", "value", "valid"),
    [
        ("ATTNGUARD", "maybe", "1 | 0"),
        ("ATTNGUARD_MODE", "fixx", "fix | warn | strict | off"),
        ("ATTNGUARD_DISABLE", "cast,teleport", ", ".join(REMEDIES + INTEGRATIONS)),
        ("ATTNGUARD_LOG", "/tmp/x-{host}.log", "{rank} and {pid}"),
        ("ATTNGUARD_LOG_FORMAT", "xml", "json | console"),
        ("ATTNGUARD_DTYPE", "fp8", "auto | bf16 | fp16"),
        ("ATTNGUARD_FALLBACK", "sdpa,flash_attention_2", ", ".join(FALLBACK_BACKENDS)),
        ("ATTNGUARD_FALLBACK", ",", ", ".join(FALLBACK_BACKENDS)),
        ("ATTNGUARD_FP32_POLICY", "round", "cast | fallback"),
    ],
)
def test_invalid_value_names_variable_value_and_valid_values(
    var: str, value: str, valid: str
) -> None:
    with pytest.raises(ValueError) as err:
        load({var: value})
    msg = str(err.value)
    assert var in msg and repr(value) in msg and valid in msg


def test_empty_variable_means_default_but_empty_override_is_an_error() -> None:
    assert load({"ATTNGUARD_LOG": "", "ATTNGUARD_MODE": " "}).log == "stderr"
    with pytest.raises(ValueError, match="ATTNGUARD_LOG=' '; valid values: stderr | none"):
        load({}, {"log": " "})


def test_unknown_override_is_named() -> None:
    with pytest.raises(ValueError, match="unknown setting 'colour'.*valid settings: .*mode"):
        load({}, {"colour": "red"})


def test_activate_rejects_bad_override_and_stays_off() -> None:
    with pytest.raises(ValueError, match="ATTNGUARD_MODE"):
        attnguard.activate(mode="loud")
    assert not attnguard.is_active()


def test_configure_keeps_earlier_overrides() -> None:
    attnguard.activate(log="none", mode="warn")
    s = attnguard.configure(dtype="fp16")
    assert (s.mode, s.dtype, s.log) == ("warn", "fp16", "none")
    assert attnguard.settings() == s
