"""Kernel decisions (ATTNGUARD_KERNEL=fastest; attnguard.selection.decisions, .cache) on disk
and across ranks, checked without a GPU: a cache file that is corrupt, of another GPU or version,
another user's, a link or too large is ignored with one ``observed`` event and never trusted; the
first decision written wins and later ones adopt it; ranks adopt the first posted decision, and
two ranks of a real torchrun job (gloo) that measured different winners, or run on other GPUs or
in deterministic mode, end with the same one; a child forked while a bucket is decided decides
its own; the cache directory setting; attnguard doctor lists the cache under the same rules.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from helpers.processes import PY, subprocess_env
from helpers.selection import (
    FP,
    ignored,
    said,
    write_file,
)

import attnguard
from attnguard.observability import events
from attnguard.selection import cache, decisions
from attnguard.selection.buckets import REQUESTED

# --- the decisions on disk and across ranks -------------------------------------------------------


def test_a_decision_written_first_wins_and_reads_back(disk):
    first = decisions.Decision("sdpa", {"sdpa": "1.5x"}, {"sdpa": {"ms": 1.0}})
    second = decisions.Decision(REQUESTED, {REQUESTED: "kept"})
    assert disk.cache.write_first(disk.call, first).winner == "sdpa"
    assert disk.cache.write_first(disk.call, second).winner == "sdpa"  # adopts the first
    assert disk.cache.read(disk.call).as_json() == first.as_json()
    assert oct(os.stat(disk.dir).st_mode & 0o777) == "0o700"
    assert oct(os.stat(disk.path).st_mode & 0o777) == "0o600"
    assert not ignored(disk.events)


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "unreadable"),
        ({"schema": 1, "fingerprint": {**FP[1], "gpu": "Other GPU"}}, "another GPU"),
        ({"schema": 1, "fingerprint": {**FP[1], "attnguard": "9"}}, "another GPU or with other"),
        ({"schema": 7}, "schema"),
        ("x" * (1 << 17), "at most 65536"),
        ("[" * 30000 + "]" * 30000, "unreadable"),  # nesting deeper than Python recurses
    ],
)
def test_bad_cache_files_are_ignored_with_one_event(disk, content, why):
    write_file(disk.path, content)
    for _ in range(3):
        assert disk.cache.read(disk.call) is None
    seen = ignored(disk.events)
    assert len(seen) == 1 and seen[0]["event"] == "observed", seen
    assert why in seen[0]["reason"]


def test_a_planted_link_is_not_followed(disk, tmp_path):
    target = tmp_path / "elsewhere.json"
    good = json.loads(cache.record(disk.call, decisions.Decision("sdpa"), FP[1]).decode())
    target.write_text(json.dumps(good))
    os.makedirs(disk.dir, exist_ok=True)
    os.symlink(target, disk.path)
    assert disk.cache.read(disk.call) is None
    assert "symbolic link" in ignored(disk.events)[0]["reason"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_another_users_cache_file_is_not_trusted(disk):
    good = json.loads(cache.record(disk.call, decisions.Decision("sdpa"), FP[1]).decode())
    write_file(disk.path, good)
    os.chown(disk.path, 65534, 65534)  # nobody
    assert disk.cache.read(disk.call) is None
    assert "another user" in ignored(disk.events)[0]["reason"]


def test_ranks_adopt_the_first_posted_decision_from_the_store(stand_in, monkeypatch):
    store = torch.distributed.HashStore()
    monkeypatch.setattr(cache, "job_store", lambda: store)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert stand_in.serve(causal=True) == "sdpa"  # the first rank raced, and posted its winner
    decisions.reset()  # another rank: a process of its own, the same job store
    events.reset_counts()

    def kept(*args):
        return decisions.Decision(REQUESTED, {REQUESTED: "kept"}, {"requested": {"ms": 1.0}})

    monkeypatch.setattr(decisions, "_race", kept)
    assert stand_in.serve(causal=True) == "sdpa"
    assert said(stand_in.events)[-1]["source"] == "this job"


def test_several_ranks_without_a_group_never_race(stand_in, monkeypatch):
    """No process group to agree through: a race's winner could differ per rank, so none runs;
    a decision already cached on this node (the same file for every rank) is used."""

    def no_race(*a, **k):
        raise AssertionError("raced without a way to agree")

    monkeypatch.setattr(decisions, "_race", no_race)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert stand_in.serve(causal=True) == REQUESTED
    (ev,) = said(stand_in.events)
    assert ev["reason_code"] == "not_raced" and "no process group" in ev["reason"]
    decisions.reset()
    events.reset_counts()
    stand_in.disk_has("sdpa", causal=True)
    assert stand_in.serve(causal=True) == "sdpa"
    assert said(stand_in.events)[-1]["source"] == "disk cache"
    decisions.reset()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # ranks on several nodes: disks differ
    assert stand_in.serve(causal=True) == REQUESTED


_RANK_PROGRAM = r"""
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
import attnguard
from attnguard.selection import buckets, cache, decisions
from types import SimpleNamespace
cache.fingerprint = lambda version: ("e" * 16, {"gpu": "Test GPU"})
attnguard.activate(log="none")
rank = dist.get_rank()
# each rank measured another winner (as timing noise can make them); the job must agree
def fake_race(*args):
    import time
    time.sleep(0.2 * rank)
    winner = "sdpa" if rank == 1 else "requested"
    return decisions.Decision(winner, {winner: f"rank {rank}"}, {winner: {"ms": float(rank)}})
