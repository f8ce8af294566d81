"""Quiet and true: nothing on the console when nothing happened, helpers (DataLoader workers,
tools a training script runs) stay silent, the console shows the ranks asked for, and a torchrun
job gets exactly one summary whether or not a process group is up at exit.

Fresh interpreters throughout, started the way users start them: ``python train.py``, the
``ATTNGUARD=1`` start-up hook, and ``torchrun`` (``python -m torch.distributed.run``) on CPU with
gloo.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers.events import json_lines, names
from helpers.hook import env_for, needs_hook
from helpers.processes import PY

import attnguard
from attnguard.observability import events


def run_script(
    tmp_path: Path, code: str, *args: str, env: dict[str, str], name: str = "prog.py"
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / name
    script.write_text(textwrap.dedent(code))
    return subprocess.run(
        [PY, str(script), *args], env=env, capture_output=True, text=True, timeout=300
    )


# --- nothing happened: nothing on the console ----------------------------------------------------


def test_a_guarded_program_where_nothing_happens_prints_nothing(tmp_path: Path) -> None:
    code = """
    import attnguard
    import transformers.modeling_utils
    print("trained")
    """
    res = run_script(tmp_path, code, env=env_for())
    assert res.returncode == 0 and res.stdout == "trained\n"
    assert res.stderr == ""
    # the same run writing a file: activation and the summary are there, at INFO
    log = tmp_path / "ev.jsonl"
    res = run_script(tmp_path, code, env=env_for(ATTNGUARD_LOG=str(log)))
    assert res.stderr == ""
    recs = json_lines(log.read_text())
    assert [(r["event"], r["level"]) for r in recs] == [("activated", "info"), ("summary", "info")]
    assert recs[1]["reason"] == "0 change(s) applied by attnguard in this process"


NO_REMEDY_LOAD = """
import json, sys
if sys.argv[2] == "guarded":
    import attnguard
import torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa")
with torch.no_grad():
    logits = model(torch.tensor([[1, 5, 9, 2]])).logits
