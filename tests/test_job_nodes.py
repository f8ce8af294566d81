"""One true job story on several nodes whose ranks destroy their process group before exit.

Real ``python -m torch.distributed.run`` agents, one per simulated node (``--nnodes``,
``--node-rank``, torchrun's static rendezvous on this host), gloo on CPU. Nodes share nothing the summary
could use as a second channel: each node has its own private directory (``XDG_CACHE_HOME``,
``XDG_RUNTIME_DIR`` unset), its own ``ATTNGUARD_LOG`` directory, and, where this test may make
a UTS namespace (root with ``unshare``), its own host name. The scripts end as accelerate, verl
and torchtitan end: ``dist.destroy_process_group()``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import PY, free_port, subprocess_env

# Every rank loads a tiny Llama asking for flash attention (absent on CPU: a remedy on every
# rank, as in the issue), runs a forward, then ends its group. ``RANK1_EXIT`` picks how rank 1
# ends: normally, or ``os._exit`` right after destroying its group (no exit handler runs).
WORKER = """
import os, sys
import torch, torch.distributed as dist, transformers

if os.environ.get("ATTNGUARD") == "1":
    from attnguard.observability import summary

    summary.GATHER_TIMEOUT_S = float(os.environ["GATHER_TIMEOUT"])
dist.init_process_group("gloo")
model = transformers.AutoModelForCausalLM.from_pretrained(
    sys.argv[1], attn_implementation="flash_attention_2"
)
with torch.no_grad():
    model(input_ids=torch.tensor([[1, 2, 3, 4]]))
dist.barrier()
rank = dist.get_rank()
dist.destroy_process_group()
print("host", __import__("socket").gethostname(), "rank", rank, flush=True)
if rank == 1 and os.environ.get("RANK1_EXIT") == "os._exit":
    os._exit(0)
