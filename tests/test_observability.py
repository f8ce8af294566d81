"""Observability hand-off: OpenTelemetry log records and plain Python logging — each checked with
the real library, as docs/observability.md says; the page's example line. JSON lines for pandas /
jq, the shippers' recipes and console lines: tests/test_observability_logs.py.

The optional library (opentelemetry-sdk) comes with the ``test`` extra. Without it these tests
skip locally; under CI (``CI`` set) a missing one is an import error, so a broken
install step cannot turn the checks into silent skips.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import warnings
from typing import Any

import pytest
from helpers.events import FIXED, OTEL_CASES
from helpers.packages import require
from helpers.processes import REPO

import attnguard
from attnguard.failopen import report_internal_error
from attnguard.observability import events

DOC = REPO / "docs" / "observability.md"


# --- OpenTelemetry -------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """OTel stores sequences as tuples; compare them as the lists the event carried."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def _otel_exporter() -> tuple[Any, Any]:
    """(SimpleLogRecordProcessor, in-memory exporter) under the names this SDK version has."""
    require("opentelemetry.sdk._logs")
    export = require("opentelemetry.sdk._logs.export")
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
