"""Benchmark: the job summary of a many-node job whose ranks destroy their process group (CPU).

Two parts, each printing a Markdown table:

* **real**: real processes (torch + gloo + attnguard) under one ``python -m
  torch.distributed.run`` agent per simulated node (static rendezvous on this host), each node
  with its own private directory (``XDG_CACHE_HOME``), its own ``ATTNGUARD_LOG`` directory and,
  where a UTS namespace can be made (root with ``unshare``), its own host name. Every rank records
  ``rank % 3 + 1`` changes (one of them on ranks divisible by 4 a second kind), destroys its
  group, and ends; rank 0 calls ``attnguard.finish()`` after its destroy, then counts the keys
  the summary left in the job's store. Reported: whether rank 0's summary is complete and exact
  (its counts against the sum of every rank's own), how long rank 0 waited for reports
  (``waited_s``), and the keys per rank.
* **sim**: the store protocol without torch, to 1,024 ranks: a fake store (``set`` / ``get`` /
  ``check`` / ``add``, as c10d's) shared by one thread per rank running attnguard's own posting
  code (:func:`attnguard.observability.summary._post`, :meth:`attnguard.observability.jobstore.JobStore.enrol`) and rank 0
  running its gathering (:func:`attnguard.observability.gather.gather`). Each rank announces its events,
  posts its record as it ends its group, and its exit record after a delay drawn between 0 and
  ``--spread`` seconds; in a second run one rank in 64 ends without an exit record
  (``os._exit``: rank 0 then waits its whole deadline, ``--timeout``). Reported:
  completeness, rank 0's wait, store calls and keys per rank.

    python bench/bench_job_summary.py [--real 4x8] [--sim 64,256,1024] [--smoke]

``--smoke`` (CI): 2 nodes x 2 ranks, and the simulation at 64 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _smoke  # noqa: E402

from attnguard.observability import gather, jobstore, summary  # noqa: E402
from attnguard.observability.eventfiles import clean_keys  # noqa: E402
from attnguard.observability.events import KINDS  # noqa: E402

# --- real processes ------------------------------------------------------------------------------

WORKER = """
import json, os, sys, time
import attnguard
import torch, torch.distributed as dist
from attnguard.observability import events, jobstore, summary

summary.GATHER_TIMEOUT_S = 60.0
dist.init_process_group("gloo")
rank = dist.get_rank()
for _ in range(rank % 3 + 1):
    events.emit("device_map_rewritten", site="transformers.load",
                reason_code="device_map_per_rank", reason="one replica per rank", applied=True)
if rank % 4 == 0:
    events.emit("tensors_aligned", site="rotary:LlamaRotaryEmbedding",
                reason_code="rotary_device_mismatch", reason="moved position_ids", applied=True)
