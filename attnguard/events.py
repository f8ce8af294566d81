"""One vocabulary of events, one private structlog chain, de-duplication and the exit summary.

Every intervention (or decision not to intervene) becomes one event: a flat dict with fixed fields
(schema, event, level, ts, pid, host, rank, local_rank, world_size, mode, site, reason_code,
reason, count) plus event-specific ones. Events go to

* the stdlib logger ``"attnguard"`` with every field as a LogRecord attribute, so whatever handler
  the host app installed (an OpenTelemetry LoggingHandler included) receives them;
* a JSON-lines or console stream: stderr or a per-rank file (``ATTNGUARD_LOG``).

We never call ``structlog.configure`` or ``logging.basicConfig``: the host app owns global logging.
The same (event, site, reason_code) is emitted once; later repeats only bump its counter, which the
``summary`` event at exit reports.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import IO, Any

import structlog

from .config import Settings

SCHEMA = 1

# event name -> level. The whole vocabulary; emit() refuses anything else.
EVENTS: dict[str, str] = {
    "activated": "info",
    "observed": "info",  # looked, changed nothing on purpose (and says why)
    "backend_fallback": "warning",  # a model's backend replaced at load time
    "backend_rerouted": "warning",  # one call site sent to another kernel
    "model_cast": "warning",
    "model_placed": "warning",
    "device_map_rewritten": "warning",
    "qkv_unified": "warning",
    "tensors_aligned": "warning",
    "kernel_error_recovered": "warning",
    "plan_mismatch": "warning",  # after loading, the model is not what the plan said
    "internal_error": "error",  # attnguard itself failed; the original call ran instead
    "summary": "info",
}
# Events that are never de-duplicated (one per process by construction).
_UNIQUE = frozenset({"activated", "summary"})
_LEVELNO = {"debug": 10, "info": 20, "warning": 30, "error": 40}
# LogRecord attributes an ``extra`` field must not overwrite.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message"}

stdlib_logger = logging.getLogger("attnguard")
# Keeps logging's last-resort handler from printing our records a second time on stderr when the
# app configured no logging at all. Handlers the app adds still receive everything.
stdlib_logger.addHandler(logging.NullHandler())


def launch_context(environ: os._Environ[str] | dict[str, str] | None = None) -> dict[str, int]:
    """rank / local_rank / world_size from the launcher's environment (torchrun, accelerate)."""
    env = os.environ if environ is None else environ

    def _int(name: str, default: int) -> int:
        try:
            return int(env.get(name, default))
        except ValueError:
            return default

    return {
        "rank": _int("RANK", 0),
        "local_rank": _int("LOCAL_RANK", 0),
        "world_size": _int("WORLD_SIZE", 1),
    }


def is_compiling() -> bool:
    """True inside a torch.compile trace, where no Python side effect may run."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return bool(torch.compiler.is_compiling())
    except Exception:
        return False


# --- the private structlog chain -----------------------------------------------------------------


def _add_context(_logger: Any, method: str, ed: dict[str, Any]) -> dict[str, Any]:
    """Fixed fields first, so every sink sees them in the same order."""
    base = {
        "schema": SCHEMA,
        "event": ed.pop("event"),
        "level": method,
        "ts": None,  # filled by the TimeStamper
        "pid": os.getpid(),
        "host": _HOST,
        **launch_context(),
        "mode": _state.settings.mode,
    }
    base.update(ed)
    # fixed keys in a fixed order, then the event's own fields
    fixed = {k: base.pop(k, None) for k in ("site", "reason_code", "reason", "count")}
    return {
        **{k: v for k, v in base.items() if k in _HEAD},
        **fixed,
        **{k: v for k, v in base.items() if k not in _HEAD},
    }


_HEAD = (
    "schema",
    "event",
    "level",
    "ts",
    "pid",
    "host",
    "rank",
    "local_rank",
    "world_size",
    "mode",
)


class _Fanout:
    """The chain's final "logger": hands the finished event dict to each sink."""

    def _dispatch(self, **ed: Any) -> None:
        for sink in list(_state.sinks):
            try:
                sink(ed)
            except Exception:
                pass  # a full disk or closed stream must not break the program

    debug = info = warning = error = msg = _dispatch


_HOST = socket.gethostname()
_chain = structlog.wrap_logger(
    _Fanout(),
    processors=[
        _add_context,
        structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
        lambda _l, _m, ed: ed,  # a dict: passed to _Fanout as keyword arguments
    ],
    wrapper_class=structlog.BoundLogger,
)


# --- sinks ---------------------------------------------------------------------------------------


def _to_stdlib(ed: dict[str, Any]) -> None:
    levelno = _LEVELNO.get(ed["level"], 20)
    if not stdlib_logger.isEnabledFor(levelno):
        return
    extra = {(f"ag_{k}" if k in _RECORD_ATTRS else k): v for k, v in ed.items()}
    stdlib_logger.log(levelno, "%s: %s", ed["event"], ed.get("reason") or "", extra=extra)


def render_json(ed: dict[str, Any]) -> str:
    """One JSON object on one line (non-JSON values become strings)."""
    return json.dumps(ed, default=str, separators=(", ", ": "))


# JSON keeps everything; the console line keeps what a person scans for. The summary's counts
# and advice are already in its reason.
_CONSOLE_SKIP = frozenset(
    {"schema", "event", "level", "ts", "pid", "host", "reason", "mode"}
    | {"settings", "keys", "sites", "events", "reasons", "advice", "event_ranks", "reason_ranks"}
    | {"per_rank"}
)


