"""One story across ranks: cross-rank aggregation at exit and ``attnguard summary FILES``.

Real processes throughout: per-rank files come from child processes launched with the
environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE), and the exit aggregation
runs over a real torch.distributed gloo group of two processes.
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

from conftest import PY, subprocess_env

from attnguard import summary

# A worker: activates attnguard from the environment, emits what its rank would see, exits.
WORKER = """
import os, sys
import attnguard
from attnguard import events, summary

summary.GATHER_TIMEOUT_S = float(os.environ.get("GATHER_TIMEOUT", "10"))
rank = int(os.environ["RANK"])
mode = sys.argv[1]
if mode != "nodist":
    import torch.distributed as dist
    dist.init_process_group("gloo")
guarded = attnguard.settings().enabled
for _ in range(rank + 2 if guarded else 0):
    events.emit("device_map_rewritten", site="transformers.load", reason_code="device_map_per_rank",
                reason="one replica per rank")
if rank == 1 and guarded:
    for _ in range(5):
        events.emit("tensors_aligned", site="rotary:Qwen2_5_VLRotaryEmbedding",
                    reason_code="rotary_device_mismatch", reason="moved position_ids")
    events.emit("backend_fallback", site="transformers.load", reason_code="package_missing",
                reason="flash-attn is not installed")
if mode == "barrier":
    dist.barrier()
