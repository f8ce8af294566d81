"""One story across ranks: cross-rank aggregation at exit and ``attnguard summary FILES``.

Real processes throughout: per-rank files come from child processes launched with the
environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE), and the exit aggregation
runs over a real torch.distributed gloo group of two processes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from helpers.processes import PY, free_port, subprocess_env

from attnguard.observability import eventfiles, events, summary
from attnguard.observability.advice import Facts
from attnguard.observability.eventfiles import Key

# A worker: activates attnguard from the environment, emits what its rank would see, exits.
WORKER = """
import os, sys, time
import attnguard
from attnguard.observability import events, summary

summary.GATHER_TIMEOUT_S = float(os.environ.get("GATHER_TIMEOUT", "10"))
rank = int(os.environ["RANK"])
mode = sys.argv[1]
if mode != "nodist":
    import torch.distributed as dist
    dist.init_process_group("gloo")
guarded = attnguard.settings().enabled
for _ in range(rank + 2 if guarded else 0):
    events.emit("device_map_rewritten", site="transformers.load", reason_code="device_map_per_rank",
                reason="one replica per rank", applied=True)
if rank == 1 and guarded:
    for _ in range(5):
        events.emit("tensors_aligned", site="rotary:Qwen2_5_VLRotaryEmbedding",
                    reason_code="rotary_device_mismatch", reason="moved position_ids", applied=True)
    events.emit("backend_fallback", site="transformers.load", reason_code="package_missing",
                reason="flash-attn is not installed", applied=True)
if mode == "nodist":  # what a job's collectives do: rank 0 ends after rank 1 did its work
    flag = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank1-worked")
    if rank == 1:
        open(flag, "w").close()
    else:
        while not os.path.exists(flag):
            time.sleep(0.01)
if mode == "barrier":
    dist.barrier()
if mode == "destroy":
    dist.barrier()
    dist.destroy_process_group()
if mode == "finish_destroy":  # the OpenTelemetry recipe, then the usual ending, on every rank
    flag = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank1-ended")
    while rank == 0 and not os.path.exists(flag):
        time.sleep(0.01)  # rank 0 is the slower one (it saves the checkpoint)
    attnguard.finish()
    dist.destroy_process_group()
    if rank == 1:
        open(flag, "w").close()
"""


def _launch(
    tmp_path: Path,
    mode: str,
    *,
    rank1_guarded: bool = True,
    timeout: str = "10",
    identity: bool = True,
) -> None:
    """Two workers as torchrun starts them (same env variables), ATTNGUARD_LOG per rank."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
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
        if not identity:
            del env["MASTER_PORT"], env["MASTER_ADDR"]
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


def _key(event: str, site: str, reason: str, n: int, kind: str = "applied") -> Key:
    return Key(event, site, reason, n, {**dict.fromkeys(events.KINDS, 0), kind: n})


def test_aggregate_sums_counts_and_names_the_ranks() -> None:
    rank0 = summary.RankRecord(
        "aa" * 8, [_key("device_map_rewritten", "transformers.load", "device_map_per_rank", 2)]
    )
    rank1 = summary.RankRecord(
        "bb" * 8,
        [
            _key("device_map_rewritten", "transformers.load", "device_map_per_rank", 3),
            _key("tensors_aligned", "rotary:X", "r", 5, "would_have"),
        ],
    )
    agg = summary.aggregate({1: rank1, 0: rank0})
    assert agg["ranks"] == [0, 1]
    assert (agg["applied"], agg["would_have"], agg["observed"]) == (5, 5, 0)
    assert agg["events"] == {"device_map_rewritten": 5, "tensors_aligned": 5}
    assert agg["event_ranks"] == {"device_map_rewritten": [0, 1], "tensors_aligned": [1]}
    assert agg["reason_ranks"]["tensors_aligned:r"] == [1]
    assert agg["sites"]["device_map_rewritten"] == ["transformers.load"]
    assert agg["per_rank"]["0"] == {
        "applied": 2,
        "would_have": 0,
        "observed": 0,
        "internal_errors": 0,
    }
    assert agg["per_rank"]["1"]["would_have"] == 5
    assert agg["rank_procs"] == {"0": "aa" * 8, "1": "bb" * 8}
    key = next(k for k in agg["keys"] if k["event"] == "tensors_aligned")
    assert (key["count"], key["ranks"]) == (5, {"1": 5})
    assert (key["applied"], key["would_have"]) == (0, 5)
    assert summary.aggregate({})["ranks"] == []


