"""Safe on a shared machine: another user can neither write into a job's summary nor make
attnguard write into the victim's files (issue 22, items 1, 2 and 8; issue 20, item 5).

Cross-user cases run the attacker's steps as a second local user, created for the test and
removed after it (they need root, as CI has; elsewhere they are skipped and the same-user
imitations below still run). The victim is the test's own user. Jobs are real processes started
with the variables torchrun gives its workers, reading their settings from the environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import PY, subprocess_env

import attnguard
from attnguard import summary

# Two ranks that each record changes and end; rank 0 ends after rank 1 did its work (what a
# job's collectives see to), with no process group: the ranks meet through files at exit.
WORKER = """
import os, sys, time
import attnguard
from attnguard import events

attnguard.is_active()  # under the start-up hook: activates at the first use of the API

rank = int(os.environ["RANK"])
for _ in range(rank + 2):
    events.emit("device_map_rewritten", site="transformers.load", reason_code="device_map_per_rank",
                reason="one replica per rank", applied=True)
flag = os.environ["WORKED_FLAG"]
if rank == 1:
    open(flag, "w").close()
else:
    while not os.path.exists(flag):
        time.sleep(0.01)
"""

SECRET_NOTES = "the victim's own notes\n"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def job_env(log_dir: Path, port: int, rank: int, **extra: str) -> dict[str, str]:
    return subprocess_env(
        ATTNGUARD="1",
        ATTNGUARD_LOG=str(log_dir / "events-{rank}.jsonl"),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **extra,
    )


def run_job(log_dir: Path, port: int, work: Path, rank1_guarded: bool = True) -> None:
    script = work / "worker.py"
    script.write_text(WORKER)
    procs = []
    for rank in range(2):
        env = job_env(log_dir, port, rank, WORKED_FLAG=str(work / "rank1-worked"))
        if rank == 1 and not rank1_guarded:
            env["ATTNGUARD"] = "0"
        procs.append(
            subprocess.Popen(
                [PY, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode(errors="replace")[-3000:]


def records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summaries(path: Path) -> list[dict[str, Any]]:
    return [r for r in records(path) if r["event"] == "summary"]


def rendezvous_names(log_dir: Path, port: int, uid: int) -> list[str]:
    """Where the victim's job meets: the name an attacker predicts from the job's identity
    (and, for the code before this fix, the name it used then: without the user)."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    names = []
    if hasattr(summary, "job_dir_path"):
        names.append(summary.job_dir_path(env, base=str(log_dir), uid=uid))
    ident = "\0".join(env.get(v, "") for v in summary.JOB_VARS)
    old = ".attnguard-job-" + hashlib.sha256(ident.encode()).hexdigest()[:16]
    names.append(str(log_dir / old))
    return names


# --- a second local user -------------------------------------------------------------------------


