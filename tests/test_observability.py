"""Observability hand-off: OpenTelemetry log records, JSON lines for pandas / jq, console lines,
and plain Python logging — each checked with the real library, as docs/observability.md says.

The optional libraries (opentelemetry-sdk, pandas, jq) come with the ``test`` extra. Without them
these tests skip locally; under CI (``CI`` set) a missing one is an import error, so a broken
install step cannot turn the checks into silent skips.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from helpers.events import FIXED
from helpers.processes import REPO

import attnguard
from attnguard.failopen import report_internal_error
from attnguard.observability import events, summary

DOC = REPO / "docs" / "observability.md"


def _require(module: str) -> ModuleType:
    """Import an optional test dependency: skip without it locally, fail without it in CI."""
    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Rank 1 of 2, so rank fields are visibly taken from the environment (not the defaults)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    return {"rank": 1, "local_rank": 1, "world_size": 2}


@pytest.fixture
def logger_levels() -> Iterator[None]:
    """Tests change the root and "attnguard" logger levels; put them back afterwards."""
    root, ours = logging.getLogger(), logging.getLogger("attnguard")
    saved = (root.level, ours.level, ours.propagate)
    yield
    root.setLevel(saved[0])
    ours.setLevel(saved[1])
    ours.propagate = saved[2]


# --- OpenTelemetry -------------------------------------------------------------------------------

# (event, level it must have, OTel severity text, fields passed to emit)
OTEL_CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    (
        "backend_fallback",
        "warning",
        "WARN",
        {
            "site": "transformers.load",
            "reason_code": "package_missing",
            "reason": "flash-attn is not installed; loading Qwen2ForCausalLM with sdpa",
            "model": "Qwen2ForCausalLM",
            "requested": "flash_attention_2",
            "selected": "sdpa",
            "applied": True,
        },
    ),
    (
        "observed",
        "info",
        "INFO",
        {
            "site": "transformers.load",
            "reason_code": "zero3_init",
            "reason": "model built under ZeRO-3 init; observing only",
            "model": "LlamaForCausalLM",
            "applied": False,
        },
    ),
    (
        "internal_error",
        "error",
        "ERROR",
        {
            "site": "flash_attn.flash_attn_func",
            "reason_code": "KeyError",
            "reason": "attnguard failed internally and ran the original call unguarded: 'q'",
            "exception": "KeyError",
        },
    ),
    (  # nested fields: lists and dicts (OTel log attributes take them since SDK 1.33)
        "tensors_aligned",
        "warning",
        "WARN",
        {
            "site": "rotary:LlamaRotaryEmbedding",
            "reason_code": "rotary_device_mismatch",
            "reason": "LlamaRotaryEmbedding got inputs on cuda:1 but inv_freq on cuda:0; moved",
            "moved": ["inv_freq", "position_ids"],
            "before": {"inv_freq": "cuda:0", "position_ids": "cuda:0"},
            "applied": True,
        },
    ),
]


def _plain(value: Any) -> Any:
    """OTel stores sequences as tuples; compare them as the lists the event carried."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _otel_exporter() -> tuple[Any, Any]:
    """(SimpleLogRecordProcessor, in-memory exporter) under the names this SDK version has."""
    _require("opentelemetry.sdk._logs")
    export = _require("opentelemetry.sdk._logs.export")
    # InMemoryLogExporter became InMemoryLogRecordExporter in 1.39; the old name warns.
    exporter_cls = getattr(export, "InMemoryLogRecordExporter", None) or export.InMemoryLogExporter
    exporter = exporter_cls()
    return export.SimpleLogRecordProcessor(exporter), exporter


