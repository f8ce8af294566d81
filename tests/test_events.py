"""Event schema, sinks, de-duplication, rank fields and the exit summary."""

from __future__ import annotations

import json
import logging
import subprocess
import threading
from pathlib import Path

import pytest
import structlog
from helpers.events import FIXED
from helpers.processes import PY, subprocess_env

import attnguard
from attnguard.observability import events


def test_every_event_carries_the_fixed_fields(guard, captured) -> None:
    events.emit(
        "backend_fallback", site="s", reason_code="package_missing", reason="why", requested="x"
    )
    ev = captured[-1]
    assert list(ev)[: len(FIXED)] == FIXED
    assert ev["schema"] == events.SCHEMA and ev["event"] == "backend_fallback"
    assert ev["level"] == "warning" and ev["mode"] == "fix" and ev["count"] == 1
    assert ev["ts"].endswith("Z") or ev["ts"].endswith("+00:00")
    assert ev["requested"] == "x"


def test_unknown_event_name_is_refused(guard) -> None:
    with pytest.raises(ValueError, match="unknown event 'fixed_it'; valid events: activated"):
        events.emit("fixed_it")


def test_activated_lists_versions_and_settings(captured) -> None:
    attnguard.activate(log="none", mode="warn")
    (ev,) = [e for e in captured if e["event"] == "activated"]
    assert set(ev["versions"]) >= {"python", "torch", "transformers", "flash-attn", "xformers"}
    assert ev["versions"]["torch"] is not None
    assert ev["settings"]["mode"] == "warn" and ev["mode"] == "warn"


def test_rank_fields_come_from_the_launcher_environment(guard, captured, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "8")
    events.emit("observed", site="s", reason_code="package_missing", reason="x")
    assert {k: captured[-1][k] for k in ("rank", "local_rank", "world_size")} == {
        "rank": 5,
        "local_rank": 1,
        "world_size": 8,
    }


