"""The ``attnguard`` command at its edges: a closed pipe, ``--help``, the signals
``attnguard run`` hands its command, and ``attnguard summary`` over files written beside a
console-format stderr. Real processes and pipes throughout."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import PY, subprocess_env

from attnguard import cli

SCRIPT = Path(PY).parent / "attnguard"
COMMANDS = [[PY, "-m", "attnguard"]] + ([[str(SCRIPT)]] if SCRIPT.is_file() else [])

# One process's events in a file: an activation, a change, its exit summary.
EVENTS = """
import attnguard
from attnguard.observability import events
attnguard.is_active()
events.emit("backend_fallback", site="transformers.load", reason_code="package_missing",
            reason="flash-attn is not installed", applied=True)
"""


def event_file(tmp_path: Path, **env: str) -> tuple[Path, subprocess.CompletedProcess[str]]:
    log = tmp_path / "ev-{rank}.jsonl"
    res = subprocess.run(
        [PY, "-c", EVENTS],
        env=subprocess_env(ATTNGUARD="1", **{"ATTNGUARD_LOG": str(log), **env}),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    return tmp_path / "ev-0.jsonl", res


def into_a_closed_pipe(cmd: list[str]) -> tuple[int, bytes]:
    """Run ``cmd`` with its stdout a pipe whose reader has already gone (``| head -1`` once
    head has its line): the exit status and stderr."""
    read, write = os.pipe()
    os.close(read)  # gone before the command starts: no write of it can race the close
    try:
        proc = subprocess.Popen(cmd, stdout=write, stderr=subprocess.PIPE)
    finally:
        os.close(write)
    assert proc.stderr is not None
    err = proc.stderr.read()
    return proc.wait(timeout=300), err


@pytest.mark.parametrize("args", [["summary", "--json", "FILE"], ["doctor"]], ids=" ".join)
@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: Path(c[-1]).name)
def test_a_closed_pipe_ends_the_command_as_it_ends_cat(
    command: list[str], args: list[str], tmp_path: Path
) -> None:
    """``attnguard summary --json FILE | head -1`` ended with a BrokenPipeError traceback and
    exit 1: now it ends quietly by SIGPIPE, as cat does."""
    path, _ = event_file(tmp_path)
    args = [str(path) if a == "FILE" else a for a in args]
    cat = into_a_closed_pipe(["cat", str(path)])
    assert cat[0] < 0 and cat[1] == b""  # killed by SIGPIPE, nothing said
    assert into_a_closed_pipe([*command, *args]) == cat


def test_run_hands_its_command_the_signals_a_shell_would() -> None:
    """Python ignores SIGPIPE and SIGXFSZ; an exec'd command inherits what is ignored."""
    plain = subprocess.run(
        ["grep", "SigIgn", "/proc/self/status"], capture_output=True, text=True, check=True
    )
    for command in COMMANDS:
        res = subprocess.run(
            [*command, "run", "--", "grep", "SigIgn", "/proc/self/status"],
            env=subprocess_env(ATTNGUARD_LOG="none"),
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0 and res.stdout == plain.stdout, (command, res.stderr)


def test_help_is_plain_text(capsys: pytest.CaptureFixture[str]) -> None:
    """``attnguard --help`` showed reStructuredText double backticks."""
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "`" not in out
    assert all(f"attnguard {c}" in " ".join(out.split()) for c in ("run --", "doctor", "summary"))


def test_files_stay_json_for_the_summary_whatever_the_console_format(tmp_path: Path) -> None:
    """``ATTNGUARD_LOG=stderr,<file> ATTNGUARD_LOG_FORMAT=console``: console lines on stderr,
    JSON lines in the file, which ``attnguard summary`` reads."""
    path, res = event_file(
        tmp_path,
        ATTNGUARD_LOG=f"stderr,{tmp_path / 'ev-{rank}.jsonl'}",
        ATTNGUARD_LOG_FORMAT="console",
    )
    assert res.stderr.startswith("attnguard WARNING: flash-attn is not installed [backend_fallback")
    lines = path.read_text().splitlines()
    assert [json.loads(line)["event"] for line in lines] == [
        "activated",
        "backend_fallback",
        "summary",
    ]
    got = subprocess.run(
        [PY, "-m", "attnguard", "summary", str(path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert got.returncode == 0 and "malformed" not in got.stdout, got.stdout
    assert "backend_fallback" in got.stdout and "package_missing" in got.stdout


@pytest.mark.parametrize(
    ("switch", "hook_on", "guarded"),
    [(None, False, True), ("1", True, True), ("0", False, False), ("yes", True, True)],
)
def test_doctor_says_whether_programs_here_are_guarded(
    switch: str | None, hook_on: bool, guarded: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``attnguard doctor --json`` said ``"enabled": true`` with ATTNGUARD unset, where no
    program started here was guarded by the hook. It now says what holds: the start-up hook
    installed and switched on or not, and whether a program importing attnguard is guarded."""
    from attnguard import doctor

    if switch is None:
        monkeypatch.delenv("ATTNGUARD", raising=False)
    else:
        monkeypatch.setenv("ATTNGUARD", switch)
    installed = (Path(sysconfig.get_paths()["purelib"]) / "attnguard.pth").is_file()
    assert doctor.guard_state() == {
        "startup_hook_installed": installed,
        "startup_hook_on": hook_on and installed,
        "active_when_imported": guarded,
    }
    line = doctor._guard_line(doctor.guard_state())
    assert ("start-up hook on" in line) == (hook_on and installed)
    assert line.endswith("a program that imports attnguard: guarded") == guarded
    if switch is None:  # the whole report, once
        data = json.loads(doctor.render(as_json=True))
        assert data["guard"] == doctor.guard_state() and "enabled" not in data["settings"]
        assert line in doctor.render(as_json=False).splitlines()


# --- attnguard doctor's first line: who serves flash_attention_2 here ---------------------------


def _doctor_data(usable: bool, mode: str = "fix", guarded: bool = True, **action: Any) -> Any:
    """What doctor gathers, as far as its verdict reads it."""
    flash = {"usable": usable, "reason": "flash-attn is not installed", "version": None}
    if usable:
        flash.update(reason="flash-attn 2.8.3 works on this GPU", version="2.8.3")
    actions = [{"problem": "p", "after": None, **action}] if action else []
    return {
        "guard": {"active_when_imported": guarded},
        "settings": {"mode": mode},
        "facts": {"backends": {"flash_attention_2": flash}},
        "sample_plan": {"actions": actions},
    }


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (_doctor_data(True), "served by flash-attn 2.8.3 itself (it runs here)"),
        (
            _doctor_data(False, rule="flash-on-sdpa", after="sdpa_twin"),
            "served by attnguard's twins on transformers' flash code path "
            "(flash-attn is not installed)",
        ),
        (
            _doctor_data(False, rule="flash-unusable", after="eager"),
            "served by transformers' eager attention (the first of ATTNGUARD_FALLBACK that fits) "
            "(flash-attn is not installed)",
        ),
        (
            _doctor_data(False, "warn", rule="flash-on-sdpa", after="sdpa_twin"),
            "transformers' own error (flash-attn is not installed); warn mode only reports",
        ),
        (
            _doctor_data(False, "strict", rule="flash-on-sdpa", after="sdpa_twin"),
            "AttnGuardError (flash-attn is not installed); strict mode raises",
        ),
        (
            _doctor_data(False, rule="remedy-disabled"),
            "transformers' own error (flash-attn is not installed); ATTNGUARD_DISABLE=fallback",
        ),
        (
            _doctor_data(False, guarded=False, rule="flash-on-sdpa", after="sdpa_twin"),
            "transformers' own error (flash-attn is not installed); attnguard is switched off",
        ),
        (
            _doctor_data(False, rule="flash-path-unrecognised", problem="no _lazy_imports"),
            "as without attnguard (flash-attn is not installed); attnguard steps aside: no _lazy",
        ),
    ],
)
def test_doctor_verdict_is_a_function_of_what_it_gathered(data: Any, said: str) -> None:
    from attnguard import doctor

    line = doctor.verdict(data)
    assert line.startswith("flash_attention_2 requests on this machine: " + said), line
    assert "\n" not in line


@pytest.mark.parametrize(
    ("env", "said"),
    [
        ({}, "served by attnguard's twins on transformers' flash code path"),
        ({"ATTNGUARD_MODE": "warn"}, "warn mode only reports"),
        ({"ATTNGUARD_DISABLE": "fallback"}, "ATTNGUARD_DISABLE=fallback keeps it"),
    ],
)
def test_doctor_opens_with_its_verdict(env: dict[str, str], said: str) -> None:
    """``attnguard doctor`` on this machine (flash-attn absent, CPU): the first line says who
    serves flash_attention_2 requests, then the report; --json carries it first too."""
    if importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash-attn is importable here")
    run = subprocess.run(
        [PY, "-m", "attnguard", "doctor"],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    first, blank, title = run.stdout.splitlines()[:3]
    assert first.startswith("flash_attention_2 requests on this machine: ") and said in first
    assert "(flash-attn is not installed)" in first and (blank, title) == ("", "attnguard doctor")
    raw = subprocess.run(
        [PY, "-m", "attnguard", "doctor", "--json"],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert next(iter(json.loads(raw))) == "verdict" and json.loads(raw)["verdict"] == first
