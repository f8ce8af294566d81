"""Observability hand-off, the lines attnguard writes: JSON lines for pandas / jq / json.loads, the
Vector, Datadog and Loki recipes of docs/observability.md fed those lines, and console lines —
each checked with the real library, as the page says (OpenTelemetry and Python logging:
tests/test_observability.py).

The optional libraries (pandas, jq) come with the ``test`` extra. Without them these
tests skip locally; under CI (``CI`` set) a missing one is an import error, so a broken install
step cannot turn the checks into silent skips.
"""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.events import FIXED, OTEL_CASES
from helpers.packages import require
from helpers.processes import REPO

import attnguard
from attnguard.failopen import report_internal_error
from attnguard.observability import events, summary

DOC = REPO / "docs" / "observability.md"


# --- JSON lines: pandas, jq, json.loads ----------------------------------------------------------


@pytest.fixture
def jsonl_log(tmp_path: Path, launcher_env) -> Iterator[Path]:
    """attnguard writing JSON lines to tmp/ev-{rank}.jsonl; yields the file rank 1 writes.

    The test calls ``close_log()`` (log="none" closes the file) before reading it.
    """
    attnguard.activate(log=str(tmp_path / "ev-{rank}.jsonl"))
    yield tmp_path / f"ev-{launcher_env['rank']}.jsonl"
    close_log()


def close_log() -> None:
    attnguard.activate(log="none")


def _emit_a_run() -> None:
    """What a small guarded run writes: a fallback (twice), an alignment with list and dict
    fields, an observation, an internal error with a two-line message, and the summary."""
    fb = OTEL_CASES[0][3]
    events.emit("backend_fallback", **fb)
    events.emit("backend_fallback", **fb)
    events.emit(
        "tensors_aligned",
        site="rotary:LlamaRotaryEmbedding",
        reason_code="rotary_device_mismatch",
        reason="LlamaRotaryEmbedding got inputs on cuda:1 but inv_freq on cuda:0; moved them",
        moved=["inv_freq", "position_ids"],
        before={"inv_freq": "cuda:0", "position_ids": "cuda:0"},
        target="cuda:1",
        applied=True,
    )
    events.emit("observed", **OTEL_CASES[1][3])
    report_internal_error("xformers.memory_efficient_attention", ValueError("bad\nsecond line"))
    summary.emit_exit_summary()


def test_jsonl_loads_in_pandas_without_post_processing(jsonl_log: Path) -> None:
    pd = require("pandas")
    _emit_a_run()
    close_log()
    df = pd.read_json(jsonl_log, lines=True)
    assert set(FIXED) <= set(df.columns)
    assert list(df["event"]) == [
        "activated",
        "backend_fallback",
        "tensors_aligned",
        "observed",
        "internal_error",
        "summary",
    ]
    for col in ("schema", "pid", "rank", "local_rank", "world_size", "count"):
        assert pd.api.types.is_integer_dtype(df[col]), (col, df[col].dtype)
    assert set(df["rank"]) == {1} and set(df["world_size"]) == {2}
    ts = pd.to_datetime(df["ts"], utc=True)
    assert ts.notna().all() and str(ts.dt.tz) == "UTC"
    # nested fields stay Python objects, no string-encoded JSON
    aligned = df.set_index("event").loc["tensors_aligned"]
    assert aligned["moved"] == ["inv_freq", "position_ids"]
    assert aligned["before"] == {"inv_freq": "cuda:0", "position_ids": "cuda:0"}
    assert df.loc[df["event"] == "summary", "events"].item()["backend_fallback"] == 2
    # the recipe in docs/observability.md: problems grouped by (event, reason_code)
    changes = df[(df["level"] != "info") & (df["event"] != "summary")]
    problems = changes.groupby(["event", "reason_code"])["rank"].count()
    assert problems.to_dict() == {
        ("backend_fallback", "package_missing"): 1,
        ("internal_error", "ValueError"): 1,
        ("tensors_aligned", "rotary_device_mismatch"): 1,
    }