dist.barrier()
dist.destroy_process_group()
if rank == 0:
    attnguard.finish()  # gathers now; the keys are still in the store
    store = jobstore.job_store()
    keys = [k for k in store.store.list_keys() if k.startswith(jobstore.PREFIX)]
    print("KEYS " + json.dumps(keys), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _can_name_hosts() -> bool:
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-u", "true"], capture_output=True).returncode == 0


def run_real(nodes: int, per_node: int) -> dict[str, Any]:
    """One job of ``nodes`` x ``per_node`` ranks; what rank 0's summary said and the keys."""
    world = nodes * per_node
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "worker.py").write_text(WORKER)
        port, named = _free_port(), _can_name_hosts()
        procs = []
        start = time.perf_counter()
        for node in range(nodes):
            home = tmp / f"node{node}"
            (home / "cache").mkdir(parents=True)
            env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
            env.pop("XDG_RUNTIME_DIR", None)
            env.update(
                PYTHONPATH=str(REPO),
                OMP_NUM_THREADS="1",
                GLOO_SOCKET_IFNAME="lo",
                ATTNGUARD_LOG=str(home / "events-{rank}.jsonl"),
                XDG_CACHE_HOME=str(home / "cache"),
            )
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}"]
            cmd += [f"--node-rank={node}", f"--nproc-per-node={per_node}"]
            cmd += ["--master-addr=127.0.0.1", f"--master-port={port}", "--local-addr=127.0.0.1"]
            cmd += [str(tmp / "worker.py")]
            if named:
                cmd = ["unshare", "-u", "sh", "-c", f'hostname node{node} && exec "$@"', "sh"] + cmd
            procs.append(
                subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            )
        outs = [p.communicate(timeout=600) for p in procs]
        took = time.perf_counter() - start
        for p, (_, err) in zip(procs, outs, strict=True):
            if p.returncode != 0:
                raise SystemExit(err[-3000:])
        keys = json.loads(next(x for x in outs[0][0].splitlines() if x.startswith("KEYS "))[5:])
        own: dict[int, int] = {}
        job = None
        for node in range(nodes):
            for path in (tmp / f"node{node}").glob("events-*.jsonl"):
                for line in path.read_text().splitlines():
                    rec = json.loads(line)
                    if rec["event"] == "summary":
                        job = rec if rec["site"] == "job" else job
                    elif rec.get("applied") is True:
                        own[rec["rank"]] = own.get(rec["rank"], 0) + rec["count"]
        # each rank's changes: counted by its own events (repeats are counts, not lines)
        expected = {r: r % 3 + 1 + (1 if r % 4 == 0 else 0) for r in range(world)}
        assert job is not None, "no job summary"
        exact = job["per_rank"] == {
            str(r): {**dict.fromkeys(KINDS, 0), "applied": n} for r, n in expected.items()
        }
        return {
            "nodes": nodes,
            "ranks": world,
            "named_hosts": named,
            "complete": job["ranks"] == list(range(world)) and not job["missing_ranks"],
            "exact": exact and job["applied"] == sum(expected.values()),
            "waited_s": job["waited_s"],
            "job_s": took,
            "keys": _key_kinds(keys, world),
        }


def _key_kinds(keys: list[str], world: int) -> dict[str, float]:
    """Keys by kind, and per rank."""
    kinds: dict[str, int] = {}
    for key in keys:
        rest = key.split("/", 4)[-1]  # attnguard/summary/v3/<restart>/<rest>
        kind = rest.split("/")[0] + ("/n" if rest.endswith("/n") else "")
        kinds[kind] = kinds.get(kind, 0) + 1
    return {**kinds, "total": len(keys), "per_rank": round(len(keys) / world, 2)}


# --- the protocol without torch ------------------------------------------------------------------