decisions._race = fake_race
cache.Disk.read = lambda self, call, folder=None: None
cache.Disk.write_first = lambda self, call, d: d
class T(SimpleNamespace):
    pass
q = T(shape=(4, 4096, 32, 128), dtype=torch.bfloat16, is_cuda=True, requires_grad=False,
      device=torch.device("cuda", 0))
call = buckets.describe("flash_attn_func", {"q": q, "k": q, "causal": True})
entry = SimpleNamespace(params=("q", "k", "causal"), name="flash_attn_func", original=None)
got = decisions.decide(entry, (q, q, True), {}, call, decisions.Options())
print(json.dumps({"rank": rank, "winner": got.winner, "source": got.source}))
dist.destroy_process_group()
"""


def test_two_ranks_of_a_job_agree_on_one_winner(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_PROGRAM)
    env = subprocess_env(OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert len(got) == 2
    assert got[0]["winner"] == got[1]["winner"] == "requested"  # rank 0 posted first
    assert {g["source"] for g in got} == {"measured", "this job"}


def test_the_cache_directory_setting_is_validated(monkeypatch, tmp_path):
    where = tmp_path / "decisions"
    assert attnguard.activate(log="none", kernel_cache=str(where)).kernel_cache == str(where)
    with pytest.raises(ValueError) as err:
        attnguard.activate(log="none", kernel_cache="relative/dir")
    text = str(err.value)
    assert "ATTNGUARD_KERNEL_CACHE" in text and "'relative/dir'" in text
    assert "not an absolute path" in text and "an absolute path of a directory" in text
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        attnguard.activate(log="none", kernel_cache=str(tmp_path / "file"))


def test_decisions_live_in_the_cache_directory_set(stand_in, tmp_path, monkeypatch):
    """ATTNGUARD_KERNEL_CACHE (a shared filesystem): the decision one job measured is the next
    job's (or another node's), under the same file rules; doctor lists it from there."""
    from attnguard import callguard

    shared = tmp_path / "shared" / "kernels"
    opts = callguard._selection_options(attnguard.configure(kernel_cache=str(shared)))
    assert stand_in.serve(opts, causal=True) == "sdpa"
    (folder,) = shared.iterdir()
    (record,) = folder.iterdir()
    assert folder.name == FP[0] and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert oct(record.stat().st_mode & 0o777) == "0o600"
    assert not list((tmp_path / "attnguard").glob("kernels/*/*.json"))  # not the default place
    decisions.reset()  # the next job
    events.reset_counts()
    monkeypatch.setattr(decisions, "_race", lambda *a: pytest.fail("raced again"))
    assert stand_in.serve(opts, causal=True) == "sdpa"
    assert said(stand_in.events)[-1]["source"] == "disk cache"
    env = subprocess_env(ATTNGUARD_KERNEL_CACHE=str(shared), XDG_CACHE_HOME=str(tmp_path / "x"))
    res = subprocess.run(
        [PY, "-m", "attnguard", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    listed = res.stdout.split("Kernel decisions cached on this machine", 1)[1]
    assert f"in {shared}" in listed and "Test GPU: flash_attn_func/bfloat16/128/32/8" in listed
    assert "-> sdpa (1.50x)" in listed


_FORK_PROGRAM = r"""
import os, sys, threading, time
from types import SimpleNamespace
import torch
import attnguard
from attnguard.selection import cache, decisions
attnguard.activate(log="none")
cache.fingerprint = lambda version: ("f" * 16, {"gpu": "Test GPU"})
deciding, release = threading.Event(), threading.Event()

def fake_race(entry, args, kwargs, call, *rest):
    if call.bucket[5]:  # the causal bucket: held until the parent lets it go
        deciding.set()
        release.wait(60)
    return decisions.Decision("requested", {"requested": "kept"})

decisions._race = fake_race
class T(SimpleNamespace):
    pass
def q(*shape):
    return T(shape=shape, dtype=torch.bfloat16, is_cuda=True, requires_grad=False,
             device=torch.device("cuda", 0))
entry = SimpleNamespace(name="flash_attn_func", params=("q", "k", "causal"), original=None,
                        site="flash_attn.flash_attn_func")
def serve(causal):
    return decisions.serve(entry, (q(2, 64, 4, 64), q(2, 64, 4, 64), causal), {},
                           decisions.Options(version="0"))
thread = threading.Thread(target=serve, args=(True,))
thread.start()
assert deciding.wait(60)
pid = os.fork()
if pid == 0:
    serve(False)  # a new bucket in the child, while the parent's thread still decides its own
    os._exit(0)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    status = "blocked"
