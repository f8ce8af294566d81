"""A job of ranks under ``torchrun`` (gloo on CPU, nccl on GPUs) running tests/workers/ranks_worker.py,
guarded or not, and what its ranks decided: the training stacks' tests (tests/test_ranks.py and
their GPU versions in tests/gpu)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from helpers.processes import PY, REPO, subprocess_env

WORKER = REPO / "tests" / "workers" / "ranks_worker.py"
# DeepSpeed lives outside the environment (scripts/test.sh): only its workers get it on their path
DEEPSPEED_DIR = os.environ.get("TEST_DEEPSPEED_DIR", "")
FLASH = "flash_attention_2"
TIMEOUT_S = 420  # a hang in a collective fails the test here


def launch(
    mode: str,
    path: Path,
    attn: str,
    out: Path,
    guarded: bool,
    extra: tuple = (),
    nproc: int = 2,
    env_extra: dict[str, str] | None = None,
) -> dict[int, dict]:
    out.mkdir(parents=True, exist_ok=True)
    env = subprocess_env(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if mode in ("zero3", "trainer_zero3"):
        env["PYTHONPATH"] = os.pathsep.join([DEEPSPEED_DIR, env["PYTHONPATH"]])
    if guarded:
        env.update(ATTNGUARD="1", ATTNGUARD_LOG=str(out / "events-{rank}.jsonl"))
    env.update(env_extra or {})
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(WORKER), mode, str(path), attn, str(out), *extra]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=str(out)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)}


def decisions(out: Path, rank: int) -> list[tuple[str, str, Any]]:
    """Each rank's events (without the bookkeeping ones), as (event, reason_code, applied)."""
    lines = (out / f"events-{rank}.jsonl").read_text().splitlines()
    evts = [json.loads(line) for line in lines if line.strip()]
    return sorted(
        (e["event"], e["reason_code"], e.get("applied"))
        for e in evts
        if e["event"] not in ("activated", "summary")
    )


def assert_ranks_agree(out: Path) -> list[tuple[str, str, Any]]:
    rank0, rank1 = decisions(out, 0), decisions(out, 1)
    assert rank0 == rank1, (rank0, rank1)
    assert not [d for d in rank0 if d[0] == "model_cast"]  # never a dtype change with ranks
    return rank0
