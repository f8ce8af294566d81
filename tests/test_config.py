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
    assert s.log_targets == ("/tmp/ag-{rank}-{pid}.jsonl",)
    assert s.format_for(s.log_targets[0]) == "json"  # files default to JSON lines
    assert s.threshold_for(s.log_targets[0]) == "info"  # and get every event


def test_mode_off_disables() -> None:
    assert not load({"ATTNGUARD_MODE": "off"}).enabled
    assert not load({"ATTNGUARD": "0"}).enabled


def test_overrides_win_over_environment() -> None:
    s = load({"ATTNGUARD_MODE": "warn"}, {"mode": "strict", "fallback": ["eager"]})
    assert s.mode == "strict" and s.fallback == ("eager",)


@pytest.mark.parametrize(
    ("var", "value", "valid"),
    [
        ("ATTNGUARD", "maybe", "1 | true | yes | on (guard on) or 0 | false | no | off"),
        ("ATTNGUARD_MODE", "fixx", "fix | warn | strict | off"),
        ("ATTNGUARD_DISABLE", "cast,teleport", ", ".join(REMEDIES + INTEGRATIONS)),
        ("ATTNGUARD_LOG", "/tmp/x-{host}.log", "{rank} and {pid}"),
        ("ATTNGUARD_LOG", "/tmp/x{rank[0]}.log", "{rank} and {pid}"),
        ("ATTNGUARD_LOG", "/tmp/x{rank.foo}.log", "{rank} and {pid}"),
        ("ATTNGUARD_LOG", "/tmp/x{rank!r}.log", "{rank} and {pid}"),
        ("ATTNGUARD_LOG", "/tmp/x{rank:.2s}.log", "{rank} and {pid}"),
        ("ATTNGUARD_LOG", "/tmp/x{}.log", "{rank} and {pid}"),
        ("ATTNGUARD_LOG", "/tmp/x{rank.log", "{rank} and {pid}"),
        ("ATTNGUARD_LOG", "/tmp", "a file path in a writable directory"),
        ("ATTNGUARD_LOG", "/tmp/logs/", "a file path in a writable directory"),
        ("ATTNGUARD_LOG", "/etc/hostname/ev.jsonl", "a file path in a writable directory"),
        ("ATTNGUARD_LOG", "none,/tmp/ev.jsonl", "stderr,<file path>"),
        ("ATTNGUARD_LOG", "stderr,", "stderr,<file path>"),
        ("ATTNGUARD_LOG_LEVEL", "debug", "auto | info | warning | error"),
        ("ATTNGUARD_CONSOLE_RANKS", "zero", "all | a comma list of ranks"),
        ("ATTNGUARD_CONSOLE_RANKS", "0,-1", "all | a comma list of ranks"),
        ("ATTNGUARD_LOG_FORMAT", "xml", "auto | json | console"),
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


def test_the_switch_error_lists_every_word_the_switch_accepts() -> None:
    """``ATTNGUARD=yes`` switches the guard on: the error for ``ATTNGUARD=2`` says so."""
    with pytest.raises(ValueError) as err:
        load({"ATTNGUARD": "2"})
    listed = str(err.value).split("valid values: ")[1]
    on, off = listed.split(" or ")
    on_words = on.removesuffix(" (guard on)").split(" | ")
    off_words = off.removesuffix(" (guard off)").split(" | ")
    assert {"1", "yes", "true", "on"} <= set(on_words) and {"0", "no", "off"} <= set(off_words)
    for word in on_words:
        assert load({"ATTNGUARD": word.upper()}).enabled, word
    for word in off_words:
        assert not load({"ATTNGUARD": "" if word == "empty" else word}).enabled, word


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


@pytest.mark.parametrize(
    "template", ["/tmp/x{rank[0]}.log", "/tmp/x{rank.foo}.log", "/tmp", "/etc/hostname/x.log"]
)
def test_a_log_path_that_cannot_work_is_one_clear_error(template: str) -> None:
    """Placeholders other than {rank} / {pid}, a directory, a path under a file: a ValueError
    whose one line names the variable, the value and what is valid (no TypeError/KeyError)."""
    with pytest.raises(ValueError) as err:
        load({"ATTNGUARD_LOG": template})
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"attnguard: invalid ATTNGUARD_LOG={template!r} (")
    assert "placeholders {rank} and {pid} only" in msg


def test_an_unwritable_log_directory_is_refused(tmp_path) -> None:
    import os

    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        with pytest.raises(ValueError, match="is not writable"):
            load({"ATTNGUARD_LOG": str(locked / "ev-{rank}.jsonl")})
    finally:
        locked.chmod(0o700)


def test_log_targets_level_and_console_ranks(tmp_path) -> None:
    path = str(tmp_path / "ev-{rank:03d}.jsonl")
    s = load({"ATTNGUARD_LOG": f" stderr , {path}", "ATTNGUARD_CONSOLE_RANKS": "8, 0"})
    assert s.log_targets == ("stderr", path)
    assert s.threshold_for("stderr") == "warning" and s.threshold_for(path) == "info"
    assert s.console_ranks == (0, 8)
    s = load({"ATTNGUARD_LOG_LEVEL": "Error", "ATTNGUARD_CONSOLE_RANKS": "all"})
    assert s.threshold_for("stderr") == "error" and s.console_ranks is None
    assert load({"ATTNGUARD_LOG": "none"}).log_targets == ()
    assert load({}, {"console_ranks": [1, 2]}).console_ranks == (1, 2)


def test_misspelled_variables_are_named_with_the_closest_setting() -> None:
    from attnguard.config import unknown_variables

    env = {
        "ATTNGUARD_MOOD": "fix",
        "ATTNGUARD_KERNAL": "fastest",
        "attnguard_log": "none",  # the environment is case-sensitive: this one is ignored too
        "ATTNGUARD_COLOUR": "red",
        "ATTNGUARD_MODE": "warn",  # a setting
        "ATTNGUARD_INTERNAL_PARENT": "1:x",  # attnguard's own
        "PATH": "/bin",
    }
    lines = unknown_variables(env)
    assert lines[:3] == [
        "attnguard: ATTNGUARD_COLOUR is not a setting (ignored); the settings are "
        "ATTNGUARD, ATTNGUARD_MODE, ATTNGUARD_DISABLE, ATTNGUARD_LOG, ATTNGUARD_LOG_FORMAT, "
        "ATTNGUARD_LOG_LEVEL, ATTNGUARD_CONSOLE_RANKS, ATTNGUARD_DTYPE, ATTNGUARD_FALLBACK, "
        "ATTNGUARD_FP32_POLICY, ATTNGUARD_KERNEL, ATTNGUARD_KERNEL_CACHE, ATTNGUARD_VERIFY",
        "attnguard: ATTNGUARD_KERNAL is not a setting (ignored); did you mean ATTNGUARD_KERNEL?",
        "attnguard: ATTNGUARD_MOOD is not a setting (ignored); did you mean ATTNGUARD_MODE?",
    ]
    assert lines[3:] == [
        "attnguard: attnguard_log is not a setting (ignored); did you mean ATTNGUARD_LOG?"
    ]
    assert load(env).mode == "warn"  # the guard still runs with what is valid


@pytest.mark.parametrize("spec", ["0256d", ">999999999d", "x>1000d", "0" * 200 + "1000d"])
def test_a_log_placeholder_wider_than_a_file_name_is_refused_before_formatting(spec: str) -> None:
    with pytest.raises(ValueError, match="a path component holds at most 255"):
        load({"ATTNGUARD_LOG": f"/tmp/x{{rank:{spec}}}.log"})


def test_log_placeholders_that_fit_a_file_name_stay_valid(tmp_path) -> None:
    for spec in ("03d", "x>250d", "0250d", "_"):
        assert load({"ATTNGUARD_LOG": str(tmp_path / f"x{{rank:{spec}}}")}).log


def test_files_get_json_lines_whatever_the_console_format(tmp_path) -> None:
    """``ATTNGUARD_LOG_FORMAT=console`` with ``stderr,<file>`` wrote console lines into the file,
    which ``attnguard summary`` then skipped as malformed."""
    path = str(tmp_path / "ev-{rank}.jsonl")
    s = load({"ATTNGUARD_LOG": f"stderr,{path}", "ATTNGUARD_LOG_FORMAT": "console"})
    assert s.format_for("stderr") == "console" and s.format_for(path) == "json"


def test_the_start_up_hook_watches_and_resolves_the_libraries_attnguard_patches() -> None:
    import _attnguard_hook

    from attnguard.integrations import REGISTRY

    switchable = [i for i in REGISTRY if i.switchable]
    targets = {part.trigger.partition(".")[0] for i in switchable for part in i.parts}
    assert targets == set(INTEGRATIONS) == set(_attnguard_hook.LIBRARIES)
    assert {i.name for i in switchable} == set(INTEGRATIONS)  # what ATTNGUARD_DISABLE names
