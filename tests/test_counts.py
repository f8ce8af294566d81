"""Counts that are the truth across processes.

Real guarded programs: a tiny Llama checkpoint requested with flash_attention_2 (one
``backend_fallback``: flash-attn cannot run here) and xformers' memory_efficient_attention
called twice on CPU tensors (two ``backend_rerouted`` from one call site). ``attnguard summary``
must add processes up (every event carries its process's id), take the largest figure only
within one process, and a forked child must not report its parent's counts again.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import PY, subprocess_env

pytest.importorskip("xformers")

PROGRAM = """
import os, sys
import torch, transformers
import attnguard  # noqa: F401  (activates from the environment)
import xformers.ops as xops

model = transformers.AutoModelForCausalLM.from_pretrained(
    sys.argv[1], attn_implementation="flash_attention_2"
)
q = torch.randn(1, 8, 2, 16)

def attend():
    return xops.memory_efficient_attention(q, q, q)

if sys.argv[2] == "fork":
    pid = os.fork()
    if pid == 0:  # a worker of this process: one call of its own, then a normal exit
        attend()
        sys.exit(0)
    os.waitpid(pid, 0)
else:
    attend()
    attend()
"""


def run_program(tmp_path: Path, checkpoint: Path, how: str, log: Path) -> None:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    res = subprocess.run(
        [PY, str(script), str(checkpoint), how],
        env=subprocess_env(ATTNGUARD="1", ATTNGUARD_LOG=str(log), HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]


def summary_rows(*files: Path) -> dict[str, dict[str, Any]]:
    res = subprocess.run(
        [PY, "-m", "attnguard", "summary", "--json", *map(str, files)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return {r["event"]: r for r in json.loads(res.stdout)["rows"]}


def test_runs_writing_one_file_are_added_up(tiny_checkpoint: Any, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"  # one file, as ATTNGUARD_LOG=events.jsonl gives every run
    for _ in range(3):
        run_program(tmp_path, tiny_checkpoint("llama"), "twice", log)
    rows = summary_rows(log)
    assert rows["backend_fallback"]["count"] == 3
    assert rows["backend_rerouted"]["count"] == 6
    assert rows["backend_rerouted"]["applied"] == 6
    procs = {json.loads(line)["proc"] for line in log.read_text().splitlines()}
    assert len(procs) == 3  # one id per process, in every event


def test_a_forked_child_reports_only_its_own_counts(tiny_checkpoint: Any, tmp_path: Path) -> None:
    log = tmp_path / "events.jsonl"
    run_program(tmp_path, tiny_checkpoint("llama"), "fork", log)
    recs = [json.loads(line) for line in log.read_text().splitlines()]
    by_proc: dict[str, list[str]] = {}
    for r in recs:
        by_proc.setdefault(r["proc"], []).append(r["event"])
    (parent,) = [p for p in by_proc if "activated" in by_proc[p]]
    (child,) = [p for p in by_proc if p != parent]
    child_summary = next(r for r in recs if r["proc"] == child and r["event"] == "summary")
    assert child_summary["events"] == {"backend_rerouted": 1}  # not the parent's fallback
    assert child_summary["helper"] is True
    rows = summary_rows(log)
    assert rows["backend_fallback"]["count"] == 1  # one load, reported once
    assert rows["backend_rerouted"]["count"] == 1
