"""The job summary at scale, and every store call bounded.

* Eight real ranks (torch + gloo) over four simulated nodes (``bench/bench_job_summary.py``'s
  real part: own private and log directories per node, own host names where a UTS namespace can
  be made), every rank with changes, every group destroyed before exit: rank 0's summary is
  complete and exact.
* The store protocol without torch, 1,024 ranks on a fake store with c10d's calls: attnguard's
  own posting and gathering code, ranks ending at random moments, some without exit handlers.
* A store whose server stops answering (SIGSTOP) fails a call after the bound, and every later
  call at once: no exit waits on it.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from types import ModuleType

import pytest
from helpers.processes import REPO

from attnguard.observability import jobstore


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "bench_job_summary", REPO / "bench" / "bench_job_summary.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_eight_ranks_on_four_nodes_give_a_complete_and_exact_summary() -> None:
    res = _bench().run_real(nodes=4, per_node=2)
    assert res["ranks"] == 8 and res["complete"] and res["exact"]
    # each rank: its record, enrolled twice (group end, exit), once as announced, once as joined
    assert res["keys"]["rank"] == 7 and res["keys"]["posted"] == 14
    assert res["keys"]["announced"] == 7 and res["keys"]["joined"] == 7


@pytest.mark.parametrize("gone_every", [0, 64])
def test_the_protocol_holds_for_1024_ranks(gone_every: int) -> None:
    res = _bench().simulate(1024, spread_s=0.5, timeout_s=3.0, gone_every=gone_every)
    assert res["complete"] and res["exact"]
    gone = sum(1 for r in range(1, 1024) if r % 64 == 63) if gone_every else 0  # 16
    assert res["gone"] == gone and res["as_of_group_end"] == gone
    # keys: per rank its record, two posted entries (one for a gone rank), one announcement,
    # one joined entry; three counters for the job
    assert res["keys"]["rank"] == 1023 and res["keys"]["joined"] == 1023
    assert res["keys"]["posted"] == 2 * 1023 - gone and res["keys"]["announced"] == 1023
    assert res["keys"]["total"] == 1023 * 5 - gone + 3


def test_a_store_that_stops_answering_is_given_up() -> None:
    import datetime

    import torch.distributed as dist

    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, torch.distributed as d\n"
            "s = d.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)\n"
            "print(s.port, flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        port = int(server.stdout.readline())  # type: ignore[union-attr]
        client = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=600)
        )
        caller = jobstore._Caller()
        caller.start()
        store = jobstore.JobStore(client, 1, 2, "kept")
        store.timeout = 1.0
        jobstore._caller, saved = caller, jobstore._caller
        try:
            store.set("rank/1", b"x")
            assert store.get("rank/1") == b"x"
            server.send_signal(signal.SIGSTOP)  # connected, never answers
            with pytest.raises(jobstore.StoreUnavailable, match="did not answer within 1 s"):
                store.get("rank/1")
            # the thread is lost to that call: later calls fail at once, never queued behind it
            with pytest.raises(jobstore.StoreUnavailable, match="did not answer an earlier call"):
                store.enrol("posted", 1)
        finally:
            jobstore._caller = saved
    finally:
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait()