release.set()
thread.join()
print("CHILD", status)
"""


def test_a_child_forked_while_a_bucket_is_decided_decides_its_own(tmp_path):
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [PY, "-c", _FORK_PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-2:] == ["CHILD", "0"], res.stdout


_RANKS_DIFFER = r"""
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
import attnguard
from attnguard.observability import events
from attnguard.selection import cache, decisions
from types import SimpleNamespace
case, rank = sys.argv[1], dist.get_rank()
gpu = "H100 SXM" if case == "gpus differ" and rank == 0 else "H100 PCIe"
cache.fingerprint = lambda version: (gpu.replace(" ", "")[:16], {"gpu": gpu})
attnguard.activate(log="none")
first = 0 if case != "deterministic rank last" else 1
if case.startswith("deterministic") and rank == 0:
    torch.use_deterministic_algorithms(True)
def fake_race(*args):
    return decisions.Decision("sdpa" if rank == 1 else "requested", {"x": f"rank {rank}"},
                              {"sdpa": {"ms": 1.0}})
decisions._race = fake_race
class T(SimpleNamespace):
    pass
q = T(shape=(4, 4096, 32, 128), dtype=torch.bfloat16, is_cuda=True, requires_grad=False,
      device=torch.device("cuda", 0))
entry = SimpleNamespace(name="flash_attn_func", params=("q", "k", "causal"), original=None,
                        site="flash_attn.flash_attn_func")
if rank != first:
    dist.barrier()  # the other rank reaches the bucket (and posts) first
with events.capture() as seen:
    impl = decisions.serve(entry, (q, q, True), {}, decisions.Options(version="0"))
if rank == first:
    dist.barrier()
ev = [e for e in seen if e["event"] == "kernel_selected"]
print(json.dumps({"rank": rank, "served": "requested" if impl is None else "another",
                  "said": [(e["level"], e["reason"]) for e in ev]}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("case", ["gpus differ", "deterministic rank first"])
def test_ranks_agree_whatever_their_gpus_and_determinism(tmp_path, case):
    """One rank on another GPU model (another fingerprint), or in deterministic mode: every rank
    computes the bucket with the same kernel (here the requested one, which the first rank to
    reach the bucket posted)."""
    got = _two_ranks(tmp_path, _RANKS_DIFFER, case)
    assert [g["served"] for g in got] == ["requested", "requested"], got


def test_a_deterministic_rank_that_comes_last_says_the_ranks_differ(tmp_path):
    """The other rank already computes with the kernel it posted; this rank's deterministic mode
    keeps the requested kernel, and a warning says the ranks now differ on that bucket."""
    got = _two_ranks(tmp_path, _RANKS_DIFFER, "deterministic rank last")
    assert [g["served"] for g in got] == ["requested", "another"], got
    (level, reason), *_ = got[0]["said"]
    assert level == "warning" and "ranks differ" in reason and "deterministic" in reason


def _two_ranks(tmp_path, program, *argv):
    script = tmp_path / "ranks.py"
    script.write_text(program)
    env = subprocess_env(OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    res = subprocess.run([*cmd, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = sorted(
        (json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")),
        key=lambda g: g["rank"],
    )
    assert len(got) == 2, res.stdout
    return got


# --- attnguard doctor reads the cache under the same rules ---------------------------------------


def test_doctor_lists_the_cache_under_the_file_rules(tmp_path):
    """A shared cache directory with another user's plants: a FIFO (an open would block for ever),
    terminal escapes in a record, a link to a file elsewhere, a directory anyone may write.
    doctor finishes, prints no escape and nothing of what the links lead to, and names each."""
    root = tmp_path / "attnguard" / "kernels"
    mine = root / ("a" * 16)
    mine.mkdir(parents=True, mode=0o700)
    os.mkfifo(mine / "fifo.json")
    evil = {"schema": 1, "fingerprint": {"gpu": "\x1b]0;owned\x07GPU"}, "bucket": ["\x1b[2J"]}
    (mine / "escapes.json").write_text(json.dumps({**evil, "winner": "sdpa\x1b[31m"}))
    secret = tmp_path / "secret.txt"
    secret.write_text(json.dumps({"winner": "SECRET-CONTENT", "why": {}}))
    os.symlink(secret, mine / "link.json")
    shared = root / ("b" * 16)
    shared.mkdir(mode=0o700)
    (shared / "planted.json").write_text(json.dumps({"winner": "PLANTED", "why": {}}))
    os.chmod(shared, 0o777)
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path))
    res = subprocess.run(
        [PY, "-m", "attnguard", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    listed = res.stdout.split("Kernel decisions cached on this machine", 1)[1]
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
    assert "SECRET-CONTENT" not in listed and "PLANTED" not in listed
    assert "FIFO" in listed and "symbolic link" in listed and "written by other users" in listed
    assert "\\x1b" in listed  # the escapes shown as text
