"""A bad ATTNGUARD_* value in the environment never stops a program: a variable set for a whole
cluster reaches every job there, and ``ATTNGUARD_MODE=fixx`` must not end each of them with a
traceback. Whatever the entry (``import attnguard``, the ``ATTNGUARD=1`` start-up hook, a call of
``attnguard.activate()`` without arguments), it is one line on stderr naming the variable, the
value, the valid values and what is done instead, its least harmful substitute (a bad mode: warn
mode; every substitute: tests/test_bad_log_setting.py). The caller's own arguments
(``attnguard.activate(mode="fixx")``) still raise: that is the programmer's call. The
``attnguard run`` command refuses to start its command (exit 2) for a setting that chooses what
the guard does: a command line with a bad setting is a usage error said before anything ran, as
for a bad option.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers.hook import env_for, needs_hook
from helpers.processes import PY

import attnguard

TRAIN = """
import attnguard
import transformers
print("trained", attnguard.is_active())
"""

LINE = "attnguard: invalid ATTNGUARD_MODE='fixx'; valid values: fix | warn | strict | off"
WARN = " (attnguard runs in warn mode: it says what it would change and changes nothing)"


def run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", code], env=env_for(**env), capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    "entry", ["import", pytest.param("hook", marks=needs_hook), "activate()", "configure()"]
)
def test_a_bad_value_in_the_environment_is_one_line_and_the_program_runs(entry: str) -> None:
    code = TRAIN
    if entry in ("activate()", "configure()"):
        code = code.replace("import attnguard\n", f"import attnguard\nattnguard.{entry}\n")
    env = {"ATTNGUARD_MODE": "fixx"} | ({"ATTNGUARD": "1"} if entry == "hook" else {})
    res = run(code.replace("is_active()", "settings().mode"), **env)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "trained warn\n"
    assert res.stderr.splitlines() == [LINE + WARN]


def test_a_log_file_the_environment_names_that_cannot_be_opened_is_one_line(
    tmp_path: Path,
) -> None:
    """/proc passes the path checks but cannot hold a file: known only when the file is opened."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    res = run(TRAIN, ATTNGUARD_LOG="/proc/attnguard-events.jsonl")
    assert res.returncode == 0 and res.stdout == "trained True\n", res.stderr
    (line,) = res.stderr.splitlines()
    assert line.startswith("attnguard: invalid ATTNGUARD_LOG='/proc/attnguard-events.jsonl' (")
    assert line.endswith(" (events go to stderr instead)")


def test_the_callers_own_argument_still_raises_and_stands_over_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="invalid ATTNGUARD_MODE='fixx'; valid values: fix"):
        attnguard.activate(mode="fixx", log="none")
    assert not attnguard.is_active()
    monkeypatch.setenv("ATTNGUARD_MODE", "fixx")
    # an explicit mode stands: the variable is not read, so it is no error
    assert attnguard.activate(mode="warn", log="none").mode == "warn"
    assert attnguard.is_active() and capsys.readouterr().err == ""


def test_attnguard_run_refuses_to_start_its_command(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    res = subprocess.run(
        [PY, "-m", "attnguard", "run", "--", PY, "-c", f"open({str(marker)!r}, 'w')"],
        env=env_for(ATTNGUARD_MODE="fixx"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and not marker.exists()
    assert res.stderr.splitlines() == [LINE]