@pytest.fixture
def other_user() -> Iterator[tuple[int, int]]:
    """(uid, gid) of a throw-away local user; skipped unless the tests run as root."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("cross-user tests need root and useradd (CI runs as root)")
    import pwd

    name = f"agtest{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", name], check=True, capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


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


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may write to, sticky like /tmp."""
    path = Path(tempfile.mkdtemp(prefix="ag-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


FAKE_RECORD = {
    "applied": 0,
    "internal_errors": 999,
    "events": {"internal_error": 999},
    "reasons": {"internal_error:PWNED": 999},
    "keys": [{"event": "internal_error", "reason_code": "PWNED", "count": 999}],
}


def _plant(directory: str, mode: int, notes: Path, record: dict[str, Any] = FAKE_RECORD) -> None:
    """A forged rank record (dated ahead, so no run takes it for a stale one) and links to the
    victim's notes under the names a rank writes and announces with."""
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, mode)
    forged = os.path.join(directory, "rank-1.json")
    with open(forged, "w") as fh:
        json.dump(record, fh)
    future = os.path.getmtime(forged) + 3600
    os.utime(forged, (future, future))
    for name in ("announce-1", "rank-0.json"):
        os.symlink(str(notes), os.path.join(directory, name))


def _assert_no_forged_counts(log_dir: Path) -> None:
    for path in log_dir.glob("events-*.jsonl"):
        assert "PWNED" not in path.read_text(), path
        for rec in records(path):
            assert not rec.get("internal_errors"), rec
            assert "internal_error" not in (rec.get("events") or {}), rec


# --- item 1: the job rendezvous directory ------------------------------------------------------


def test_another_user_cannot_forge_or_redirect_a_jobs_summary(
    other_user: tuple[int, int], shared_dir: Path, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text(SECRET_NOTES)
    port = _free_port()
    names = rendezvous_names(shared_dir, port, uid=os.geteuid())

    def attack() -> None:
        for name in names:
            _plant(name, 0o1777, notes)

    as_user(other_user, attack)
    run_job(shared_dir, port, tmp_path)

    assert notes.read_text() == SECRET_NOTES  # never truncated, never overwritten
    _assert_no_forged_counts(shared_dir)
    # no job summary through a directory someone else owns; each rank says why in its own
    (own0,) = summaries(shared_dir / "events-0.jsonl")
    (own1,) = summaries(shared_dir / "events-1.jsonl")
    assert own0["site"] == own1["site"] == "process"
    assert (own0["applied"], own1["applied"]) == (2, 3)
    for own in (own0, own1):
        assert "no job-wide summary: the rendezvous directory is not safe to use" in own["reason"]
        assert f"belongs to another user (uid {other_user[0]})" in own["reason"]


def test_a_rendezvous_directory_others_can_write_is_not_used(tmp_path: Path) -> None:
    """The same-user imitation of the case above (any user can run it): the directory the job
    would use already exists with a mode that lets others write (and a forged record in it)."""
    log_dir, notes = tmp_path / "logs", tmp_path / "notes.txt"
    log_dir.mkdir()
    notes.write_text(SECRET_NOTES)
    port = _free_port()
    for name in rendezvous_names(log_dir, port, uid=os.geteuid()):
        _plant(name, 0o777, notes)
    run_job(log_dir, port, tmp_path)
    assert notes.read_text() == SECRET_NOTES
    _assert_no_forged_counts(log_dir)
    (own0,) = summaries(log_dir / "events-0.jsonl")
    assert own0["site"] == "process" and own0["applied"] == 2
    assert "can be written by other users (mode 0o777)" in own0["reason"]


def test_a_malformed_rank_record_is_named_not_fatal(tmp_path: Path) -> None:
    """A record that is not what attnguard writes (left by anything that can write the user's
    own directory) is left out and named in the job summary, which still comes."""
    port = _free_port()
    notes = tmp_path / "notes.txt"
    notes.write_text(SECRET_NOTES)
    malformed = {**FAKE_RECORD, "events": {"backend_fallback": "many"}}
    for name in rendezvous_names(tmp_path, port, uid=os.geteuid()):
        _plant(name, 0o700, notes, malformed)
    run_job(tmp_path, port, tmp_path, rank1_guarded=False)
    assert notes.read_text() == SECRET_NOTES
    (job,) = summaries(tmp_path / "events-0.jsonl")
    assert job["site"] == "job" and job["ranks"] == [0] and job["applied"] == 2
    assert job["ignored_records"] == ["rank 1: not a record of this rank"]
    assert "1 rank record(s) ignored: rank 1: not a record of this rank" in job["reason"]
    _assert_no_forged_counts(tmp_path)


# --- item 2: the log file ------------------------------------------------------------------------

ACTIVATE = "import attnguard; print('ran', attnguard.settings().enabled)"


def _run_guarded(log: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", ACTIVATE],
        env=subprocess_env(ATTNGUARD="1", ATTNGUARD_LOG=log, ATTNGUARD_LOG_FORMAT="json"),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_another_users_link_in_a_shared_directory_is_not_followed(
    other_user: tuple[int, int], shared_dir: Path, tmp_path: Path
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text(SECRET_NOTES)
    as_user(other_user, lambda: os.symlink(str(notes), str(shared_dir / "ag-0.jsonl")))
    res = _run_guarded(str(shared_dir / "ag-{rank}.jsonl"))
    assert res.returncode == 0 and res.stdout == "ran False\n"  # the program runs, unguarded
    assert notes.read_text() == SECRET_NOTES
    assert "attnguard: invalid ATTNGUARD_LOG=" in res.stderr
    assert f"is a symbolic link that belongs to another user (uid {other_user[0]})" in res.stderr


def test_another_users_file_is_not_appended_to(
    other_user: tuple[int, int], shared_dir: Path
) -> None:
    planted = shared_dir / "ag-0.jsonl"
    as_user(other_user, lambda: (planted.write_text(""), planted.chmod(0o666)))
    res = _run_guarded(str(shared_dir / "ag-{rank}.jsonl"))
    assert res.returncode == 0 and res.stdout == "ran False\n"
    assert planted.read_text() == ""  # nothing of the victim's run went to the other user
    assert f"belongs to another user (uid {other_user[0]})" in res.stderr


def test_your_own_links_and_dev_stderr_still_work(tmp_path: Path) -> None:
    target = tmp_path / "real.jsonl"
    (tmp_path / "link.jsonl").symlink_to(target)
    res = _run_guarded(str(tmp_path / "link.jsonl"))
    assert res.stdout == "ran True\n", res.stderr
    assert [r["event"] for r in records(target)] == ["activated", "summary"]
    res = _run_guarded("/dev/stderr")
    assert res.stdout == "ran True\n"
    assert json.loads(res.stderr.splitlines()[0])["event"] == "activated"


# --- item 8 and issue 20 item 5: values checked before anything runs ------------------------------


# A command that uses attnguard: the start-up hook activates it (and opens the log) there.
GUARDED = "import attnguard; attnguard.is_active()"


def _attnguard_run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    marker = tmp_path / "command-ran"
    return subprocess.run(
        [PY, "-m", "attnguard", "run", "--", PY, "-c", f"{GUARDED}; open({str(marker)!r}, 'w')"],
        env=subprocess_env(**env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_run_refuses_a_log_path_the_child_could_not_open(tmp_path: Path) -> None:
    """/sys: the directory looks writable to root, yet no file can be created there. ``attnguard
    run`` opens the path as the guarded command would, so it refuses before starting it."""
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no /sys here")
    res = _attnguard_run(tmp_path, ATTNGUARD_LOG="/sys/kernel/ag-{rank}.jsonl")
    assert res.returncode == 2 and not (tmp_path / "command-ran").exists()
    assert res.stderr.startswith("attnguard: invalid ATTNGUARD_LOG='/sys/kernel/ag-{rank}.jsonl'")
    # and a good path starts the command, leaving no file of its own behind
    res = _attnguard_run(tmp_path, ATTNGUARD_LOG=str(tmp_path / "ev-{pid}.jsonl"))
    assert res.returncode == 0 and (tmp_path / "command-ran").exists(), res.stderr


def test_a_huge_value_is_named_and_cut_not_echoed(tmp_path: Path) -> None:
    huge = str(tmp_path / ("x" * 120_000))
    res = _attnguard_run(tmp_path, ATTNGUARD_LOG=huge)
    assert res.returncode == 2 and not (tmp_path / "command-ran").exists()
    assert res.stderr.startswith("attnguard: invalid ATTNGUARD_LOG=")
    assert f"({len(huge)} characters)" in res.stderr and len(res.stderr) < 2000
    with pytest.raises(ValueError) as err:
        attnguard.activate(mode="f" * 1_000_000)
    assert str(err.value).startswith("attnguard: invalid ATTNGUARD_MODE='ffff")
    assert "(1000000 characters)" in str(err.value) and len(str(err.value)) < 1000


def test_a_format_spec_that_makes_a_null_byte_names_the_variable(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        attnguard.activate(log=str(tmp_path / "ev-{rank:c}.jsonl"))
    assert str(err.value).startswith("attnguard: invalid ATTNGUARD_LOG=")
    assert "the path contains a null byte" in str(err.value)


def test_a_deep_log_path_is_a_clear_error_not_a_recursion_error(tmp_path: Path) -> None:
    deep = str(tmp_path) + "/a" * 3000 + "/ev.jsonl"
    with pytest.raises(ValueError) as err:
        attnguard.activate(log=deep)
    assert str(err.value).startswith("attnguard: invalid ATTNGUARD_LOG=")
    assert "the path is" in str(err.value) and "characters long" in str(err.value)
    # a deep path within the limits is created without recursion
    ok = str(tmp_path / "d") + "/a" * 800 + "/ev.jsonl"
    attnguard.activate(log=ok)
    attnguard.deactivate()
    assert os.path.exists(ok)


def test_summary_of_files_without_events_says_so_and_fails(tmp_path: Path) -> None:
    empty, code = tmp_path / "empty.jsonl", tmp_path / "train.py"
    empty.write_text("")
    code.write_text("import torch\nprint('hello')\n")
    for path in (empty, code):
        res = subprocess.run(
            [PY, "-m", "attnguard", "summary", str(path)],
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 1, path
        assert res.stdout.rstrip().endswith("no attnguard events found in these files")
        assert "nothing to change" not in res.stdout


def test_rendezvous_files_are_private_and_never_follow_links(tmp_path: Path) -> None:
    """docs/files.md's modes: the directory 0700, each record 0600 under a fresh name; a link
    planted at a record's name is replaced, its target left alone; a link is never read."""
    from attnguard import safefiles

    notes = tmp_path / "notes.txt"
    notes.write_text(SECRET_NOTES)
    old_umask = os.umask(0)
    try:
        with safefiles.PrivateDir(str(tmp_path / "job")) as d:
            os.symlink(notes, tmp_path / "job" / "rank-1.json")
            os.symlink(notes, tmp_path / "job" / "announce-1")
            d.write("rank-1.json", b"{}")
            assert (tmp_path / "job").stat().st_mode & 0o777 == 0o700
            assert (tmp_path / "job" / "rank-1.json").lstat().st_mode & 0o777 == 0o600
            assert d.read("rank-1.json", 100)[0] == b"{}"
            with pytest.raises(safefiles.UnsafeFile, match="symbolic link"):
                d.read("announce-1", 100)
            with pytest.raises(safefiles.UnsafeFile, match=r"\(at most 1\)"):
                d.read("rank-1.json", 1)
    finally:
        os.umask(old_umask)
    assert notes.read_text() == SECRET_NOTES


def test_run_leaves_a_fifo_log_to_its_reader(tmp_path: Path) -> None:
    """``attnguard run`` checks a FIFO without opening it: an open and close would hand the
    reader at the other end its end of file before the command wrote a line."""
    import threading

    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
    reader.start()
    res = _attnguard_run(tmp_path, ATTNGUARD_LOG=str(fifo))
    reader.join(timeout=120)
    assert res.returncode == 0, res.stderr
    assert b'"event": "activated"' in got[0]  # the command's lines, not an early end of file
