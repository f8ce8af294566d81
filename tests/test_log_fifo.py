"""A FIFO (or device) as the log path: opening it never waits, a reader that stops reading never
stops the program, and another user's FIFO or device is treated like another user's file.

Fresh interpreters (the open happens at activation); each has a subprocess timeout, and the
programs arm faulthandler, so a hang is a failure that shows where. Cross-user cases need root
(the second local user: tests/conftest.py).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

from helpers.files import as_user, attnguard_run, went_around
from helpers.processes import PY, ended, start_program, subprocess_env

HANG_S = 60  # every program here ends in seconds

PROGRAM = """
import faulthandler, os, sys, time
faulthandler.dump_traceback_later({hang}, exit=True)
import attnguard
from attnguard.observability import events

print("ran", attnguard.is_active(), flush=True)
flag = os.environ.get("AG_WAIT_FOR")
if flag:  # wait for the test's reader before the next lines
    while not os.path.exists(flag):
        time.sleep(0.02)
for i in range(int(os.environ.get("AG_EVENTS", "1"))):
    events.emit("backend_fallback", site=f"site-{{i}}", reason_code="package_missing",
                reason="flash-attn is not installed " + "x" * 300, applied=True)
"""


def run(tmp_path: Path, log: str, **env: str) -> subprocess.Popen[str]:
    code = PROGRAM.format(hang=HANG_S)
    return start_program(
        tmp_path / "program.py", code, ATTNGUARD_LOG=log, ATTNGUARD_LOG_FORMAT="json", **env
    )


def test_a_fifo_nobody_reads_never_blocks_activation(tmp_path: Path) -> None:
    """Your own FIFO with no reader (a log shipper not started yet): the open at activation used
    to block for ever. The program runs as unguarded, guarded, and says at its end how many
    lines no reader took."""
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    code, out, err = ended(run(tmp_path, str(fifo)), HANG_S)
    assert code == 0 and out == "ran True\n", err
    assert err == (
        f"attnguard WARNING: ATTNGUARD_LOG: no process opened the FIFO {fifo} for reading; 3 "
        "event line(s) of this process were not written\n"
    )


def test_under_the_startup_hook_the_first_import_returns(tmp_path: Path) -> None:
    """``ATTNGUARD=1``: the hook activates at the first ``import transformers``, which opened the
    FIFO and never returned."""
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    code = "import faulthandler; faulthandler.dump_traceback_later(100, exit=True)\n"
    code += "import transformers, attnguard; print('ran', attnguard.is_active())\n"
    res = subprocess.run(
        [PY, "-c", code],
        env=subprocess_env(ATTNGUARD="1", ATTNGUARD_LOG=str(fifo)),
        capture_output=True,
        text=True,
        timeout=160,
    )
    assert "Timeout (" not in res.stderr, res.stderr[-4000:]
    assert res.returncode == 0 and res.stdout == "ran True\n", res.stderr[-3000:]


class Reader:
    """A reader of ``fifo`` from now on (opened without waiting for a writer) that collects
    everything written until ``proc`` has ended."""

    def __init__(self, fifo: Path) -> None:
        self.fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)

    def read_until_end(self, proc: subprocess.Popen[str]) -> list[dict]:
        data = b""
        deadline = time.monotonic() + HANG_S
        try:
            while time.monotonic() < deadline:
                done = proc.poll() is not None
                try:
                    chunk = os.read(self.fd, 1 << 16)
                except BlockingIOError:
                    chunk = None
                data += chunk or b""
                if done and not chunk:
                    break
                if not chunk:
                    time.sleep(0.02)
        finally:
            os.close(self.fd)
        return [json.loads(line) for line in data.decode().splitlines()]


def test_a_reader_that_comes_later_gets_every_line_in_order(tmp_path: Path) -> None:
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    flag = tmp_path / "reader-is-there"
    proc = run(tmp_path, str(fifo), AG_WAIT_FOR=str(flag), AG_EVENTS="2")
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ran True\n"  # activated, its first line held
    reader = Reader(fifo)
    flag.touch()
    lines = reader.read_until_end(proc)
    code, _, err = ended(proc, HANG_S)
    assert code == 0 and err == "", err
    events = [e["event"] for e in lines]
    assert events == ["activated", "backend_fallback", "backend_fallback", "summary"]
    assert lines[-1]["applied"] == 2


def test_a_reader_that_stops_reading_does_not_stop_the_program(tmp_path: Path) -> None:
    """The reader opens the FIFO and never reads: the pipe fills (over 64 KiB of lines) and a
    write that gets no room for a while gives the file up, as a write error would: said once on
    stderr, which gets the rest of the warnings and the summary."""
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a reader that takes nothing
    try:
        code, out, err = ended(run(tmp_path, str(fifo), AG_EVENTS="400"), HANG_S)
    finally:
        os.close(held)
    assert code == 0 and out == "ran True\n", err
    said, *rest = err.splitlines()
    assert said.startswith(f"attnguard WARNING: ATTNGUARD_LOG: cannot write {fifo}: ETIMEDOUT")
    assert json.loads(rest[-1])["event"] == "summary"


# --- another user's FIFO or device --------------------------------------------------------------


def _eavesdrop(user: tuple[int, int], fifo: Path, heard: Path, stop: Path) -> int:
    """As ``user``: keep ``fifo`` open for reading until ``stop`` exists, writing what came to
    ``heard``. Returns the child's pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(user[1])
            os.setuid(user[0])
            fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            data = b""
            deadline = time.monotonic() + HANG_S
            while not stop.exists() and time.monotonic() < deadline:
                try:
                    data += os.read(fd, 1 << 16)
                except BlockingIOError:
                    pass
                time.sleep(0.02)
            heard.write_bytes(data)
            code = 0
        finally:
            os._exit(code)
    return pid