def _one_line(value: object) -> str:
    return " ".join(str(value).split())  # kernel errors span lines; a console event must not


def render_console(ed: dict[str, Any]) -> str:
    """Readable at a glance: the reason first, then the event name and the telling fields."""
    fields = " ".join(
        f"{k}={_one_line(v)}"
        for k, v in ed.items()
        if k not in _CONSOLE_SKIP and v not in (None, {}, [])
    )
    reason = _one_line(ed.get("reason") or ed["event"])
    return (
        f"attnguard {ed['level'].upper()}: {reason} [{ed['event']}{' ' + fields if fields else ''}]"
    )


class StreamSink:
    """Writes rendered events to stderr or to a (per-rank) file, one line each."""

    def __init__(self, target: str, fmt: str) -> None:
        self.target = target
        self.render = render_json if fmt == "json" else render_console
        self._file: IO[str] | None = None
        self._lock = threading.Lock()

    def path(self) -> str:
        ctx = launch_context()
        return self.target.format(rank=ctx["rank"], pid=os.getpid())

    def __call__(self, ed: dict[str, Any]) -> None:
        line = self.render(ed) + "\n"
        with self._lock:
            if self.target == "stderr":
                sys.stderr.write(line)
                sys.stderr.flush()
                return
            if self._file is None:
                p = self.path()
                os.makedirs(os.path.dirname(os.path.abspath(p)), exist_ok=True)
                self._file = open(p, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
            self._file.write(line)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


# --- state ---------------------------------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.settings = Settings()
        self.lock = threading.Lock()
        # (event, site, reason_code) -> count
        self.counts: dict[tuple[str, str | None, str | None], int] = {}
        self.stream: StreamSink | None = None
        self.sinks: list[Callable[[dict[str, Any]], None]] = [_to_stdlib]
        self.summary_registered = False


_state = _State()


def configure_sinks(settings: Settings) -> None:
    """(Re)build the stream sink from settings; the stdlib sink is always on."""
    _state.settings = settings
    if _state.stream is not None:
        _state.stream.close()
        with contextlib.suppress(ValueError):
            _state.sinks.remove(_state.stream)
        _state.stream = None
    if settings.enabled and settings.log != "none":
        _state.stream = StreamSink(settings.log, settings.log_format)
        _state.sinks.append(_state.stream)


def emit(
    event: str, *, site: str | None = None, reason_code: str | None = None, **fields: Any
) -> bool:
    """Record one occurrence; emit it the first time this (event, site, reason_code) is seen.

    Returns True when the event was emitted. Never called inside a torch.compile trace: callers
    on the hot path record before or after the traced region.
    """
    level = EVENTS.get(event)
    if level is None:
        raise ValueError(f"attnguard: unknown event {event!r}; valid events: {', '.join(EVENTS)}")
    key = (event, site, reason_code)
    with _state.lock:
        count = _state.counts.get(key, 0) + 1
        _state.counts[key] = count
    if count > 1 and event not in _UNIQUE:
        return False
    getattr(_chain, level)(event, site=site, reason_code=reason_code, count=count, **fields)
    return True


def counts() -> dict[tuple[str, str | None, str | None], int]:
    """A copy of the running counts, keyed by (event, site, reason_code)."""
    with _state.lock:
        return dict(_state.counts)


def summary_fields() -> dict[str, Any]:
    """Counts per event and per reason, without the bookkeeping events."""
    per_event: dict[str, int] = {}
    per_reason: dict[str, int] = {}
    sites: dict[str, list[str]] = {}
    for (event, site, reason), n in counts().items():
        if event in _UNIQUE:
            continue
        per_event[event] = per_event.get(event, 0) + n
        if reason:
            per_reason[f"{event}:{reason}"] = per_reason.get(f"{event}:{reason}", 0) + n
        if site:
            sites.setdefault(event, [])
            if site not in sites[event]:
                sites[event].append(site)
    interventions = sum(n for e, n in per_event.items() if e not in ("observed",))
    return {
        "interventions": interventions,
        "events": per_event,
        "reasons": per_reason,
        "sites": sites,
    }


def _at_exit() -> None:
    if _state.settings.enabled:
        with contextlib.suppress(Exception):
            # one job-wide summary from rank 0 when torch.distributed is up, else this process's
            from .summary import emit_exit_summary

            emit_exit_summary()
    if _state.stream is not None:
        _state.stream.close()


def register_exit_summary() -> None:
    """Emit ``summary`` at interpreter exit (once per process)."""
    if not _state.summary_registered:
        _state.summary_registered = True
        atexit.register(_at_exit)


def reset_counts() -> None:
    """Forget counts (tests, and a fresh activate after deactivate keeps its history otherwise)."""
    with _state.lock:
        _state.counts.clear()


@contextlib.contextmanager
def capture() -> Iterator[list[dict[str, Any]]]:
    """Collect every emitted event dict while the block runs (the test helper).

    structlog's own ``capture_logs`` cannot see attnguard's private chain.
    """
    captured: list[dict[str, Any]] = []
    sink = captured.append
    _state.sinks.append(sink)
    try:
        yield captured
    finally:
        with contextlib.suppress(ValueError):
            _state.sinks.remove(sink)
