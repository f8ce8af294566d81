"""Rank 0 waits at exit only for ranks that announced something to report.

The case under real ``torchrun --nproc-per-node=2`` (gloo, CPU): a tiny Llama with
sdpa (nothing for attnguard to do), a forward, then rank 1 destroys its process group and ends
with ``os._exit(0)`` (no exit handler runs). Rank 0's wait for reports is set to an hour in the
guarded run: if it waited for rank 1 at all, the job would outlive the test's timeout.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from helpers.processes import PY, subprocess_env

WORKER = """
import os, sys
import torch, torch.distributed as dist, transformers

guarded = os.environ.get("ATTNGUARD") == "1"
if guarded:
    from attnguard.observability import summary
    summary.GATHER_TIMEOUT_S = 3600.0  # a wait for anyone shows as a hang

dist.init_process_group("gloo")
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa")
with torch.no_grad():
    model(input_ids=torch.tensor([[1, 2, 3, 4]]))
dist.barrier()
if dist.get_rank() == 1:
    dist.destroy_process_group()
    os._exit(0)
"""
TIMEOUT_S = 240  # well past an unguarded run (about 10 s here), far below the hour


def launch(tmp_path: Path, checkpoint: Path, guarded: bool) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = subprocess_env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if guarded:
        env.update(ATTNGUARD="1", ATTNGUARD_LOG=str(tmp_path / "events-{rank}.jsonl"))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    res = subprocess.run(
        [*cmd, str(checkpoint)], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_nothing_to_report_means_no_wait(tiny_checkpoint: Any, tmp_path: Path) -> None:
    checkpoint = tiny_checkpoint("llama")
    launch(tmp_path, checkpoint, guarded=True)
    lines = (tmp_path / "events-0.jsonl").read_text().splitlines()
    (job,) = [r for r in map(json.loads, lines) if r["event"] == "summary"]
    assert job["site"] == "job" and job["gathered_by"] == "process_group"
    assert job["waited_for"] == []  # nobody announced anything: no wait
    # rank 1 posted its (empty) record as it destroyed its group; no exit record followed
    assert job["ranks"] == [0, 1] and job["silent_ranks"] == [] and job["as_of_group_end"] == []
    assert job["applied"] == 0 and job["level"] == "info"


SLOW_RANK = """
import os, sys, time
import torch, transformers

if os.environ["RANK"] == "1":
    time.sleep(float(sys.argv[2]))  # starts late: rank 0 is done before rank 1's first event
transformers.AutoModelForCausalLM.from_pretrained(
    sys.argv[1], attn_implementation="flash_attention_2"
)
print("rank done", flush=True)
"""


def test_a_rank_still_running_is_waited_for(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """No process group, rank 1 much slower than rank 0: it has not announced an event when
    rank 0 exits, but it still runs (it said so at activation), so rank 0 waits for it and the
    job summary counts both ranks (a slow start made rank 1 vanish from the summary before)."""
    script = tmp_path / "slow.py"
    script.write_text(SLOW_RANK)
    env = subprocess_env(
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        ATTNGUARD="1",
        ATTNGUARD_LOG=str(tmp_path / "events-{rank}.jsonl"),
    )
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    checkpoint = tiny_checkpoint("llama")
    res = subprocess.run(
        [*cmd, str(checkpoint), "6"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = (tmp_path / "events-0.jsonl").read_text().splitlines()
    (job,) = [r for r in map(json.loads, lines) if r["event"] == "summary"]
    # waited for through the file saying it runs; its record came through torchrun's store
    assert job["site"] == "job" and job["gathered_by"] == "launcher_store"
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == [], job["reason"]
    assert job["applied"] == 2  # one backend_fallback on each rank


KILLED = """
import os, signal, sys, time
import torch.distributed as dist, transformers
from attnguard.observability import summary

summary.GATHER_TIMEOUT_S = 3600.0  # a wait for the killed rank shows as a hang
dist.init_process_group("gloo")
transformers.AutoModelForCausalLM.from_pretrained(
    sys.argv[1], attn_implementation="flash_attention_2"
)  # an event on each rank: rank 1 announces it
dist.barrier()
flag = sys.argv[2]
if dist.get_rank() == 1:
    open(flag, "w").close()
    os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs; the launcher keeps rank 0
while not os.path.exists(flag):
    time.sleep(0.01)
time.sleep(0.5)  # rank 1 is gone now
"""

LAUNCHER = """
import os, socket, subprocess, sys
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ranks = []
for r in range(2):
    env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    ranks.append(subprocess.Popen([sys.executable, *sys.argv[1:]], env=env))
print([p.wait() for p in ranks])
"""


def test_a_rank_killed_under_a_launcher_that_keeps_the_others(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """Rank 1 announced an event, then was killed (SIGKILL: no exit handler); a launcher that
    starts ranks itself (as a shell's ``&`` and ``wait`` do) keeps rank 0 running. Rank 0 saw
    from the file rank 1 left at activation that its process is gone, so it does not wait for
    it (it used to wait its whole deadline, 10 s by default), and says so."""
    (tmp_path / "rank.py").write_text(KILLED)
    (tmp_path / "launch.py").write_text(LAUNCHER)
    env = subprocess_env(
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        ATTNGUARD="1",
        ATTNGUARD_LOG=str(tmp_path / "events-{rank}.jsonl"),
    )
    args = [str(tmp_path / "rank.py"), str(tiny_checkpoint("llama")), str(tmp_path / "killed")]
    res = subprocess.run(
        [PY, str(tmp_path / "launch.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert res.stdout == "[0, -9]\n", res.stderr[-3000:]
    lines = (tmp_path / "events-0.jsonl").read_text().splitlines()
    (job,) = [r for r in map(json.loads, lines) if r["event"] == "summary"]
    assert job["ranks"] == [0] and job["missing_ranks"] == [1] and job["gone_ranks"] == [1]
    assert "rank(s) 1: their process ended without reporting (killed?)" in job["reason"]
    assert job["waited_for"] == []
