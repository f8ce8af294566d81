"""Every bad setting gets its least harmful outcome (README "Configuration", the table "a value
that is not valid"): a bad log destination keeps the guard on, its events on stderr, and one line
says why. Before, any bad value switched the whole guard off: a flash model then failed to load
as if attnguard were not installed, for a logging typo.

Fresh interpreters for what a user runs (a flash-attention load with flash-attn absent, on the
twins when guarded; ``attnguard run``), :func:`attnguard.config.read` for the table itself.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path

import pytest
from helpers.hook import env_for, needs_hook
from helpers.processes import PY, subprocess_env

from attnguard import config
from attnguard.config import Settings

# a tiny Llama asked for flash attention (flash-attn is not installed here): guarded, it loads
# and runs on attnguard's twins; unguarded, transformers refuses the load
LOAD = """
import attnguard, torch, transformers
cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="flash_attention_2")
with torch.no_grad():
    model(torch.tensor([[1, 2, 3, 4]]))
print("ran", attnguard.is_active(), attnguard.settings().log)
"""

BAD_LOGS = ["directory", "/proc/attnguard-events.jsonl", "stdout", "ev-{Rank}.jsonl"]


def _value(tmp_path: Path, value: str) -> str:
    return str(tmp_path) if value == "directory" else value


@pytest.mark.parametrize("value", BAD_LOGS)
def test_a_bad_log_destination_keeps_the_guard_on_with_events_on_stderr(
    tmp_path: Path, value: str
) -> None:
    if value.startswith("/proc/") and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    value = _value(tmp_path, value)
    res = subprocess.run(
        [PY, "-c", LOAD],
        env=subprocess_env(ATTNGUARD_LOG=value, ATTNGUARD_LOG_FORMAT="json", HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout == "ran True stderr\n"
    said, *rest = res.stderr.splitlines()
    assert said.startswith(f"attnguard: invalid ATTNGUARD_LOG={value!r} (")
    assert said.endswith(" (events go to stderr instead)")
    got = [json.loads(line) for line in rest if line.startswith("{")]  # transformers' own too
    assert [e["event"] for e in got] == ["backend_fallback", "summary"]
    assert not (tmp_path / "stdout").exists()  # no file named after the stream meant


@needs_hook
def test_under_the_startup_hook_too(tmp_path: Path) -> None:
    res = subprocess.run(
        [PY, "-c", LOAD],
        env=env_for(ATTNGUARD="1", ATTNGUARD_LOG=str(tmp_path), ATTNGUARD_LOG_FORMAT="json"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout == "ran True stderr\n", res.stderr[-3000:]
    lines = res.stderr.splitlines()
    assert [line for line in lines if "invalid ATTNGUARD_LOG" in line] == lines[:1]  # said once
    got = [json.loads(line) for line in lines if line.startswith("{")]
    assert [e["event"] for e in got] == ["backend_fallback", "summary"]


def test_attnguard_run_starts_its_command_with_a_bad_log_setting(tmp_path: Path) -> None:
    """A setting that only says where events go is no usage error: the command runs guarded,
    its guard says the value once. One that chooses what the guard does still refuses (exit 2:
    tests/test_bad_settings.py)."""
    child = "import attnguard; print(attnguard.is_active(), attnguard.settings().log)"
    res = subprocess.run(
        [PY, "-m", "attnguard", "run", "--", PY, "-c", child],
        env=env_for(ATTNGUARD_LOG=str(tmp_path), ATTNGUARD_LOG_LEVEL="loud"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0 and res.stdout == "True stderr\n", res.stderr
    assert [line.split("=", 1)[0] for line in res.stderr.splitlines()] == [
        "attnguard: invalid ATTNGUARD_LOG",
        "attnguard: invalid ATTNGUARD_LOG_LEVEL",
    ]
    for refused in ("ATTNGUARD_MODE", "ATTNGUARD_DISABLE", "ATTNGUARD_KERNEL"):
        res = subprocess.run(
            [PY, "-m", "attnguard", "run", "--", PY, "-c", "print('ran')"],
            env=env_for(**{refused: "loud"}),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 2 and res.stdout == "", (refused, res.stderr)
        assert res.stderr.startswith(f"attnguard: invalid {refused}='loud'")


# what each bad value comes to: (variable, bad value, the settings that differ from the default,
# what the line says is done instead)
TABLE = [
    ("ATTNGUARD", "2", {"enabled": False}, "attnguard is off for this process"),
    ("ATTNGUARD_MODE", "fixx", {"mode": "warn"}, "attnguard runs in warn mode"),
    ("ATTNGUARD_DISABLE", "unfiy", {"mode": "warn"}, "attnguard runs in warn mode"),
    (
        "ATTNGUARD_DISABLE",
        "cast,diffuser",
        {"mode": "warn", "disable": frozenset({"cast"})},
        "cast disabled; attnguard runs in warn mode",
    ),
    ("ATTNGUARD_LOG", "/", {}, "events go to stderr instead"),
    ("ATTNGUARD_LOG", "stdout", {}, "events go to stderr instead"),
    ("ATTNGUARD_LOG_FORMAT", "xml", {}, "ATTNGUARD_LOG_FORMAT=auto is used"),
    ("ATTNGUARD_LOG_LEVEL", "debug", {}, "ATTNGUARD_LOG_LEVEL=auto is used"),
    ("ATTNGUARD_CONSOLE_RANKS", "zero", {}, "ATTNGUARD_CONSOLE_RANKS=all is used"),
    ("ATTNGUARD_DTYPE", "fp8", {}, "ATTNGUARD_DTYPE=auto is used"),
    ("ATTNGUARD_FALLBACK", "flash_attention_2", {}, "ATTNGUARD_FALLBACK=sdpa,eager is used"),
    ("ATTNGUARD_FALLBACK", "eagr,eager", {"fallback": ("eager",)}, "eager is used"),
    ("ATTNGUARD_FP32_POLICY", "round", {}, "ATTNGUARD_FP32_POLICY=cast is used"),
    ("ATTNGUARD_KERNEL", "fast", {}, "ATTNGUARD_KERNEL=requested is used"),
    ("ATTNGUARD_KERNEL_CACHE", "relative/dir", {}, "the default directory"),
]


@pytest.mark.parametrize(("var", "value", "differs", "instead"), TABLE)
def test_each_bad_value_has_its_least_harmful_substitute(
    var: str, value: str, differs: dict, instead: str
) -> None:
    settings, problems = config.read({var: value})
    assert settings == dataclasses.replace(Settings(), **differs)
    (problem,) = problems
    assert problem.var == var and problem.line.startswith(f"attnguard: invalid {var}=")
    assert problem.line.endswith(")") and instead in problem.line.rsplit(" (", 1)[1]
    with pytest.raises(ValueError):  # the caller's own argument still raises
        config.load({var: value})


def test_a_bad_disable_list_leaves_an_explicit_mode_and_off_as_they_are() -> None:
    env = {"ATTNGUARD_DISABLE": "unfiy"}
    assert config.read(env, {"mode": "fix"})[0].mode == "fix"  # the caller's choice stands
    assert not config.read({**env, "ATTNGUARD_MODE": "off"})[0].enabled


def test_the_defaults_the_lines_name_are_the_settings_defaults() -> None:
    default = Settings()
    for fld, shown in config.DEFAULTS.items():
        value = getattr(default, fld)
        if isinstance(value, tuple):
            value = ",".join(value)
        assert (value if value is not None else "all") == shown, fld