print(json.dumps({"logits": logits.flatten()[:4].tolist(),
                  "modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def test_a_load_needing_no_remedy_imports_nothing_the_program_did_not(
    tmp_path: Path, tiny_checkpoint
) -> None:
    """xformers (installed by the test command, its ops unusable here) and the broken flash-attn
    build on the path: an sdpa load probes neither, and the events nobody's sink takes are not
    rendered (no structlog, nor rich / pygments through it)."""
    broken = os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR")
    paths = [broken] if broken else []
    path = str(tiny_checkpoint("llama"))
    plain = run_script(tmp_path, NO_REMEDY_LOAD, path, "plain", env=env_for(*paths, ATTNGUARD="0"))
    guarded = run_script(tmp_path, NO_REMEDY_LOAD, path, "guarded", env=env_for(*paths))
    assert plain.returncode == guarded.returncode == 0, guarded.stderr[-2000:]
    assert guarded.stderr == plain.stderr
    got, want = json.loads(guarded.stdout), json.loads(plain.stdout)
    assert got["logits"] == want["logits"]
    extra = set(got["modules"]) - set(want["modules"])
    assert extra <= {"attnguard", "_attnguard_hook", "wrapt"}, extra
    assert "attnguard" in extra  # the guard was on


def test_activated_once_per_process_and_again_only_for_new_settings(captured) -> None:
    attnguard.activate(log="none")
    attnguard.configure()  # the same settings
    attnguard.deactivate()
    attnguard.activate(log="none")  # again, the same
    assert names(captured, skip=()) == ["activated"]
    attnguard.configure(mode="warn")
    assert names(captured, skip=()) == ["activated", "activated"]
    assert captured[-1]["settings"]["mode"] == "warn" and captured[-1]["level"] == "info"


# --- helpers: DataLoader workers, tools run by a guarded program ---------------------------------

DATALOADER = """
import sys
import torch
import transformers  # a training script: the guard activates here (and in the workers)
from torch.utils.data import DataLoader, TensorDataset

if __name__ == "__main__":
    data = TensorDataset(torch.arange(32.0))
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="spawn")
    print("sum", sum(batch[0].sum().item() for batch in loader))
"""


def interpreters_own(stderr: str) -> list[str]:
    """stderr without multiprocessing's resource_tracker warnings ("leaked semaphore objects"),
    which a spawn DataLoader run prints now and then on a busy machine, guarded or not (seen in
    an unguarded run under CI load)."""
    return [line for line in stderr.splitlines() if "resource_tracker" not in line]


@needs_hook
def test_spawned_dataloader_workers_add_nothing(tmp_path: Path) -> None:
    plain = run_script(tmp_path, DATALOADER, env=env_for(ATTNGUARD="0"))
    guarded = run_script(tmp_path, DATALOADER, env=env_for(ATTNGUARD="1"))
    assert plain.returncode == guarded.returncode == 0, guarded.stderr
    assert guarded.stdout == plain.stdout == "sum 496.0\n"
    assert interpreters_own(guarded.stderr) == interpreters_own(plain.stderr)
    # every event in a file: one activation and one summary, both from the training process
    log = tmp_path / "ev-{rank}.jsonl"
    res = run_script(tmp_path, DATALOADER, env=env_for(ATTNGUARD="1", ATTNGUARD_LOG=str(log)))
    assert res.returncode == 0, res.stderr
    recs = json_lines((tmp_path / "ev-0.jsonl").read_text())
    assert [r["event"] for r in recs] == ["activated", "summary"]
    assert len({r["pid"] for r in recs}) == 1


TOOLS = """
import json, subprocess, sys
if sys.argv[1] == "guarded":
    import attnguard, transformers
pip = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True)
child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
print(json.dumps([pip.returncode, pip.stdout, pip.stderr, child.returncode, child.stdout,
                  child.stderr]))
"""


@needs_hook
def test_tools_run_by_a_guarded_program_print_what_they_print_unguarded(tmp_path: Path) -> None:
    """``pip --version`` and a python child, started by a guarded training script with
    ATTNGUARD=1 inherited and every event asked for on stderr."""
    plain = run_script(tmp_path, TOOLS, "plain", env=env_for(ATTNGUARD="0"))
    env = env_for(ATTNGUARD="1", ATTNGUARD_LOG_LEVEL="info", ATTNGUARD_LOG_FORMAT="json")
    guarded = run_script(tmp_path, TOOLS, "guarded", env=env)
    assert plain.returncode == guarded.returncode == 0, guarded.stderr
    tools_plain, tools_guarded = json.loads(plain.stdout), json.loads(guarded.stdout)
    assert tools_plain[0] == 0 and tools_plain[1].startswith("pip ")
    assert tools_plain[4] == "42\n"
    assert tools_guarded == tools_plain
    # the training script itself did announce itself (the setting took effect)
    assert [r["event"] for r in json_lines(guarded.stderr)] == ["activated", "summary"]


def test_a_forked_worker_is_a_helper(tmp_path: Path) -> None:
    """A fork of the guarded process (DataLoader's default start on Linux) is a helper: its
    events say ``helper: true`` (``attnguard summary`` counts them beside its rank's)."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    log = tmp_path / "ev.jsonl"
    attnguard.activate(log=str(log))
    pid = os.fork()
    if pid == 0:  # the worker: one intervention, then leave as multiprocessing does
        try:
            events.emit("qkv_unified", site="w", reason_code="mixed_dtypes", reason="x", applied=1)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    events.emit("qkv_unified", site="w", reason_code="mixed_dtypes", reason="x", applied=True)
    attnguard.deactivate()
    recs = json_lines(log.read_text())
    assert [(r["event"], r["pid"], r.get("helper")) for r in recs] == [
        ("activated", os.getpid(), None),
        ("qkv_unified", pid, True),
        ("qkv_unified", os.getpid(), None),
    ]
    from attnguard.observability import eventfiles

    merged = eventfiles.merge_records(recs)
    assert merged["applied"] == 2  # the worker's and the main process's, not max() of them


def test_a_fork_while_another_thread_emits_does_not_hang(tmp_path: Path) -> None:
    """DataLoader forks its workers while other threads may be inside attnguard (holding its
    locks); the worker must still be able to emit and exit."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    import signal
    import time

    attnguard.activate(log=str(tmp_path / "ev.jsonl"))
    with events._state.lock, events._state.streams[0]._lock:  # "another thread" mid-emit
        pid = os.fork()
        if pid == 0:
            try:
                events.emit(
                    "qkv_unified", site="w", reason_code="mixed_dtypes", reason="x", applied=True
                )
            finally:
                os._exit(0)
    for _ in range(600):  # a hang detector, not a timing check: up to a minute
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked worker hung on a lock held at fork time")
    attnguard.deactivate()
    assert os.WEXITSTATUS(status) == 0
    assert [r["pid"] for r in json_lines((tmp_path / "ev.jsonl").read_text())][-1] == pid


# --- torchrun: console ranks, one summary per job -------------------------------------------------

WORKER = """
import sys
import attnguard
import torch.distributed as dist
from transformers import LlamaForCausalLM

if sys.argv[2] == "group":
    dist.init_process_group("gloo")
# flash-attn is not installed: attnguard loads with sdpa (backend_fallback) on every rank
LlamaForCausalLM.from_pretrained(sys.argv[1], attn_implementation="flash_attention_2")
if sys.argv[2] == "group":
    dist.barrier()
print("rank done")
"""


def _torchrun(
    tmp_path: Path, checkpoint: Path, group: str, **settings: str
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [str(script), str(checkpoint), group]
    env = env_for(ATTNGUARD_LOG_FORMAT="json", OMP_NUM_THREADS="1", **settings)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert res.stdout.count("rank done") == 2
    return res


def test_torchrun_console_ranks_and_one_job_summary_without_a_process_group(
    tmp_path: Path, tiny_checkpoint
) -> None:
    logs = tmp_path / "logs"
    res = _torchrun(
        tmp_path,
        tiny_checkpoint("llama"),
        "none",
        ATTNGUARD_LOG=f"stderr,{logs}/events-{{rank}}.jsonl",
        ATTNGUARD_CONSOLE_RANKS="0",
    )
    console = json_lines(res.stderr)
    assert {r["rank"] for r in console} == {0}  # rank 1's lines stay off the console
    assert [r["event"] for r in console] == ["backend_fallback", "summary"]
    job = console[-1]
    # torchrun's own store carries the ranks' records where the script made no process group
    assert (job["site"], job["gathered_by"], job["ranks"], job["missing_ranks"]) == (
        "job",
        "launcher_store",
        [0, 1],
        [],
    )
    assert (job["applied"], job["would_have"]) == (2, 0)
    assert job["reason"].startswith("2 change(s) applied by attnguard over 2 of 2 ranks")
    # every rank's events in its own file; the job's summary once, in rank 0's
    per_rank = {r: json_lines((logs / f"events-{r}.jsonl").read_text()) for r in (0, 1)}
    assert [e["event"] for e in per_rank[0]] == ["activated", "backend_fallback", "summary"]
    assert [e["event"] for e in per_rank[1]] == ["activated", "backend_fallback"]
    assert [p.name for p in logs.iterdir() if p.name.startswith(".")] == []  # rendezvous gone


def test_torchrun_with_a_process_group_still_one_summary(tmp_path: Path, tiny_checkpoint) -> None:
    res = _torchrun(tmp_path, tiny_checkpoint("llama"), "group")
    console = json_lines(res.stderr)
    assert sorted(r["rank"] for r in console if r["event"] == "backend_fallback") == [0, 1]
    (job,) = [r for r in console if r["event"] == "summary"]
    assert (job["rank"], job["site"], job["gathered_by"], job["ranks"]) == (
        0,
        "job",
        "process_group",
        [0, 1],
    )
    assert job["applied"] == 2 and job["level"] == "warning"