def test_every_hint_names_a_change_in_user_code() -> None:
    h100 = Facts(device="cuda", capability=(9, 0), twin_calls=True)
    assert summary.hint_for("backend_fallback", "package_missing", h100).startswith(
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
    # no process group: the ranks met through files; rank 0 wrote the job's summary
    assert [s["site"] for s in _summaries(files[0])] == ["job"]
    assert _summaries(files[1]) == []
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
    assert rows[("device_map_rewritten", "device_map_per_rank")]["applied"] == 5
    assert rows[("device_map_rewritten", "device_map_per_rank")]["ranks"] == [0, 1]
    assert rows[("tensors_aligned", "rotary_device_mismatch")]["count"] == 5
    assert rows[("tensors_aligned", "rotary_device_mismatch")]["ranks"] == [1]
    assert rows[("tensors_aligned", "rotary_device_mismatch")]["sites"] == [
        "rotary:Qwen2_5_VLRotaryEmbedding"
    ]
    assert rows[("backend_fallback", "package_missing")]["hint"].startswith("install flash-attn")
    assert report["ranks"] == [0, 1] and report["applied"] == 11 and report["would_have"] == 0
    assert report["malformed_lines"] == {str(files[1]): 3}

    text = subprocess.run(
        [PY, "-m", "attnguard", "summary", *map(str, files), str(tmp_path / "missing.jsonl")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert text.startswith("attnguard summary: 3 file(s)")
    assert "ranks 0-1: 11 change(s) applied by attnguard in these files" in text
    assert f"skipped 3 malformed line(s) in {files[1]}" in text
    assert "could not read" in text and "missing.jsonl" in text
    table = {" ".join(ln.split()[:2]): ln.split() for ln in text.splitlines() if ln.strip()}
    # count, applied, would_have, ranks
    assert table["tensors_aligned rotary_device_mismatch"][2:6] == ["5", "5", "0", "1"]
    assert table["device_map_rewritten device_map_per_rank"][2:6] == ["5", "5", "0", "0-1"]
    assert 'device_map_per_rank: under torchrun load with device_map={"": local_rank}' in text


def test_summary_command_without_readable_input_fails(tmp_path: Path) -> None:
    res = subprocess.run(
        [PY, "-m", "attnguard", "summary", str(tmp_path / "missing.jsonl")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode != 0 and res.stdout == ""
    assert res.stderr.strip() == (
        f"attnguard summary: no readable input ({tmp_path / 'missing.jsonl'}: "
        "FileNotFoundError: No such file or directory)"
    )
    res = subprocess.run(
        [PY, "-m", "attnguard", "summary", str(tmp_path)],
        env=subprocess_env(),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 2 and "a directory, not a regular file" in res.stderr


def test_attnguard_version() -> None:
    import attnguard

    res = subprocess.run(
        [PY, "-m", "attnguard", "--version"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    assert res.stdout.strip() == f"attnguard {attnguard.__version__}"


def test_warn_mode_files_report_would_have_not_changes(tmp_path: Path) -> None:
    """Event lines say ``applied: false`` in warn mode; the merged report counts them apart."""
    lines = [
        {"event": "activated", "rank": 0, "mode": "warn"},
        {
            "event": "backend_fallback",
            "rank": 0,
            "mode": "warn",
            "site": "transformers.load",
            "reason_code": "package_missing",
            "count": 1,
            "applied": False,
        },
        {"event": "observed", "rank": 0, "site": "s", "reason_code": "zero3_init", "count": 1},
    ]
    path = tmp_path / "events-0.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    report = json.loads(eventfiles.render_files([str(path)], as_json=True))
    assert (report["applied"], report["would_have"], report["observed"]) == (0, 1, 1)
    text = eventfiles.render_files([str(path)], as_json=False)
    assert "0 change(s) applied by attnguard in these files; 1 more it would have applied" in text
    assert "intervention" not in text


def test_summary_of_files_without_interventions(tmp_path: Path) -> None:
    path = tmp_path / "quiet.jsonl"
    path.write_text(json.dumps({"event": "activated", "rank": 0}) + "\n")
    text = eventfiles.render_files([str(path)], as_json=False)
    assert "nothing to change" in text and "0 change(s) applied" in text


# --- exit summary over a live process group, or files --------------------------------------------


def test_rank0_emits_one_summary_for_the_whole_job(tmp_path: Path) -> None:
    _launch(tmp_path, "barrier")
    (job,) = _summaries(tmp_path / "events-0.jsonl")
    assert _summaries(tmp_path / "events-1.jsonl") == []  # its counts are in rank 0's summary
    assert job["site"] == "job" and job["reason_code"] == "exit_all_ranks"
    assert job["gathered_by"] == "process_group"
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == []
    assert job["events"] == {"device_map_rewritten": 5, "tensors_aligned": 5, "backend_fallback": 1}
    assert job["event_ranks"]["device_map_rewritten"] == [0, 1]
    assert job["event_ranks"]["tensors_aligned"] == [1]
    assert job["applied"] == 11 and job["level"] == "warning"
    assert {r: n["applied"] for r, n in job["per_rank"].items()} == {"0": 2, "1": 9}
    assert job["reason"].startswith("11 change(s) applied by attnguard over 2 of 2 ranks")
    # and the files merge to the same story
    report = json.loads(
        eventfiles.render_files(
            [str(tmp_path / "events-0.jsonl"), str(tmp_path / "events-1.jsonl")], as_json=True
        )
    )
    assert report["applied"] == 11 and report["job_summaries"] == 1


def test_destroyed_process_group_still_gives_one_job_summary(tmp_path: Path) -> None:
    """The group's store is kept past ``destroy_process_group()``: the records travel through it
    as through a live group's."""
    _launch(tmp_path, "destroy")
    (job,) = _summaries(tmp_path / "events-0.jsonl")
    assert _summaries(tmp_path / "events-1.jsonl") == []
    assert job["site"] == "job" and job["gathered_by"] == "process_group"
    assert job["as_of_group_end"] == [] and job["missing_ranks"] == []
    assert job["ranks"] == [0, 1] and job["applied"] == 11
    # the rendezvous directory is gone again
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".attnguard")] == []


def test_finish_then_destroy_keeps_the_exit_record_and_waits_for_nothing(tmp_path: Path) -> None:
    """Every rank calls ``attnguard.finish()``, then ``dist.destroy_process_group()``: rank 1's
    destroy used to overwrite the exit record its ``finish()`` had just posted with the record of
    its group's end, so rank 0 waited its whole deadline and said rank 1 was "counted as of
    their destroy_process_group(): no exit report". A posted exit record stands."""
    _launch(tmp_path, "finish_destroy", timeout="30")
    (job,) = _summaries(tmp_path / "events-0.jsonl")
    assert _summaries(tmp_path / "events-1.jsonl") == []
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == []
    assert job["as_of_group_end"] == []
    assert job["applied"] == 11
    assert job["reason"].startswith("11 change(s) applied by attnguard over 2 of 2 ranks")
    assert "no report" not in job["reason"] and "destroy_process_group" not in job["reason"]
    assert job["waited_s"] < 30  # it never ran into its deadline


def test_a_rank_that_never_reports_is_named_not_waited_for(tmp_path: Path) -> None:
    _launch(tmp_path, "barrier", rank1_guarded=False, timeout="1")
    assert not (tmp_path / "events-1.jsonl").exists()
    (job,) = _summaries(tmp_path / "events-0.jsonl")
    assert job["ranks"] == [0] and job["missing_ranks"] == [1] and job["silent_ranks"] == [1]
    assert "rank(s) 1: no report reached rank 0, nor word of any event" in job["reason"]


def test_without_a_job_identity_rank0_says_why_it_has_no_job_summary(tmp_path: Path) -> None:
    """WORLD_SIZE=2 but nothing that tells this job apart from another (no launcher): no
    rendezvous, no wait; each rank its own summary, rank 0's saying why."""
    _launch(tmp_path, "nodist", identity=False)
    (own0,) = _summaries(tmp_path / "events-0.jsonl")
    (own1,) = _summaries(tmp_path / "events-1.jsonl")
    assert own0["site"] == own1["site"] == "process"
    assert (own0["applied"], own1["applied"]) == (2, 9)
    why = "no job-wide summary: no process group at exit and the launcher set neither"
    assert why in own0["reason"]


def test_every_change_the_guard_makes_has_a_hint() -> None:
    """Each reason code of a change (not an observation) says what to change in your own code
    (the vocabulary's completeness against the code is tests/test_vocabulary.py)."""
    from attnguard.observability.reasons import REASONS

    changes = ("observed", "activated", "summary")
    missing = [
        r.code
        for r in REASONS.values()
        if any(e not in changes for e in r.events) and not summary.hint_for(r.events[0], r.code)
    ]
    assert missing == []
