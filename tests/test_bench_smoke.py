"""Every benchmark runs: each ``bench/bench_*.py`` in its ``--smoke`` mode (bench/_smoke.py), a
fresh process each, so that none rots between the runs that measure (one did: it still called a
function of attnguard that was gone). Found at test time: a new bench without a smoke mode fails
here. A smoke run runs the bench's own code at the smallest size on what this machine has; what
needs hardware it lacks (a CUDA GPU, two, the real flash-attn) it names as skipped, one line
each. Nothing here is a timing check: a smoke run's numbers mean nothing.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from helpers.hook import env_for
from helpers.processes import PY, REPO

BENCHES = sorted(p.name for p in (REPO / "bench").glob("bench_*.py"))


def test_the_benches_are_found() -> None:
    assert "bench_call_overhead.py" in BENCHES and len(BENCHES) >= 10


@pytest.mark.parametrize("bench", BENCHES)
def test_the_bench_runs_in_smoke_mode(bench: str) -> None:
    env = env_for(OMP_NUM_THREADS="1")
    if os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR"):  # bench_quiet's broken flash-attn beside it
        env["TEST_BROKEN_FLASH_ATTN_DIR"] = os.environ["TEST_BROKEN_FLASH_ATTN_DIR"]
    try:
        res = subprocess.run(
            [PY, str(REPO / "bench" / bench), "--smoke"],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{bench} --smoke did not end in 10 minutes")
    name = Path(bench).stem
    said = [line for line in res.stdout.splitlines() if line.startswith(f"SMOKE {name}: ")]
    assert res.returncode == 0, f"{bench} --smoke: exit {res.returncode}\n{res.stderr[-4000:]}"
    assert said and said[-1] == f"SMOKE {name}: ok", res.stdout[-3000:]
    assert any(line.startswith(f"SMOKE {name}: ran ") for line in said)
    print("\n".join(said))  # what ran and what was skipped, for the log (pytest -s / -rA)