def test_another_users_fifo_is_treated_like_their_file(
    other_user: tuple[int, int], shared_dir: Path, tmp_path: Path
) -> None:
    """``mkfifo -m 666`` at your log path in a shared directory, by another user who reads it:
    they got your events (or, with no reader, your job hung). Now the FIFO is not opened; your
    events go to a fresh file of yours beside it, and one event says why."""
    planted = shared_dir / "ag-0.jsonl"
    as_user(other_user, lambda: os.mkfifo(planted, 0o666))
    planted.chmod(0o666)  # whatever the other user's umask was
    heard, stop = shared_dir / "heard", shared_dir / "stop"
    spy = _eavesdrop(other_user, planted, heard, stop)
    try:
        time.sleep(0.5)  # the reader is there
        res = subprocess.run(
            [PY, "-c", "import attnguard; print('ran', attnguard.settings().enabled)"],
            env=subprocess_env(
                ATTNGUARD="1",
                ATTNGUARD_LOG=str(shared_dir / "ag-{rank}.jsonl"),
                ATTNGUARD_LOG_FORMAT="json",
            ),
            capture_output=True,
            text=True,
            timeout=HANG_S,
        )
    finally:
        stop.touch()
        os.waitpid(spy, 0)
    assert heard.read_bytes() == b""  # nothing of the victim's run reached the other user
    assert f"is a FIFO that belongs to another user (uid {other_user[0]})" in res.stderr
    went_around(res, planted, shared_dir)


def test_another_users_fifo_with_no_reader_or_device_does_not_hang_or_get_lines(
    other_user: tuple[int, int], shared_dir: Path, tmp_path: Path
) -> None:
    """No reader (the hang), and a character device node of theirs (root makes one here, as the
    other user could have been given one): both gone around, and ``attnguard run`` starts the
    command where the FIFO is not even writable to you."""
    fifo = shared_dir / "ag-0.jsonl"
    as_user(other_user, lambda: os.mkfifo(fifo, 0o600))
    res = subprocess.run(
        [PY, "-c", "import attnguard; print('ran', attnguard.settings().enabled)"],
        env=subprocess_env(ATTNGUARD="1", ATTNGUARD_LOG=str(fifo), ATTNGUARD_LOG_FORMAT="json"),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    used = went_around(res, fifo, shared_dir)
    used.unlink()
    run = attnguard_run(tmp_path, ATTNGUARD_LOG=str(fifo))
    assert run.returncode == 0 and (tmp_path / "command-ran").exists(), run.stderr
    device = shared_dir / "dev.jsonl"
    os.mknod(device, 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # a /dev/null twin
    os.chown(device, *other_user)
    res = subprocess.run(
        [PY, "-c", "import attnguard; print('ran', attnguard.settings().enabled)"],
        env=subprocess_env(ATTNGUARD="1", ATTNGUARD_LOG=str(device), ATTNGUARD_LOG_FORMAT="json"),
        capture_output=True,
        text=True,
        timeout=HANG_S,
    )
    assert f"is a character device that belongs to another user (uid {other_user[0]})" in (
        res.stderr
    )
    went_around(res, device, shared_dir)


def test_your_own_fifo_with_a_reader_still_gets_the_lines(tmp_path: Path) -> None:
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    reader = Reader(fifo)
    proc = run(tmp_path, str(fifo))
    lines = reader.read_until_end(proc)
    code, _, err = ended(proc, HANG_S)
    assert code == 0 and err == "", err
    assert [e["event"] for e in lines] == ["activated", "backend_fallback", "summary"]