class FakeStore:
    """c10d's store calls that the summary makes (``set`` / ``get`` / ``check`` / ``add``), in
    memory, counting calls and keeping every key."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.calls = 0

    def set(self, key: str, value: bytes | str) -> None:
        with self.lock:
            self.calls += 1
            self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        with self.lock:
            self.calls += 1
            return self.data[key]  # never waited for: the summary checks first

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            self.calls += 1
            return all(k in self.data for k in keys)

    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.calls += 1
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            return value


def _keys_of(rank: int) -> list[dict[str, Any]]:
    n = rank % 3 + 1
    keys = [
        {
            "event": "device_map_rewritten",
            "site": "transformers.load",
            "reason_code": "device_map_per_rank",
            "count": n,
            **dict.fromkeys(KINDS, 0),
            "applied": n,
        }
    ]
    if rank % 4 == 0:
        keys.append(
            {
                "event": "tensors_aligned",
                "site": "rotary:LlamaRotaryEmbedding",
                "reason_code": "rotary_device_mismatch",
                "count": 1,
                **dict.fromkeys(KINDS, 0),
                "applied": 1,
            }
        )
    return keys


def simulate(
    world: int, spread_s: float, timeout_s: float, gone_every: int = 0, seed: int = 0
) -> dict[str, Any]:
    """One job of ``world`` ranks on the fake store; rank 0 gathers while the others post; one
    rank in ``gone_every`` (0: none) ends without its exit record."""
    rng = random.Random(seed)
    fake = FakeStore()
    gone = {r for r in range(1, world) if gone_every and r % gone_every == gone_every - 1}
    delays = {r: rng.uniform(0, spread_s) for r in range(1, world)}
    proc = {r: f"{r:016x}" for r in range(world)}
    calls: dict[int, int] = {}

    # every rank joins, announces its events and posts as it ends its group (on_group_end)
    for r in range(1, world):
        store = jobstore.JobStore(fake, r, world, "kept")
        store.enrol("joined", r)  # as on_group_start does
        store.enrol("announced", r)
        summary._post(store, gather.record_of(r, "group_end", proc[r], _keys_of(r)))
        calls[r] = store.calls

    def exit_post(r: int) -> None:
        time.sleep(delays[r])
        store = jobstore.JobStore(fake, r, world, "kept")
        summary._post(store, gather.record_of(r, "exit", proc[r], _keys_of(r)))
        calls[r] += store.calls

    threads = [
        threading.Thread(target=exit_post, args=(r,), daemon=True)
        for r in range(1, world)
        if r not in gone
    ]
    own = gather.RankRecord(
        proc[0],
        [k for k, _ in clean_keys(_keys_of(0))],
    )
    zero = jobstore.JobStore(fake, 0, world, "kept")
    for t in threads:
        t.start()
    got = gather.gather(world, own, gather.Channels(zero, None), timeout_s)
    for t in threads:
        t.join()
    agg = summary.aggregate(got.records)
    expected = sum(sum(k["applied"] for k in _keys_of(r)) for r in range(world))
    ours = [k for k in fake.data if k.startswith(jobstore.PREFIX)]
    return {
        "ranks": world,
        "complete": sorted(got.records) == list(range(world)),
        "exact": agg["applied"] == expected,
        "as_of_group_end": len(got.as_of_group_end),
        "gone": len(gone),
        "waited_s": got.waited_s,
        "rank0_calls": zero.calls,
        "calls_per_rank": round(sum(calls.values()) / max(1, len(calls)), 2),
        "keys": _key_kinds(ours, world),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", default="4x8", help="NODESxRANKS_PER_NODE, or 'none'")
    parser.add_argument("--sim", default="64,256,1024", help="rank counts, or 'none'")
    parser.add_argument("--spread", type=float, default=2.0, help="exit spread (s), simulation")
    parser.add_argument("--timeout", type=float, default=10.0, help="rank 0's deadline (sim)")
    parser.add_argument("--smoke", action="store_true", help="2x2 real ranks, 64 simulated")
    args = parser.parse_args()
    if args.smoke:
        args.real, args.sim, args.spread, args.timeout = "2x2", "64", 0.2, 5.0
    if args.real != "none":
        nodes, per_node = (int(x) for x in args.real.split("x"))
        res = run_real(nodes, per_node)
        print("| nodes x ranks | host names | complete | exact | rank 0 waited (s) | job (s) |")
        print("| --- | --- | --- | --- | --- | --- |")
        print(
            f"| {nodes} x {per_node} | {'own' if res['named_hosts'] else 'shared'} | "
            f"{res['complete']} | {res['exact']} | {res['waited_s']:.3f} | {res['job_s']:.1f} |"
        )
        print(f"\nstore keys: {json.dumps(res['keys'])}\n")
        if not (res["complete"] and res["exact"]):
            raise SystemExit("the job summary is not complete and exact")
        if args.smoke:
            _smoke.ran(f"{nodes} x {per_node} real ranks (torchrun agents, gloo)")
    if args.sim != "none":
        print(
            "| ranks | complete | exact | counted as of group end (gone) | rank 0 waited (s) "
            "| rank 0 store calls | calls per rank | keys per rank |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        for world, gone_every in ((int(x), g) for x in args.sim.split(",") for g in (0, 64)):
            res = simulate(world, args.spread, args.timeout, gone_every)
            print(
                f"| {world} | {res['complete']} | {res['exact']} | "
                f"{res['as_of_group_end']} ({res['gone']}) | {res['waited_s']:.3f} | "
                f"{res['rank0_calls']} | {res['calls_per_rank']} | {res['keys']['per_rank']} |"
            )
            if not (res["complete"] and res["exact"]):
                raise SystemExit(f"{world} ranks: the job summary is not complete and exact")
            if args.smoke:
                _smoke.ran(f"the store protocol simulated, {world} ranks, {gone_every} gone")
    if args.smoke:
        raise SystemExit(_smoke.done())


if __name__ == "__main__":
    main()
