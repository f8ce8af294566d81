"""A rank started through a small Python wrapper (``torchrun -> python wrap.py -> python
rank.py``: a per-rank wrapper for environment set-up or NUMA pinning) is a rank, not a helper of
its wrapper: it announces its activation, its events carry no ``helper`` flag, and rank 0 writes
the job's summary over both ranks. The wrapper never imports a library to guard, so it never
activates and marks nothing for its children. A process the rank starts once it is guarded (a
tokenizer subprocess, a tool) stays the rank's helper. Real torchrun on CPU, the ``ATTNGUARD=1``
start-up hook throughout.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from helpers.events import json_lines
from helpers.hook import env_for, needs_hook
from helpers.processes import PY

pytestmark = needs_hook

WRAPPER = """
import os, subprocess, sys
os.environ.setdefault("OMP_NUM_THREADS", "1")  # what such wrappers set up before the rank runs
sys.exit(subprocess.call([sys.executable, *sys.argv[1:]]))
"""

RANK = """
import os, subprocess, sys
import transformers  # the guard activates here
from attnguard.observability import events

events.emit("qkv_unified", site="rank", reason_code="mixed_dtypes", reason="x", applied=True)
# a helper of this rank: a tokenizer-like subprocess that changes something too
helper = (
    "import attnguard; attnguard.is_active(); from attnguard.observability import events; "
    "events.emit('qkv_unified', site='helper', reason_code='mixed_dtypes', reason='x', "
    "applied=True)"
)
subprocess.run([sys.executable, "-c", helper], check=True)
print("rank", os.environ["RANK"], os.getpid(), os.getppid())
"""


def test_a_rank_behind_a_python_wrapper_is_a_rank_and_its_tools_are_its_helpers(
    tmp_path: Path,
) -> None:
    (tmp_path / "wrap.py").write_text(WRAPPER)
    (tmp_path / "rank.py").write_text(RANK)
    logs = tmp_path / "logs"
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(tmp_path / "wrap.py"), str(tmp_path / "rank.py")]
    env = env_for(ATTNGUARD="1", ATTNGUARD_LOG=f"{logs}/ev-{{rank}}.jsonl", OMP_NUM_THREADS="1")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    ranks = {}  # rank -> (its pid, its wrapper's pid)
    for line in res.stdout.splitlines():
        if line.startswith("rank "):
            _, rank, pid, ppid = line.split()
            ranks[int(rank)] = (int(pid), int(ppid))
    assert sorted(ranks) == [0, 1]
    per_rank = {r: json_lines((logs / f"ev-{r}.jsonl").read_text()) for r in (0, 1)}
    for r, (pid, wrapper) in ranks.items():
        recs = per_rank[r]
        assert wrapper not in {e["pid"] for e in recs}  # the wrapper never activated
        own = [e for e in recs if e["pid"] == pid]
        assert not any(e.get("helper") for e in own), own
        assert [e["event"] for e in own][:2] == ["activated", "qkv_unified"]
        helpers = [e for e in recs if e["pid"] != pid]
        assert helpers and all(e.get("helper") is True for e in helpers), helpers
        assert [e["event"] for e in helpers] == ["qkv_unified", "summary"]  # its own summary
    (job,) = [e for e in per_rank[0] if e["event"] == "summary" and e["site"] == "job"]
    assert (job["ranks"], job["missing_ranks"]) == ([0, 1], [])
    assert job["pid"] == ranks[0][0] and job["applied"] == 2  # each rank's own change, once
    assert not any(e["event"] == "summary" and e["site"] == "job" for e in per_rank[1])