def _emit_otel_cases(captured: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Emit each case (the warning twice: the repeat is counted, not exported); return the
    captured event dict per event name."""
    for name, _level, _severity, fields in OTEL_CASES:
        assert events.emit(name, **fields)
    assert not events.emit(OTEL_CASES[0][0], **OTEL_CASES[0][3])
    return {e["event"]: e for e in captured if e["event"] in {c[0] for c in OTEL_CASES}}


def _assert_exported(exporter: Any, sent: dict[str, dict[str, Any]], env: dict[str, int]) -> None:
    severity_number = importlib.import_module("opentelemetry._logs").SeverityNumber
    records = exporter.get_finished_logs()
    exported = {r.log_record.attributes["event"]: r for r in records}
    # one record per emitted event: the deduplicated repeat of the warning is not exported
    names = [r.log_record.attributes["event"] for r in records]
    assert all(names.count(name) == 1 for name, *_ in OTEL_CASES), names
    for name, level, severity, fields in OTEL_CASES:
        readable = exported[name]
        rec = readable.log_record
        attrs = dict(rec.attributes)
        assert readable.instrumentation_scope.name == "attnguard"
        assert rec.severity_text == severity
        assert rec.severity_number == getattr(severity_number, severity)
        assert rec.body == f"{name}: {fields['reason']}"
        # the fields a collector will group on, with the values given and from the launcher
        assert attrs["event"] == name and attrs["level"] == level
        assert attrs["site"] == fields["site"] and attrs["reason_code"] == fields["reason_code"]
        assert attrs["reason"] == fields["reason"]
        assert attrs["rank"] == env["rank"] and attrs["world_size"] == env["world_size"]
        assert attrs["local_rank"] == env["local_rank"] and attrs["count"] == 1
        # every field of the event (fixed and event-specific) is an attribute, unchanged
        for key, value in sent[name].items():
            assert _plain(attrs[key]) == value, key
        own = set(fields) - {"site", "reason_code", "reason"}
        assert own and own <= set(attrs)
        # OpenTelemetry's event conventions: event.name on every record (instrumentation-logging
        # 0.66b2 promotes it to event_name), error.type on attnguard's own errors only
        assert attrs.get("event.name", getattr(rec, "event_name", None)) == f"attnguard.{name}"
        if name == "internal_error":
            assert attrs["error.type"] == fields.get("error_type", fields["reason_code"])
        else:
            assert "error.type" not in attrs


# Where LoggingHandler lives: the SDK (deprecated since 1.40), opentelemetry-instrumentation-logging
OTEL_HANDLER_MODULES = [
    pytest.param("opentelemetry.sdk._logs", id="sdk-LoggingHandler"),
    pytest.param(
        "opentelemetry.instrumentation.logging.handler", id="instrumentation-LoggingHandler"
    ),
]


@pytest.mark.parametrize("handler_module", OTEL_HANDLER_MODULES)
def test_otel_log_records_carry_every_field_and_the_severity(
    handler_module: str, guard, captured, launcher_env, logger_levels
) -> None:
    processor, exporter = _otel_exporter()
    from opentelemetry.sdk._logs import LoggerProvider

    if handler_module.startswith("opentelemetry.instrumentation"):
        module = pytest.importorskip(handler_module)  # optional in every setup, CI included
    else:
        module = importlib.import_module(handler_module)
    handler_cls = getattr(module, "LoggingHandler", None)
    if handler_cls is None:
        pytest.skip(f"{handler_module} has no LoggingHandler in this version")
    provider = LoggerProvider()
    provider.add_log_record_processor(processor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the SDK's handler, since 1.40
        handler = handler_cls(logger_provider=provider)
    ours = logging.getLogger("attnguard")
    ours.addHandler(handler)
    ours.setLevel(logging.INFO)
    try:
        sent = _emit_otel_cases(captured)
    finally:
        ours.removeHandler(handler)
        provider.shutdown()
    _assert_exported(exporter, sent, launcher_env)


def _doc_block(marker: str) -> str:
    match = re.search(rf"<!-- {marker}[^>]*-->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/observability.md lost its '{marker}' block"
    return match.group(1)


def test_otel_recipe_from_the_docs_runs_as_written(captured, launcher_env, logger_levels) -> None:
    """Recipe B of docs/observability.md, executed verbatim with an in-memory exporter: the
    handler goes on first, then attnguard is activated, as in an app's start-up code."""
    processor, exporter = _otel_exporter()
    logging.getLogger().setLevel(logging.WARNING)  # the stdlib default; the recipe lowers ours
    namespace: dict[str, Any] = {"processor": processor}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        exec(compile(_doc_block("otel-recipe"), str(DOC), "exec"), namespace)
    try:
        attnguard.activate(log="none")
        sent = _emit_otel_cases(captured)
    finally:
        logging.getLogger("attnguard").removeHandler(namespace["otel_handler"])
        namespace["provider"].shutdown()
    _assert_exported(exporter, sent, launcher_env)
    # activation itself arrived too, as an INFO record listing the versions
    (activated,) = [
        r for r in exporter.get_finished_logs() if r.log_record.attributes["event"] == "activated"
    ]
    assert activated.log_record.severity_text == "INFO"
    assert activated.log_record.attributes["site"] == "attnguard"
    assert activated.log_record.attributes["versions"]["torch"]


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
    pd = _require("pandas")
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
    jq = _require("jq")
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


# --- plain Python logging ------------------------------------------------------------------------


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_unconfigured_app_stays_unconfigured(
    captured, logger_levels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No basicConfig behind the app's back: with no root handlers (pytest's own removed for
    the test, since basicConfig is a no-op while any exist), there are still none afterwards."""
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    root.setLevel(logging.WARNING)
    attnguard.activate(log="none")
    for name, _level, _severity, fields in OTEL_CASES:
        events.emit(name, **fields)
    assert [e["event"] for e in captured][-len(OTEL_CASES) :] == [c[0] for c in OTEL_CASES]
    assert root.handlers == [] and root.level == logging.WARNING
    # attnguard's own logger has only its NullHandler (which keeps logging's last-resort
    # handler from printing our records a second time on stderr)
    ours = logging.getLogger("attnguard")
    assert all(type(h) is logging.NullHandler for h in ours.handlers) and ours.propagate


def test_root_handler_gets_records_by_propagation_and_root_config_is_untouched(
    captured, logger_levels, launcher_env, capsys: pytest.CaptureFixture[str]
) -> None:
    root = logging.getLogger()
    root.setLevel(logging.WARNING)  # the stdlib default, whatever ran before
    handlers_before = list(root.handlers)
    app_handler = _Keep()  # what basicConfig would add, added by the app itself
    root.addHandler(app_handler)
    try:
        attnguard.activate(log="none")
        events.emit("backend_fallback", **OTEL_CASES[0][3])
        events.emit("observed", **OTEL_CASES[1][3])
        # activation left the root logger's configuration as the app made it
        assert root.handlers == [*handlers_before, app_handler]
        assert root.level == logging.WARNING
        assert logging.getLogger("attnguard").propagate
    finally:
        root.removeHandler(app_handler)
    # WARNING and up propagate with the root at its default level; INFO needs the app's consent
    (rec,) = app_handler.records
    assert rec.name == "attnguard" and rec.levelno == logging.WARNING
    assert (rec.event, rec.site, rec.reason_code) == (
        "backend_fallback",
        "transformers.load",
        "package_missing",
    )
    assert (rec.rank, rec.world_size, rec.count, rec.selected) == (1, 2, 1, "sdpa")
    assert rec.getMessage() == f"backend_fallback: {OTEL_CASES[0][3]['reason']}"
    # log="none": the handler is the only copy, nothing on stderr
    assert capsys.readouterr().err == ""


def test_info_events_reach_the_app_once_it_lowers_the_attnguard_level(guard, logger_levels) -> None:
    root = logging.getLogger()
    root.setLevel(logging.WARNING)
    app_handler = _Keep()
    root.addHandler(app_handler)
    try:
        logging.getLogger("attnguard").setLevel(logging.INFO)  # docs recipe C
        events.emit("observed", **OTEL_CASES[1][3])
    finally:
        root.removeHandler(app_handler)
    (rec,) = app_handler.records
    assert rec.levelno == logging.INFO and rec.event == "observed" and rec.applied is False


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


def test_an_internal_error_record_names_the_exception_type_for_otel(guard, logger_levels) -> None:
    """attnguard's own failure, reported as it really is: the record's error.type is the
    exception's fully qualified type, its event.name attnguard.internal_error."""
    got: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = got.append  # type: ignore[method-assign]
    logging.getLogger("attnguard").addHandler(handler)
    try:
        report_internal_error("flash_attn.flash_attn_func", KeyError("q"))
    finally:
        logging.getLogger("attnguard").removeHandler(handler)
    (record,) = [r for r in got if getattr(r, "event", None) == "internal_error"]
    assert vars(record)["error.type"] == "builtins.KeyError"
    assert vars(record)["event.name"] == "attnguard.internal_error"


def test_the_example_line_has_every_fixed_field_first_and_in_order() -> None:
    """The page says the fixed fields always come first, in its table's order; its example
    JSON line lacked ``proc``."""
    text = DOC.read_text()
    block = text.split("An example line", 1)[1].split("```json\n", 1)[1].split("\n```", 1)[0]
    example = json.loads(block)
    assert list(example)[: len(FIXED)] == FIXED
    from attnguard.observability.eventfiles import is_process_id

    assert is_process_id(example["proc"])  # what attnguard summary takes as a process id
