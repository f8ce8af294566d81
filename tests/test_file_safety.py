"""Safe on a shared machine: another user can neither write into a job's summary nor make
attnguard write into the victim's files.

Cross-user cases run the attacker's steps as a second local user, created for the test and
removed after it (they need root, as CI has; elsewhere they are skipped and the same-user
imitations below still run). The victim is the test's own user. Jobs are real processes started
with the variables torchrun gives its workers, reading their settings from the environment.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.files import SECRET_NOTES, as_user, private_run_dir, records
from helpers.processes import PY, free_port, subprocess_env

from attnguard.observability import summary

# Two ranks that each record changes and end; rank 0 ends after rank 1 did its work (what a
# job's collectives see to), with no process group: the ranks meet through files at exit.
WORKER = """
import os, sys, time
import attnguard
from attnguard.observability import events

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


def job_env(log_dir: Path, port: int, rank: int, **extra: str) -> dict[str, str]:
    env = {
        "ATTNGUARD": "1",
        "ATTNGUARD_LOG": str(log_dir / "events-{rank}.jsonl"),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return subprocess_env(**{**env, **extra})


def run_job(
    log_dir: Path, port: int, work: Path, rank1_guarded: bool = True, **extra: str
) -> list[str]:
    """Both ranks to their end; returns what each wrote on stderr."""
    script = work / "worker.py"
    script.write_text(WORKER)
    extra = {"XDG_RUNTIME_DIR": str(private_run_dir(work)), **extra}
    procs = []
    for rank in range(2):
        env = job_env(log_dir, port, rank, WORKED_FLAG=str(work / "rank1-worked"), **extra)
        if rank == 1 and not rank1_guarded:
            env["ATTNGUARD"] = "0"
        procs.append(
            subprocess.Popen(
                [PY, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        )
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode(errors="replace")[-3000:]
        errs.append(err.decode(errors="replace"))
    return errs


def meeting_place(log_dir: Path, port: int, work: Path) -> str:
    """The rendezvous directory of a job that run_job starts: asked of a child of this
    process, as the ranks are (their launcher is part of the name)."""
    env = job_env(log_dir, port, 1, ATTNGUARD="0", XDG_RUNTIME_DIR=str(private_run_dir(work)))
    code = "from attnguard.observability import summary; print(summary.job_dir_path())"
    res = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout.strip()


def summaries(path: Path) -> list[dict[str, Any]]:
    return [r for r in records(path) if r["event"] == "summary"]


def predictable_names(log_dir: Path, tmp: Path, port: int, uid: int) -> list[str]:
    """Every name another user can predict for a job's rendezvous from its identity (no secret:
    ports and addresses are seen by all): what attnguard used beside the log file, with the
    user and without, and the shared temp directory's attnguard-<uid>."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ident = "\0".join(env.get(v, "") for v in summary.JOB_VARS)
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return [
        str(log_dir / f".attnguard-job-{uid}-{digest}"),
        str(log_dir / f".attnguard-job-{digest}"),
        str(tmp / f"attnguard-{uid}"),
    ]


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


def test_another_user_can_neither_forge_nor_take_a_jobs_summary(
    other_user: tuple[int, int], shared_dir: Path, tmp_path: Path
) -> None:
    """Another user plants a forged record and links to the victim's notes under every name
    they can predict for the job's rendezvous, and so took the job's summary
    away. The ranks of a job on one host meet in a directory only the
    victim can write to, under a name that needs their launcher as well: the summary is whole,
    nothing is forged, nothing of the victim's is touched."""
    notes = tmp_path / "notes.txt"
    notes.write_text(SECRET_NOTES)
    port = free_port()
    names = predictable_names(shared_dir, shared_dir, port, uid=os.geteuid())

    def attack() -> None:
        for name in names:
            _plant(name, 0o1777, notes)

    as_user(other_user, attack)
    run_job(shared_dir, port, tmp_path, TMPDIR=str(shared_dir))

    assert notes.read_text() == SECRET_NOTES  # never truncated, never overwritten
    _assert_no_forged_counts(shared_dir)
    (job,) = summaries(shared_dir / "events-0.jsonl")
    assert job["site"] == "job" and job["gathered_by"] == "files"
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == [] and job["ignored_records"] == []
    assert job["applied"] == 2 + 3
    assert summaries(shared_dir / "events-1.jsonl") == []  # rank 1 reported to rank 0


def test_another_user_taking_the_temp_directory_name_costs_no_job_summary(
    other_user: tuple[int, int], shared_dir: Path, tmp_path: Path
) -> None:
    """With no log file the ranks met in $TMPDIR/attnguard-<uid>; another
    user who made that directory first left every rank with its own summary. The ranks now meet
    where only the victim can write (here the cache directory in their home: no
    $XDG_RUNTIME_DIR), and the summary of the whole job comes."""
    uid = os.geteuid()
    taken = shared_dir / f"attnguard-{uid}"
    as_user(other_user, lambda: (taken.mkdir(), taken.chmod(0o777)))
    errs = run_job(
        shared_dir,
        free_port(),
        tmp_path,
        ATTNGUARD_LOG="stderr",
        ATTNGUARD_LOG_FORMAT="json",
        TMPDIR=str(shared_dir),
        XDG_RUNTIME_DIR="",
        XDG_CACHE_HOME=str(tmp_path / "cache"),
    )
    lines = [json.loads(x) for x in errs[0].splitlines() if x.startswith("{")]
    (job,) = [r for r in lines if r["event"] == "summary"]
    assert job["site"] == "job" and job["ranks"] == [0, 1] and job["applied"] == 2 + 3
    assert not any(
        r["event"] == "summary"
        for x in errs[1].splitlines()
        if x.startswith("{")
        for r in [json.loads(x)]
    )
    assert os.listdir(taken) == []  # nothing of the job's went to the other user's directory
    assert (tmp_path / "cache" / "attnguard" / "run").stat().st_mode & 0o777 == 0o700


def test_the_private_directory_is_the_first_nobody_else_can_take(tmp_path: Path) -> None:
    """docs/files.md's order: the login session's runtime directory, else the cache directory
    in your home, else (neither usable) $TMPDIR/attnguard-<uid>."""
    from attnguard import safefiles

    run, cache, tmp = tmp_path / "run", tmp_path / "cache", tmp_path / "tmp"
    run.mkdir(mode=0o700)
    tmp.mkdir()
    (tmp_path / "a-file").write_text("")
    uid = os.geteuid()
    for env, want in (
        ({"XDG_RUNTIME_DIR": str(run)}, run / "attnguard"),
        ({"XDG_RUNTIME_DIR": "", "XDG_CACHE_HOME": str(cache)}, cache / "attnguard" / "run"),
        (
            {"XDG_CACHE_HOME": str(tmp_path / "a-file" / "cache"), "TMPDIR": str(tmp)},
            tmp / f"attnguard-{uid}",
        ),
    ):
        with safefiles.private_dir(env) as own:
            assert own.path == str(want)
        assert want.stat().st_mode & 0o777 == 0o700


def test_a_rendezvous_directory_others_can_write_is_not_used(tmp_path: Path) -> None:
    """The same-user imitation of a directory taken first (any user can run it): the directory
    the job would use already exists with a mode that lets others write (and a forged record in
    it). It is not used, and each rank says why."""
    log_dir, notes = tmp_path / "logs", tmp_path / "notes.txt"
    log_dir.mkdir()
    notes.write_text(SECRET_NOTES)
    port = free_port()
    _plant(meeting_place(log_dir, port, tmp_path), 0o777, notes)
    run_job(log_dir, port, tmp_path)
    assert notes.read_text() == SECRET_NOTES
    _assert_no_forged_counts(log_dir)
    (own0,) = summaries(log_dir / "events-0.jsonl")
    assert own0["site"] == "process" and own0["applied"] == 2
    assert "can be written by other users (mode 0o777)" in own0["reason"]


@pytest.mark.parametrize(
    ("record", "why"),
    [
        ({**FAKE_RECORD, "events": {"backend_fallback": "many"}}, "not a record of this rank"),
        # "²" is a digit to str.isdigit(), not to int()
        (
            {
                "v": 3,
                "rank": 1,
                "proc": "0123456789abcdef",
                "phase": "exit",
                "keys": [{"event": "internal_error", "count": 999, "ranks": {"²": 999}}],
            },
            "a per-rank key is not a rank",
        ),
    ],
)
def test_a_malformed_rank_record_is_named_not_fatal(
    tmp_path: Path, record: dict[str, Any], why: str
) -> None:
    """A record that is not what attnguard writes (left by anything that can write the user's
    own directory, or posted in the store) is left out and named in the job summary, which
    still comes."""
    port = free_port()
    notes = tmp_path / "notes.txt"
    notes.write_text(SECRET_NOTES)
    _plant(meeting_place(tmp_path, port, tmp_path), 0o700, notes, record)
    run_job(tmp_path, port, tmp_path, rank1_guarded=False)
    assert notes.read_text() == SECRET_NOTES
    (job,) = summaries(tmp_path / "events-0.jsonl")
    assert job["site"] == "job" and job["ranks"] == [0] and job["applied"] == 2
    assert job["ignored_records"] == [f"rank 1: {why}"]
    assert f"1 rank record(s) ignored: rank 1: {why}" in job["reason"]
    _assert_no_forged_counts(tmp_path)


# --- two jobs alike in every variable ------------------------------------------------------------

# torchrun's agent, standing in: it starts the ranks and waits for them (reaping each as it ends)
LAUNCHER = """
import os, subprocess, sys
for rank in range(2):
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), ATTNGUARD="1")
    cmd = [sys.executable, sys.argv[1]]
    if rank == 1 and os.environ.get("WRAP"):  # a wrapper script of the rank's, as with
        cmd = ["sh", "-c", '"$0" "$1"; exit $?', *cmd]  # torchrun --no-python: a child of it
    subprocess.Popen(cmd, env=env)
codes = [os.waitstatus_to_exitcode(os.wait()[1]) for _ in range(2)]
sys.exit(max(codes))
"""

# A rank: records its changes, says it is ready, ends when the test lets it.
RANK = """
import os, time
import attnguard
from attnguard.observability import events

attnguard.is_active()  # under the start-up hook, using the API activates

job, rank, flags = os.environ["JOB"], int(os.environ["RANK"]), os.environ["FLAGS"]
for _ in range(int(os.environ["CHANGES"].split(",")[rank])):
    events.emit("device_map_rewritten", site="transformers.load", reason_code="device_map_per_rank",
                reason="one replica per rank", applied=True)
ready = os.path.join(flags, f"ready-{job}-{rank}")
with open(ready + ".tmp", "w") as fh:
    fh.write(str(os.getpid()))
os.replace(ready + ".tmp", ready)
while not os.path.exists(os.path.join(flags, f"go-{job}-{rank}")):
    time.sleep(0.01)
"""


def _ended(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state == "Z"


def _wait_for(what: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def start_jobs(tmp_path: Path, changes: dict[str, tuple[int, int]], **extra: str) -> Any:
    """One stand-in launcher per job, each starting two ranks that log with {pid} into one
    directory (returned with the launchers); every job alike in every variable."""
    logs, flags = tmp_path / "logs", tmp_path / "flags"
    logs.mkdir()
    flags.mkdir()
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "rank.py").write_text(RANK)
    env = job_env(
        logs,
        free_port(),
        0,
        ATTNGUARD="0",  # the launcher is not guarded (nor is torchrun's): its ranks are
        ATTNGUARD_LOG=str(logs / "ag-{pid}.jsonl"),
        FLAGS=str(flags),
        XDG_RUNTIME_DIR=str(private_run_dir(tmp_path)),
        **extra,
    )
    del env["RANK"], env["LOCAL_RANK"]  # the launcher's own: it is no rank
    launchers = [
        subprocess.Popen(
            [PY, str(tmp_path / "launcher.py"), str(tmp_path / "rank.py")],
            env=dict(env, JOB=job, CHANGES=",".join(map(str, changes[job]))),
        )
        for job in changes
    ]
    return logs, flags, launchers


def end_jobs(
    flags: Path, launchers: list[Any], order: list[tuple[str, int]]
) -> dict[tuple[str, int], int]:
    """Let the ranks end one by one in ``order``, each after the one before has ended; returns
    every rank's pid."""
    try:
        ready = [flags / f"ready-{job}-{rank}" for job, rank in order]
        _wait_for(lambda: all(p.exists() for p in ready))
        pid = {(p.name[6], int(p.name[8])): int(p.read_text()) for p in ready}
        for job, rank in order:
            (flags / f"go-{job}-{rank}").touch()
            _wait_for(lambda job=job, rank=rank: _ended(pid[job, rank]))
        assert [p.wait(timeout=60) for p in launchers] == [0] * len(launchers)
    finally:
        for p in launchers:
            p.kill()
    return pid


def assert_job_summary(logs: Path, pid: dict[tuple[str, int], int], job: str, applied: int) -> None:
    """Rank 0's summary of job ``job``: every rank, its own rank 1's record."""
    (job_summary,) = summaries(logs / f"ag-{pid[job, 0]}.jsonl")
    (rank1_activated,) = [
        r for r in records(logs / f"ag-{pid[job, 1]}.jsonl") if r["event"] == "activated"
    ]
    assert job_summary["site"] == "job", job_summary["reason"]
    assert job_summary["ranks"] == [0, 1] and job_summary["missing_ranks"] == []
    assert job_summary["applied"] == applied, job_summary["reason"]
    assert job_summary["rank_procs"]["1"] == rank1_activated["proc"]  # its own rank 1's


def test_two_jobs_alike_in_every_variable_keep_their_own_counts(tmp_path: Path) -> None:
    """Two jobs with one launcher identity (no run id, 127.0.0.1 and one port, world 2) log
    with {pid} into one directory, no process group at exit; each has its own launcher. The
    ranks end in the order that let one job's rank 0 take the other's record (A1, B1, A0, B0):
    job A said 4 changes (it made 2), job B that its rank 1 "announced no event". Each job's
    summary counts its own ranks now, every one of them."""
    changes = {"A": (1, 1), "B": (1, 3)}
    logs, flags, launchers = start_jobs(tmp_path, changes)
    pid = end_jobs(flags, launchers, [("A", 1), ("B", 1), ("A", 0), ("B", 0)])
    for job, (n0, n1) in changes.items():
        assert_job_summary(logs, pid, job, n0 + n1)


def test_a_rank_started_through_a_wrapper_script_meets_its_job(tmp_path: Path) -> None:
    """The launcher is the ranks' parent, looking through a wrapper process of one rank (a
    shell started with the rank's own variables): rank 1 here is a child of `sh -c`."""
    logs, flags, launchers = start_jobs(tmp_path, {"A": (1, 2)}, WRAP="1")
    pid = end_jobs(flags, launchers, [("A", 1), ("A", 0)])
    assert_job_summary(logs, pid, "A", 1 + 2)
