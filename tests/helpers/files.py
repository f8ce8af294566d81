"""Files on a shared machine: a log's JSON lines, steps run as a second local user, attnguard run
with a guarded command, the check that a refused log path went around to a fresh file. The
second user and the shared directory themselves are fixtures (tests/conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.processes import PY, subprocess_env

SECRET_NOTES = "the victim's own notes\n"  # a file of the victim's that nobody may write into


def private_run_dir(work: Path) -> Path:
    """A stand-in for the login session's $XDG_RUNTIME_DIR: the victim's alone."""
    path = work / "run"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def as_user(user: tuple[int, int], steps: Callable[[], None]) -> None:
    """Run ``steps`` in a child process that has become ``user``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
            steps()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the attacker's steps failed"


# A command that uses attnguard: the start-up hook activates it (and opens the log) there.
GUARDED = "import attnguard; attnguard.is_active()"


def attnguard_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    marker = tmp_path / "command-ran"
    return subprocess.run(
        [PY, "-m", "attnguard", "run", "--", PY, "-c", f"{GUARDED}; open({str(marker)!r}, 'w')"],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def went_around(res: subprocess.CompletedProcess[str], asked: Path, where: Path) -> Path:
    """The guard stayed on and said, once and on stderr too, why ``asked`` was not used and
    which fresh file of its own (in ``where``) holds this process's events instead; returns
    that file."""
    assert res.returncode == 0 and res.stdout == "ran True\n", res.stderr
    (used,) = where.glob(f"{asked.stem}.*{asked.suffix}")
    assert used.stat().st_uid == os.geteuid()
    events = records(used)
    assert [e["event"] for e in events] == ["activated", "observed", "summary"], events
    refused = events[1]
    assert refused["reason_code"] == "log_path_refused" and refused["level"] == "warning"
    assert refused["log_file"] == str(used)
    assert f"ATTNGUARD_LOG: {asked} is not used (" in refused["reason"]
    assert f"writes its events to {used} instead" in refused["reason"]
    assert res.stderr == f"attnguard WARNING: {refused['reason']}\n"
    return used