def test_jsonl_filters_with_jq(jsonl_log: Path) -> None:
    jq = require("jq")
    _emit_a_run()
    close_log()
    text = jsonl_log.read_text()
    # the filters of docs/observability.md recipe D
    fallbacks = jq.compile('select(.event=="backend_fallback") | .reason_code')
    assert fallbacks.input_text(text).all() == ["package_missing"]
    rows = jq.compile(
        'select(.level!="info" and .event!="summary") | [.rank, .event, .site, .reason] | @tsv'
    )
    tsv = rows.input_text(text).all()
    assert [r.split("\t")[:3] for r in tsv] == [
        ["1", "backend_fallback", "transformers.load"],
        ["1", "tensors_aligned", "rotary:LlamaRotaryEmbedding"],
        ["1", "internal_error", "xformers.memory_efficient_attention"],
    ]
    per_rank = jq.compile(
        'map(select(.level=="warning" and .event!="summary")) | group_by(.rank)'
        " | map({rank: .[0].rank, n: length})"
    )
    assert per_rank.input_text(text, slurp=True).first() == [{"rank": 1, "n": 2}]


def _example_fields(name: str) -> dict[str, Any]:
    """Plausible event-specific fields, including the nested kinds events carry."""
    if name == "summary":
        return events.summary_fields()
    if name == "activated":
        return {"versions": attnguard.runtime.versions(), "settings": {"mode": "fix"}}
    return {"model": "TinyModel", "applied": True, "moved": ["q", "k"], "before": {"q": "cpu"}}


def code_for(event: str) -> str:
    """A reason code of the vocabulary that this event carries (internal_error: a type name)."""
    from attnguard.observability.reasons import REASONS

    return next((r.code for r in REASONS.values() if event in r.events), "ValueError")


def test_every_event_type_round_trips_through_json_loads(jsonl_log: Path) -> None:
    codes = {name: code_for(name) for name in events.EVENTS}
    for name in events.EVENTS:
        # a reason with a newline and quotes must still be one valid JSON line
        reason = f'{name}: first line\nsecond "quoted" line'
        assert events.emit(
            name,
            site=f"test.{name}",
            reason_code=codes[name],
            reason=reason,
            **_example_fields(name),
        )
    close_log()
    lines = jsonl_log.read_text().splitlines()
    parsed = [json.loads(line) for line in lines]
    # activate() wrote one "activated" itself; each event name then appears once
    assert len(parsed) == len(events.EVENTS) + 1
    assert {p["event"] for p in parsed} == set(events.EVENTS)
    for p in parsed:
        assert list(p)[: len(FIXED)] == FIXED, p["event"]
        assert p["level"] == events.EVENTS[p["event"]]
        assert p["schema"] == events.SCHEMA and p["rank"] == 1 and p["world_size"] == 2
        if p["site"] != "attnguard":  # the one activate() emitted
            assert p["reason"] == f'{p["event"]}: first line\nsecond "quoted" line'
            assert p["reason_code"] == codes[p["event"]]
    by_name = {p["event"]: p for p in parsed if p["site"] != "attnguard"}
    assert by_name["qkv_unified"]["moved"] == ["q", "k"]
    assert by_name["summary"]["events"] == {
        n: 1 for n in events.EVENTS if n not in ("activated", "summary")
    }


# --- console -------------------------------------------------------------------------------------


def test_console_lines_put_the_reason_first_on_one_line(guard, captured, launcher_env) -> None:
    _emit_a_run()
    lines = {e["event"]: events.render_console(e) for e in captured if e["event"] != "activated"}
    assert set(lines) == {
        "backend_fallback",
        "tensors_aligned",
        "observed",
        "internal_error",
        "summary",
    }
    for name, line in lines.items():
        assert "\n" not in line and "\r" not in line, name
    fb = lines["backend_fallback"]
    assert fb.startswith(
        "attnguard WARNING: flash-attn is not installed; loading Qwen2ForCausalLM with sdpa "
        "[backend_fallback "
    )
    for part in ("reason_code=package_missing", "selected=sdpa", "rank=1", "world_size=2"):
        assert part in fb
    assert lines["observed"].startswith(
        "attnguard INFO: model built under ZeRO-3 init; observing only [observed"
    )
    # the type, never the message (it may carry what the caller passed)
    assert lines["internal_error"].startswith(
        "attnguard ERROR: attnguard failed internally (ValueError) and ran the original call "
        "unguarded ["
    )
    assert "bad" not in lines["internal_error"]
    # bookkeeping fields that only matter to machines stay out of the human line
    assert "schema=" not in fb and "pid=" not in fb and "ts=" not in fb