if mode == "destroy":
    dist.barrier()
    dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path: Path, mode: str, *, rank1_guarded: bool = True, timeout: str = "10") -> None:
    """Two workers as torchrun starts them (same env variables), ATTNGUARD_LOG per rank."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = subprocess_env(
            ATTNGUARD="1" if rank == 0 or rank1_guarded else "0",
            ATTNGUARD_LOG=str(tmp_path / "events-{rank}.jsonl"),
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            GATHER_TIMEOUT=timeout,
        )
        procs.append(
            subprocess.Popen(
                [PY, str(script), mode], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
            )
        )
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode(errors="replace")[-3000:]


def _read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _summaries(path: Path) -> list[dict[str, Any]]:
    return [e for e in _read(path) if e["event"] == "summary"]


# --- aggregate -----------------------------------------------------------------------------------


def test_aggregate_sums_counts_and_names_the_ranks() -> None:
    rank0 = {
        "interventions": 2,
        "events": {"device_map_rewritten": 2},
        "reasons": {"device_map_rewritten:device_map_per_rank": 2},
        "sites": {"device_map_rewritten": ["transformers.load"]},
    }
    rank1 = {
        "interventions": 8,
        "events": {"device_map_rewritten": 3, "tensors_aligned": 5},
        "reasons": {
            "device_map_rewritten:device_map_per_rank": 3,
            "tensors_aligned:rotary_device_mismatch": 5,
        },
        "sites": {"device_map_rewritten": ["transformers.load"], "tensors_aligned": ["rotary:X"]},
        "keys": [{"event": "tensors_aligned", "site": "rotary:X", "reason_code": "r", "count": 5}],
    }
    agg = summary.aggregate({1: rank1, 0: rank0})
    assert agg["ranks"] == [0, 1]
    assert agg["interventions"] == 10
    assert agg["events"] == {"device_map_rewritten": 5, "tensors_aligned": 5}
    assert agg["event_ranks"] == {"device_map_rewritten": [0, 1], "tensors_aligned": [1]}
    assert agg["reason_ranks"]["tensors_aligned:rotary_device_mismatch"] == [1]
    assert agg["sites"]["device_map_rewritten"] == ["transformers.load"]
    assert agg["per_rank"] == {"0": 2, "1": 8}
    assert agg["keys"] == [
        {
            "event": "tensors_aligned",
            "site": "rotary:X",
            "reason_code": "r",
            "count": 5,
            "ranks": {"1": 5},
        }
    ]
    assert summary.aggregate({})["ranks"] == []


def test_every_hint_names_a_change_in_user_code() -> None:
    assert summary.hint_for("backend_fallback", "package_missing").startswith(
        'install flash-attn for this torch and GPU, or request attn_implementation="sdpa"'
    )
    assert "bfloat16" in summary.hint_for("model_cast", "flash_needs_half")
    assert summary.hint_for("device_map_rewritten", "device_map_per_rank") == (
        'under torchrun load with device_map={"": local_rank}'
    )
    # an unknown code still gets the rule for its words, then the event's default
    assert "bfloat16" in summary.hint_for("model_cast", "flash_needs_half_not_fp32")
    assert summary.hint_for("qkv_unified", "zzz") == summary.EVENT_HINTS["qkv_unified"]
    assert summary.hint_for("made_up_event", None) == ""


# --- per-rank files merged after the fact --------------------------------------------------------


def test_summary_command_merges_per_rank_files(tmp_path: Path) -> None:
    _launch(tmp_path, "nodist")
    files = [tmp_path / "events-0.jsonl", tmp_path / "events-1.jsonl"]
    # no process group: each rank wrote its own summary
    assert [s["site"] for s in _summaries(files[0])] == ["process"]
    assert [s["site"] for s in _summaries(files[1])] == ["process"]
    with files[1].open("a") as fh:
        fh.write('not json at all\n[1, 2]\n{"no_event": true}\n')
    res = subprocess.run(
        [PY, "-m", "attnguard", "summary", *map(str, files), "--json"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(res.stdout)
    rows = {(r["event"], r["reason_code"]): r for r in report["rows"]}
    assert set(rows) == {
        ("device_map_rewritten", "device_map_per_rank"),
        ("tensors_aligned", "rotary_device_mismatch"),
        ("backend_fallback", "package_missing"),
    }
    # rank 0 rewrote twice, rank 1 three times: the summaries' counts, not the one line each
    assert rows[("device_map_rewritten", "device_map_per_rank")]["count"] == 5
    assert rows[("device_map_rewritten", "device_map_per_rank")]["ranks"] == [0, 1]
    assert rows[("tensors_aligned", "rotary_device_mismatch")]["count"] == 5
    assert rows[("tensors_aligned", "rotary_device_mismatch")]["ranks"] == [1]
    assert rows[("tensors_aligned", "rotary_device_mismatch")]["sites"] == [
        "rotary:Qwen2_5_VLRotaryEmbedding"
    ]
    assert rows[("backend_fallback", "package_missing")]["hint"].startswith("install flash-attn")
    assert report["ranks"] == [0, 1] and report["interventions"] == 11
    assert report["malformed_lines"] == {str(files[1]): 3}

    text = subprocess.run(
        [PY, "-m", "attnguard", "summary", *map(str, files), str(tmp_path / "missing.jsonl")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert text.startswith("attnguard summary: 3 file(s)")
    assert "ranks 0-1, 11 intervention(s)" in text
    assert f"skipped 3 malformed line(s) in {files[1]}" in text
    assert "could not read" in text and "missing.jsonl" in text
    table = {" ".join(ln.split()[:2]): ln.split() for ln in text.splitlines() if ln.strip()}
    assert table["tensors_aligned rotary_device_mismatch"][2:4] == ["5", "1"]
    assert table["device_map_rewritten device_map_per_rank"][2:4] == ["5", "0-1"]
    assert 'device_map_per_rank: under torchrun load with device_map={"": local_rank}' in text


def test_summary_of_files_without_interventions(tmp_path: Path) -> None:
    path = tmp_path / "quiet.jsonl"
    path.write_text(json.dumps({"event": "activated", "rank": 0}) + "\n")
    text = summary.render_files([str(path)], as_json=False)
    assert "nothing to change" in text and "0 intervention(s)" in text


# --- exit summary over a live process group ------------------------------------------------------


def test_rank0_emits_one_summary_for_the_whole_job(tmp_path: Path) -> None:
    _launch(tmp_path, "barrier")
    (job,) = _summaries(tmp_path / "events-0.jsonl")
    assert _summaries(tmp_path / "events-1.jsonl") == []  # its counts are in rank 0's summary
    assert job["site"] == "job" and job["reason_code"] == "exit_all_ranks"
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == []
    assert job["events"] == {"device_map_rewritten": 5, "tensors_aligned": 5, "backend_fallback": 1}
    assert job["event_ranks"]["device_map_rewritten"] == [0, 1]
    assert job["event_ranks"]["tensors_aligned"] == [1]
    assert job["interventions"] == 11 and job["per_rank"] == {"0": 2, "1": 9}
    assert "11 intervention(s) by attnguard over 2 of 2 ranks" in job["reason"]
    # and the files merge to the same story
    report = json.loads(
        summary.render_files(
            [str(tmp_path / "events-0.jsonl"), str(tmp_path / "events-1.jsonl")], as_json=True
        )
    )
    assert report["interventions"] == 11 and report["job_summaries"] == 1


def test_destroyed_process_group_falls_back_to_per_rank_summaries(tmp_path: Path) -> None:
    _launch(tmp_path, "destroy")
    for rank, expected in ((0, 2), (1, 9)):
        (own,) = _summaries(tmp_path / f"events-{rank}.jsonl")
        assert own["site"] == "process" and own["interventions"] == expected


def test_a_rank_that_never_reports_is_named_not_waited_for(tmp_path: Path) -> None:
    _launch(tmp_path, "barrier", rank1_guarded=False, timeout="1")
    assert not (tmp_path / "events-1.jsonl").exists()
    (job,) = _summaries(tmp_path / "events-0.jsonl")
    assert job["ranks"] == [0] and job["missing_ranks"] == [1]
    assert "no report from rank(s) 1" in job["reason"]


def test_every_reason_code_the_guard_emits_has_its_own_hint() -> None:
    """Codes are read from the modules that emit them: a new code without a hint fails here."""
    from attnguard import callguard, facts, plan

    codes = {
        facts.PACKAGE_MISSING,
        facts.EXTENSION_BROKEN,
        facts.NO_CUDA,
        facts.CAPABILITY_TOO_LOW,
        facts.VERSION_TOO_OLD,
        facts.PROBE_FAILED,
        facts.TORCH_TOO_OLD,
    }
    codes |= {r.reason_code for r in plan.TABLE if r.remedy and not r.reason_code.startswith("<")}
    codes |= {code for _, code in callguard.KNOWN_KERNEL_ERRORS}
    codes |= set(callguard._REROUTE_REASONS) | set(callguard._DIRECT_REROUTE_REASONS)
    codes |= {"mixed_dtypes", "mask_dtype", "bias_dtype", "fp32_into_flash", "device_mismatch"}
    codes |= {"device_map_per_rank", "device_map_shared_gpus", "device_map_gpu_slice"}
    codes |= {"rotary_device_mismatch", "plan_mismatch"}
    assert sorted(c for c in codes if c not in summary.HINTS) == []
