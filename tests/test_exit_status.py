"""Exit codes and signals are the program's own, guarded or not.

Python dies of SIGINT (130 in a shell, -2 here) when Ctrl-C ends the program unhandled; launchers
and shells read that. CPython keeps that fact in a flag which any code run from a string clears
(a dataclass or a namedtuple being made), so an exit handler importing such a module for the
first time turned the death by SIGINT into a plain exit 1. Each case runs one program twice in
fresh interpreters, unguarded and guarded, and compares how they ended; the guarded run's summary
must still be written (it ran in the exit handler).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.processes import PY, subprocess_env

PROGRAM = """
import os, sys
if os.environ.get("ATTNGUARD") == "1":
    import attnguard
    from attnguard.observability import events

    attnguard.is_active()  # under the start-up hook, using the API activates
    if sys.argv[1] == "event":
        events.emit("device_map_rewritten", site="transformers.load",
                    reason_code="device_map_per_rank", reason="one replica per rank", applied=True)
if sys.argv[2] == "ctrl-c":
    raise KeyboardInterrupt
sys.exit(int(sys.argv[2]))
"""

JOB = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29517",
}

CASES = {
    # the case once broken: one process that recorded an event, events on stderr
    "process-with-an-event": ({}, "event", False),
    # nothing happened, but a log file takes the INFO summary
    "process-logging-to-a-file": ({}, "none", True),
    # rank 0 of a job (no other rank comes: it waits for none), with an event of its own
    "rank-0-of-a-job": (JOB, "event", True),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("ending", ["ctrl-c", "3"])
def test_a_guarded_program_ends_as_the_unguarded_one(
    tmp_path: Path, case: str, ending: str
) -> None:
    extra, what, to_file = CASES[case]
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    log = tmp_path / "events.jsonl"
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    env = subprocess_env(XDG_RUNTIME_DIR=str(run_dir), **extra)
    guarded_env = dict(env, ATTNGUARD="1", ATTNGUARD_LOG_FORMAT="json")
    if to_file:
        guarded_env["ATTNGUARD_LOG"] = str(log)
    ends = {}
    for name, run_env in (("unguarded", env), ("guarded", guarded_env)):
        res = subprocess.run(
            [PY, str(script), what, ending],
            env=run_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        ends[name] = res.returncode
        out = res.stderr
    want = -signal.SIGINT if ending == "ctrl-c" and sys.platform != "win32" else 3
    assert ends == {"unguarded": want, "guarded": want}, out[-2000:]
    lines = log.read_text().splitlines() if to_file else out.splitlines()
    summaries = [
        r
        for r in map(json.loads, (x for x in lines if x.startswith("{")))
        if r["event"] == "summary"
    ]
    assert len(summaries) == 1, out[-2000:]
    assert summaries[0]["applied"] == (1 if what == "event" else 0)