def test_console_stream_writes_one_line_per_warning_and_error(
    guard, capsys: pytest.CaptureFixture[str], launcher_env
) -> None:
    """stderr by default: warnings and errors, one line each. The observation (info) and this
    rank's summary (rank 1 of 2: rank 0 tells the job's story) stay off the console."""
    attnguard.activate(log="stderr", log_format="console")
    capsys.readouterr()
    _emit_a_run()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3  # the repeated fallback is counted, not printed
    assert all(line.startswith("attnguard ") for line in err)
    assert err[0].startswith("attnguard WARNING: flash-attn is not installed")
    assert "[tensors_aligned " in err[1] and err[2].startswith("attnguard ERROR: attnguard failed")


def test_log_level_info_puts_every_event_on_the_console(
    guard, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    attnguard.activate(log="stderr", log_format="console", log_level="info")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("attnguard INFO: attnguard active in fix mode")
    _emit_a_run()
    err = capsys.readouterr().err.splitlines()
    assert [line.split("[")[1].split()[0] for line in err] == [
        "backend_fallback",
        "tensors_aligned",
        "observed",
        "internal_error",
        "summary",
    ]


def test_console_line_stays_one_line_for_a_multi_line_reason() -> None:
    line = events.render_console(
        {
            "event": "kernel_error_recovered",
            "level": "warning",
            "reason": "CUDA error: invalid argument\nCompile with TORCH_USE_CUDA_DSA",
            "site": "flash_attn.flash_attn_func",
            "detail": "a\nb",
        }
    )
    assert "\n" not in line
    assert line.startswith("attnguard WARNING: CUDA error: invalid argument Compile with")


def _shipper(name: str) -> Any:
    match = re.search(rf"<!-- shipper: {name} -->\s*```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/observability.md lost its '{name}' shipper block"
    return importlib.import_module("yaml").safe_load(match.group(1))


def test_shipper_recipes_read_what_attnguard_writes(jsonl_log: Path) -> None:
    """The Vector, Datadog and Loki sketches of recipe A, fed the lines attnguard really wrote:
    they watch the files recipe A's ATTNGUARD_LOG writes; Loki's json stage extracts fields
    every line has, labels only those, and parses `ts` as RFC3339Nano; Datadog's status remapper
    finds its values in `level`."""
    _emit_a_run()
    close_log()
    lines = [json.loads(line) for line in jsonl_log.read_text().splitlines()]
    vector, datadog, (loki,) = _shipper("vector"), _shipper("datadog"), _shipper("loki")
    watched = {
        vector["sources"]["attnguard_files"]["include"][0],
        datadog["logs"][0]["path"],
        loki["static_configs"][0]["labels"]["__path__"],
    }
    (pattern,) = watched
    written = re.search(r"ATTNGUARD_LOG='([^']+)' torchrun", DOC.read_text()).group(1)
    assert Path(written.format(rank=3)).match(pattern)
    stages = {k: v for stage in loki["pipeline_stages"] for k, v in stage.items()}
    extracted = stages["json"]["expressions"]
    assert set(stages["labels"]) <= set(extracted) and stages["timestamp"]["source"] in extracted
    rfc3339nano = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d{1,9})?(Z|[+-]\d\d:\d\d)"
    for line in lines:
        assert set(extracted.values()) <= set(line), line["event"]
        assert re.fullmatch(rfc3339nano, line["ts"]), line["ts"]
        assert line["level"] in ("info", "warning", "error")  # Datadog's status names