def test_dedupe_counts_are_exact_under_8_threads(guard, captured) -> None:
    start = threading.Barrier(8)

    def hit() -> None:
        start.wait()
        for _ in range(1000):
            events.emit("qkv_unified", site="layer", reason_code="mixed_dtypes", reason="x")

    threads = [threading.Thread(target=hit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emitted = [e for e in captured if e["event"] == "qkv_unified"]
    assert len(emitted) == 1 and emitted[0]["count"] == 1
    assert events.counts()[("qkv_unified", "layer", "mixed_dtypes")] == 8000
    assert events.summary_fields()["events"] == {"qkv_unified": 8000}


def test_stdlib_logger_gets_each_field_as_an_attribute(guard) -> None:
    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    handler = Keep()
    logging.getLogger("attnguard").addHandler(handler)
    try:
        events.emit(
            "model_cast", site="s", reason_code="flash_needs_half", reason="cast", to="bf16"
        )
    finally:
        logging.getLogger("attnguard").removeHandler(handler)
    (rec,) = got
    assert rec.levelno == logging.WARNING
    assert rec.event == "model_cast" and rec.reason_code == "flash_needs_half" and rec.to == "bf16"
    assert rec.getMessage() == "model_cast: cast"


def test_attnguard_leaves_global_logging_alone() -> None:
    before = structlog.get_config()
    root_handlers = list(logging.getLogger().handlers)
    attnguard.activate(log="none")
    events.emit("observed", site="s", reason_code="package_missing", reason="x")
    assert structlog.get_config() == before
    assert logging.getLogger().handlers == root_handlers


def test_json_file_sink_per_rank_parses_line_by_line(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RANK", "3")
    attnguard.activate(log=str(tmp_path / "ev-{rank}.jsonl"))
    events.emit("backend_fallback", site="a", reason_code="package_missing", reason="because")
    events.emit("backend_fallback", site="a", reason_code="package_missing", reason="because")
    events.emit("tensors_aligned", site="b", reason_code="device_mismatch", reason="moved")
    attnguard.deactivate()  # closes the file
    lines = (tmp_path / "ev-3.jsonl").read_text().splitlines()
    parsed = [json.loads(line) for line in lines]
    assert [p["event"] for p in parsed] == ["activated", "backend_fallback", "tensors_aligned"]
    assert all(p["rank"] == 3 for p in parsed)


def test_console_format_puts_the_reason_first() -> None:
    line = events.render_console(
        {
            "event": "backend_fallback",
            "level": "warning",
            "reason": "flash-attn missing",
            "site": "transformers.load",
            "count": 1,
            "selected": "sdpa",
        }
    )
    assert line.startswith("attnguard WARNING: flash-attn missing [backend_fallback")
    assert "selected=sdpa" in line and "\n" not in line


def test_summary_at_exit_in_a_fresh_process(tmp_path: Path) -> None:
    log = tmp_path / "ev.jsonl"
    code = (
        "import attnguard\n"
        "from attnguard.observability import events\n"
        "for _ in range(3):\n"
        "    events.emit('qkv_unified', site='s', reason_code='mixed_dtypes', reason='x',"
        " applied=True)\n"
        "events.emit('backend_fallback', site='t', reason_code='package_missing', reason='y',"
        " applied=True)\n"
        "events.emit('observed', site='u', reason_code='zero3_init', reason='z')\n"
    )
    subprocess.run([PY, "-c", code], env=subprocess_env(ATTNGUARD_LOG=str(log)), check=True)
    parsed = [json.loads(x) for x in log.read_text().splitlines()]
    summary = parsed[-1]
    assert summary["event"] == "summary" and summary["site"] == "process"
    assert summary["level"] == "warning"  # it reports applied changes
    assert summary["events"] == {"qkv_unified": 3, "backend_fallback": 1, "observed": 1}
    assert summary["reasons"] == {
        "qkv_unified:mixed_dtypes": 3,
        "backend_fallback:package_missing": 1,
        "observed:zero3_init": 1,
    }
    assert (summary["applied"], summary["would_have"], summary["observed"]) == (4, 0, 1)
    assert summary["internal_errors"] == 0
    # reads like a report: what changed, how often, why, and what to change in your own code
    assert [(a["event"], a["count"], a["applied"]) for a in summary["advice"]] == [
        ("qkv_unified", 3, 3),
        ("backend_fallback", 1, 1),
    ]
    assert summary["advice"][0]["hint"] == "cast q, k, v to one dtype before the attention call"
    assert summary["reason"].startswith(
        "4 change(s) applied by attnguard in this process; 1 observation(s) without a change. "
        "To no longer need the guard: qkv_unified x3 (mixed_dtypes)"
    )
    assert "backend_fallback x1 (package_missing): install flash-attn" in summary["reason"]


def test_warn_mode_summary_says_nothing_was_applied(tmp_path: Path) -> None:
    """Warn mode changes nothing: the summary counts "would have", not changes, and stays INFO."""
    log = tmp_path / "ev.jsonl"
    code = (
        "import attnguard\n"
        "from attnguard.observability import events\n"
        "for _ in range(2):\n"
        "    events.emit('backend_fallback', site='t', reason_code='package_missing', reason='y',"
        " applied=False)\n"
    )
    env = subprocess_env(ATTNGUARD_LOG=str(log), ATTNGUARD_MODE="warn")
    subprocess.run([PY, "-c", code], env=env, check=True)
    summary = [json.loads(x) for x in log.read_text().splitlines()][-1]
    assert summary["event"] == "summary" and summary["level"] == "info"
    assert (summary["applied"], summary["would_have"], summary["observed"]) == (0, 2, 0)
    assert summary["reason"].startswith(
        "0 change(s) applied by attnguard in this process; 2 more it would have applied in fix "
        "mode (not applied). To no longer need the guard: backend_fallback x2 not applied"
    )
    assert "intervention" not in summary["reason"]


def test_every_call_is_counted_and_only_the_first_is_emitted(guard, captured) -> None:
    """What the call-time guard does for a rerouted site: one emit per call."""
    for applied in (True, True, False):
        events.emit(
            "backend_rerouted", site="f", reason_code="mask_4d", reason="r", applied=applied
        )
    assert [e["count"] for e in captured if e["event"] == "backend_rerouted"] == [1]
    assert events.kind_counts()[("backend_rerouted", "f", "mask_4d")] == {
        "applied": 2,
        "would_have": 1,
        "observed": 0,
        "internal_errors": 0,
    }
