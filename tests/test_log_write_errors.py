"""A log file that cannot be written any more (a full disk, a file-size limit, a FIFO whose reader
left): one line on stderr says so (path, errno), the file holds whole JSON lines only, and from
then on the warnings, errors and the exit summary reach stderr.

Fresh interpreters, each with a subprocess timeout and faulthandler armed. The file-size limit
(RLIMIT_FSIZE) stands in for a full disk: a write that crosses it is cut short, and the next one
fails with EFBIG (SIGXFSZ ignored in the child, as a full disk's ENOSPC kills nobody either).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from helpers.processes import ended, start_program

HANG_S = 60

# N events (each its own site: each is said), then, with AG_WAIT_FOR, wait for that file and
# emit M more; the exit summary follows.
PROGRAM = """
import faulthandler, os, resource, signal, sys, time
faulthandler.dump_traceback_later({hang}, exit=True)
limit = int(os.environ.get("AG_FSIZE", "0"))
if limit:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
import attnguard
from attnguard.observability import events

def burst(n, first):
    for i in range(first, first + n):
        events.emit("backend_fallback", site=f"site-{{i}}", reason_code="package_missing",
                    reason="flash-attn is not installed " + "x" * 300, applied=True)

n, m = int(os.environ.get("AG_EVENTS", "1")), int(os.environ.get("AG_MORE", "0"))
burst(n, 0)
flag = os.environ.get("AG_WAIT_FOR")
if flag:
    print("waiting", flush=True)
    while not os.path.exists(flag):
        time.sleep(0.02)
burst(m, n)
print("ran", attnguard.is_active(), flush=True)
"""


def start(tmp_path: Path, log: str, **env: str) -> subprocess.Popen[str]:
    code = PROGRAM.format(hang=HANG_S)
    return start_program(
        tmp_path / "program.py", code, ATTNGUARD_LOG=log, ATTNGUARD_LOG_FORMAT="json", **env
    )


def stderr_story(err: str) -> tuple[str, list[dict]]:
    """(the one line about the log file, the JSON events on stderr after it)."""
    lines = err.splitlines()
    said = [line for line in lines if "ATTNGUARD_LOG: cannot write" in line]
    assert len(said) == 1, err[-3000:]
    after = lines[lines.index(said[0]) + 1 :]
    return said[0], [json.loads(line) for line in after]


def whole_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), data[-200:]
    return [json.loads(line) for line in data.decode().splitlines()]


def test_a_file_size_limit_keeps_whole_lines_and_the_summary_reaches_stderr(
    tmp_path: Path,
) -> None:
    log = tmp_path / "events.jsonl"
    limit = 8000  # about 12 of 101 lines fit: the 13th is cut by the limit
    code, out, err = ended(start(tmp_path, str(log), AG_FSIZE=str(limit), AG_EVENTS="100"), HANG_S)
    assert code == 0 and out == "ran True\n", err
    said, after = stderr_story(err)
    assert said == (
        f"attnguard WARNING: ATTNGUARD_LOG: cannot write {log}: EFBIG (File too large); the log "
        "file is given up; from now on this process's warnings, errors and exit summary go to "
        "stderr"
    )
    written = whole_lines(log)  # no half line at the end
    assert 0 < len(written) < 101 and log.stat().st_size <= limit
    lost = {e["site"] for e in after if e["event"] == "backend_fallback"}
    kept = {e["site"] for e in written if e["event"] == "backend_fallback"}
    assert kept | lost == {f"site-{i}" for i in range(100)} and not kept & lost
    assert after[-1]["event"] == "summary" and after[-1]["applied"] == 100


def test_a_fifo_whose_reader_leaves_says_so_and_keeps_the_rest_on_stderr(tmp_path: Path) -> None:
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    flag = tmp_path / "reader-left"
    proc = start(tmp_path, str(fifo), AG_EVENTS="3", AG_MORE="5", AG_WAIT_FOR=str(flag))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "waiting\n"
        data, deadline = b"", time.monotonic() + HANG_S
        while data.count(b"\n") < 4 and time.monotonic() < deadline:  # activated + 3 events
            try:
                data += os.read(reader, 1 << 16)
            except BlockingIOError:
                time.sleep(0.02)
    finally:
        os.close(reader)  # the log shipper goes away
    flag.touch()
    code, out, err = ended(proc, HANG_S)
    assert code == 0 and out == "ran True\n", err
    got = [json.loads(line) for line in data.decode().splitlines()]
    assert [e["event"] for e in got] == ["activated"] + ["backend_fallback"] * 3
    said, after = stderr_story(err)
    assert said.startswith(f"attnguard WARNING: ATTNGUARD_LOG: cannot write {fifo}: EPIPE")
    assert [e["site"] for e in after if e["event"] == "backend_fallback"] == [
        f"site-{i}" for i in range(3, 8)
    ]
    assert after[-1]["event"] == "summary" and after[-1]["applied"] == 8


def test_beside_stderr_only_what_stderr_does_not_show_is_added(tmp_path: Path) -> None:
    """ATTNGUARD_LOG=stderr,<file>: stderr shows the warnings already; once the file is given up
    nothing is said twice there."""
    log = tmp_path / "events.jsonl"
    code, out, err = ended(
        start(tmp_path, f"stderr,{log}", AG_FSIZE="3000", AG_EVENTS="10"), HANG_S
    )
    assert code == 0 and out == "ran True\n", err
    said, after = stderr_story(err)
    before = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    sites = [e["site"] for e in before if e["event"] == "backend_fallback"]
    assert sites == [f"site-{i}" for i in range(10)]  # each once
    assert [e["event"] for e in before].count("summary") == 1
    assert after[-1]["event"] == "summary"
    whole_lines(log)