"""
TIMEOUT_S = 300


def _can_name_hosts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    res = subprocess.run(["unshare", "-u", "true"], capture_output=True)
    return res.returncode == 0


def launch_nodes(
    tmp_path: Path,
    script: str,
    args: list[str],
    *,
    nodes: int,
    per_node: int,
    env: dict[str, str],
    node_env: dict[int, dict[str, str]] | None = None,
    store: str = "launcher",
) -> list[subprocess.CompletedProcess[str]]:
    """One torchrun agent per node, each with its own private and log directories (and host
    name where it can be had); returns each agent's result."""
    (tmp_path / "worker.py").write_text(script)
    port = free_port()
    named = _can_name_hosts()
    procs = []
    for node in range(nodes):
        home = tmp_path / f"node{node}"
        (home / "cache").mkdir(parents=True, exist_ok=True)
        this_env = subprocess_env(
            **{
                "HF_HUB_OFFLINE": "1",
                "OMP_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "lo",
                "ATTNGUARD": "1",
                "ATTNGUARD_LOG": str(home / "events-{rank}.jsonl"),
                "XDG_CACHE_HOME": str(home / "cache"),
                **env,
                **(node_env or {}).get(node, {}),
            }
        )
        this_env.pop("XDG_RUNTIME_DIR", None)
        cmd = [
            PY,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nodes}",
            f"--node-rank={node}",
            f"--nproc-per-node={per_node}",
            "--local-addr=127.0.0.1",  # the nodes' own host names resolve nowhere
            *RENDEZVOUS[store](port),
            str(tmp_path / "worker.py"),
            *args,
        ]
        if named:
            cmd = ["unshare", "-u", "sh", "-c", f'hostname node{node} && exec "$@"', "sh", *cmd]
        procs.append(
            subprocess.Popen(
                cmd, env=this_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    for res in out:
        assert res.returncode == 0, res.stderr[-3000:]
    return out


# How the ranks' process groups get their store: torchrun's own (the agent's, the default), or
# one rank 0 hosts (the c10d rendezvous told not to share its store: node ranks by arrival).
RENDEZVOUS = {
    "launcher": lambda port: ["--master-addr=127.0.0.1", f"--master-port={port}"],
    "rank0": lambda port: [
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=attnguard-test",
    ],
}
STORE_ENV = {"launcher": {}, "rank0": {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}}


def rank_log(tmp_path: Path, rank: int) -> Path:
    """Rank ``rank``'s own file, on whichever node it ran."""
    (path,) = tmp_path.glob(f"node*/events-{rank}.jsonl")
    return path


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summaries(path: Path) -> list[dict[str, Any]]:
    return [r for r in records(path) if r["event"] == "summary"]


@pytest.mark.parametrize("store", ["launcher", "rank0"])
def test_two_nodes_that_destroy_their_group_give_one_complete_job_summary(
    tiny_checkpoint: Any, tmp_path: Path, store: str
) -> None:
    """The issue's case: both ranks had a remedy; rank 0's summary counts both, and says nothing
    untrue. Through torchrun's own store, and through the store rank 0's process group hosted,
    kept past ``destroy_process_group()``."""
    checkpoint = tiny_checkpoint("llama")
    results = launch_nodes(
        tmp_path,
        WORKER,
        [str(checkpoint)],
        nodes=2,
        per_node=1,
        env={"GATHER_TIMEOUT": "30", **STORE_ENV[store]},
        store=store,
    )
    if _can_name_hosts():  # the nodes really had two host names
        said = "".join(res.stdout for res in results)
        assert {"node0", "node1"} == {
            line.split()[1] for line in said.splitlines() if line.startswith("host ")
        }
    own1 = [r for r in records(rank_log(tmp_path, 1)) if r["event"] != "summary"]
    assert sum(r["count"] for r in own1 if r.get("applied") is True) > 0  # a remedy of its own
    assert summaries(rank_log(tmp_path, 1)) == []  # its story is rank 0's
    (job,) = summaries(rank_log(tmp_path, 0))
    assert job["site"] == "job" and job["gathered_by"] == "process_group"
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == [] and job["silent_ranks"] == []
    assert job["as_of_group_end"] == []  # rank 1's exit record came, not only its group-end one
    assert job["per_rank"]["1"]["applied"] > 0
    assert job["event_ranks"]["backend_fallback"] == [0, 1]
    assert "over 2 of 2 ranks" in job["reason"]
    assert "announced no event" not in job["reason"] and "no report" not in job["reason"]


NO_GROUP = """
import sys
import torch, transformers

transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="flash_attention_2")
"""


def test_two_nodes_without_a_process_group_meet_in_torchruns_store(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """No process group at all (an inference script), no shared directory: the ranks meet in
    torchrun's own store."""
    checkpoint = tiny_checkpoint("llama")
    launch_nodes(tmp_path, NO_GROUP, [str(checkpoint)], nodes=2, per_node=1, env={})
    (job,) = summaries(rank_log(tmp_path, 0))
    assert job["gathered_by"] == "launcher_store"
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == []
    assert job["event_ranks"]["backend_fallback"] == [0, 1]


def test_a_rank_gone_without_exit_handlers_is_counted_as_of_its_group_end(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """Rank 1 (on the other node) had events, destroyed its group, then ended with
    ``os._exit``: no exit record will come. Rank 0 waits its deadline for it, then counts the
    record rank 1 posted as it ended its group, and says so."""
    checkpoint = tiny_checkpoint("llama")
    launch_nodes(
        tmp_path,
        WORKER,
        [str(checkpoint)],
        nodes=2,
        per_node=1,
        env={"GATHER_TIMEOUT": "2", "RANK1_EXIT": "os._exit"},
    )
    (job,) = summaries(rank_log(tmp_path, 0))
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == []
    assert job["as_of_group_end"] == [1] and job["waited_for"] == []
    assert job["per_rank"]["1"]["applied"] > 0
    assert (
        "rank(s) 1 counted as of their destroy_process_group(): no exit report within 2 s"
        in (job["reason"])
    )


def test_a_rank_without_attnguard_is_named_as_not_heard(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """Rank 1 runs without attnguard: rank 0 heard nothing from it and says exactly that."""
    checkpoint = tiny_checkpoint("llama")
    launch_nodes(
        tmp_path,
        WORKER.replace('"flash_attention_2"', '"sdpa"'),  # rank 1 unguarded must run too
        [str(checkpoint)],
        nodes=2,
        per_node=1,
        env={"GATHER_TIMEOUT": "30"},
        node_env={1: {"ATTNGUARD": "0"}},
    )
    assert list(tmp_path.glob("node*/events-1.jsonl")) == []
    (job,) = summaries(rank_log(tmp_path, 0))
    assert job["ranks"] == [0] and job["silent_ranks"] == [1] and job["waited_for"] == []
    assert "rank(s) 1: no report reached rank 0, nor word of any event" in job["reason"]
