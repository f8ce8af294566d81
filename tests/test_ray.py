"""Ranks set after start-up: a real local Ray cluster with two actors.

verl's launcher pattern: a guarded driver starts Ray; each actor is a worker process that
starts as a helper of the driver (no rank yet), then sets RANK / WORLD_SIZE / LOCAL_RANK /
MASTER_* itself and joins a process group. From then on it is a rank: its events say so (no
``helper``), each rank's events go to its own file, and rank 0 writes one job summary with every
rank's exact counts. Each actor loads a tiny Llama with flash_attention_2 (flash's code path on
the SDPA twins here) and makes 20 xformers calls on CPU tensors (20 reroutes per rank).

Ray is heavy: CI runs this file in a lane of its own (.ci/run), elsewhere it is skipped.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import PY, subprocess_env

pytest.importorskip("ray")
pytest.importorskip("xformers")

CALLS = 20

DRIVER = """
import os, socket, sys
import ray

@ray.remote(num_cpus=1)
class Worker:
    def __init__(self, rank, port):
        # as verl's workers do: the controller hands out ranks, the worker sets its own env
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                          LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=2)

    def run(self, checkpoint, calls):
        import torch, transformers
        import xformers.ops as xops
        import attnguard
        model = transformers.AutoModelForCausalLM.from_pretrained(
            checkpoint, attn_implementation="flash_attention_2")
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
        q = torch.randn(1, 8, 2, 16)
        for _ in range(calls):
            xops.memory_efficient_attention(q, q, q)
        return attnguard.settings().enabled, float(logits.sum())

    def leave(self):
        ray.actor.exit_actor()  # a graceful exit: exit handlers run

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
ray.init(num_cpus=2, include_dashboard=False)
workers = [Worker.remote(rank, port) for rank in range(2)]
print("RESULTS", ray.get([w.run.remote(sys.argv[1], int(sys.argv[2])) for w in workers]))
for w in reversed(workers):  # rank 1 first, then rank 0 (which gathers)
    try:
        ray.get(w.leave.remote())
    except Exception:
        pass  # ActorDiedError: it left
ray.shutdown()
"""


def test_ray_actors_become_ranks_with_exact_counts(tiny_checkpoint: Any, tmp_path: Path) -> None:
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    env = subprocess_env(
        ATTNGUARD="1",
        ATTNGUARD_LOG=str(tmp_path / "events-{rank}.jsonl"),
        HF_HUB_OFFLINE="1",
        OMP_NUM_THREADS="1",
        RAY_USAGE_STATS_ENABLED="0",
    )
    res = subprocess.run(
        [PY, str(script), str(tiny_checkpoint("llama")), str(CALLS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    (results,) = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULTS")]
    assert results.count("True") == 2  # the guard is active in both actors

    recs = {r: _records(tmp_path / f"events-{r}.jsonl") for r in (0, 1)}
    workers = {
        r: [e for e in recs[r] if e["event"] != "activated" and e["site"] != "process"]
        for r in (0, 1)
    }
    for r in (0, 1):
        assert workers[r], f"rank {r} wrote no events"
        assert {e["rank"] for e in workers[r]} == {r}
        assert not any(e.get("helper") for e in workers[r])  # ranks, not helpers
    (job,) = [e for e in recs[0] if e["event"] == "summary" and e["site"] == "job"]
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == []
    assert job["events"] == {"backend_fallback": 2, "backend_rerouted": 2 * CALLS}
    assert job["per_rank"]["1"]["applied"] == CALLS + 1
    assert not [e for e in recs[1] if e["event"] == "summary"]  # its counts are in rank 0's

    merged = subprocess.run(
        [
            PY,
            "-m",
            "attnguard",
            "summary",
            "--json",
            *(str(tmp_path / f"events-{r}.jsonl") for r in (0, 1)),
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    rows = {r["event"]: r for r in json.loads(merged.stdout)["rows"]}
    assert rows["backend_rerouted"]["count"] == 2 * CALLS
    assert rows["backend_rerouted"]["ranks"] == [0, 1]
    assert rows["backend_fallback"]["count"] == 2


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
