"""One vocabulary of events, one private structlog chain, de-duplication and the exit summary.

Every intervention (or decision not to intervene) becomes one event: a flat dict with fixed fields
(schema, event, level, ts, pid, proc, host, rank, local_rank, world_size, mode, site,
reason_code, reason, count) plus event-specific ones. ``proc`` tells processes apart for good (a
new random id at start-up and in each forked child, which forgets its parent's counts), so
``attnguard summary`` can add up counts over processes exactly. Events go to

* the stdlib logger ``"attnguard"`` with every field as a LogRecord attribute, so whatever handler
  the host app installed (an OpenTelemetry LoggingHandler included) receives them;
* JSON-lines or console streams: stderr and/or a per-rank file (``ATTNGUARD_LOG``), each with a
  level threshold (``ATTNGUARD_LOG_LEVEL``: by default warnings and errors on stderr, everything
  in a file); stderr lines only from the ranks of ``ATTNGUARD_CONSOLE_RANKS``.

We never call ``structlog.configure`` or ``logging.basicConfig``: the host app owns global logging.
The same (event, site, reason_code) is emitted once; later repeats only bump its counters (every
occurrence is counted as applied, would-have or observed), which the ``summary`` at exit reports.

How lines are written (never disturbing the program) is :mod:`attnguard.observability.sinks`.

Helper processes (DataLoader workers, tools such as ``pip`` run by a guarded program: children that
share their parent's rank) stay quiet: no ``activated``, and a summary only when they changed (or
would have changed) something; their events carry ``helper: true``. A helper that later gets a
rank identity of its own (a Ray actor sets RANK / WORLD_SIZE after start-up) is a rank from then
on: the identity is read again at each event and at exit.

This module does not know how the exit summary is made: :func:`register_exit_summary` takes the
function to call (``attnguard.observability.summary`` imports this module, never the other way round).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from .. import launch
from ..config import Settings
from ..launch import IDENTITY_VARS, launch_context, launch_identity
from .reasons import known as known_reason
from .sinks import LEVELNO as _LEVELNO
from .sinks import StreamSink, link_fallbacks, render_console, render_json, stdlib_logger
from .sinks import to_stdlib as _to_stdlib

__all__ = [
    "EVENTS",
    "IDENTITY_VARS",
    "KINDS",
    "StreamSink",
    "emit",
    "launch_context",
    "launch_identity",
    "render_console",
    "render_json",
]

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
    # opt-in (ATTNGUARD_KERNEL=fastest): which kernel serves a call bucket, with the evidence;
    # emitted at warning when another kernel serves it, info when the requested one stays
    "kernel_selected": "info",
    "internal_error": "error",  # attnguard itself failed; the original call ran instead
    "numerics_mismatch": "error",  # opt-in ATTNGUARD_VERIFY: a kernel's numbers differ
    "summary": "info",  # warning when it reports applied changes
}
# Events that are never de-duplicated (one per process by construction).
_UNIQUE = frozenset({"activated", "summary"})
# Events that report a finding, never a change.
OBSERVATIONS = frozenset({"observed", "plan_mismatch", "numerics_mismatch"})

# What each occurrence counts as, in the summary.
KINDS = ("applied", "would_have", "observed", "internal_errors")
_APPLIED, _WOULD_HAVE, _OBSERVED, _ERROR = range(4)

# When this process imported attnguard: a job-summary rendezvous ignores files older than this.
STARTED = launch.STARTED


def new_process_id() -> str:
    """A fresh random process id (``proc`` in every event)."""
    return os.urandom(8).hex()


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
        "proc": _state.proc,
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
    "proc",
    "host",
    "rank",
    "local_rank",
    "world_size",
    "mode",
)


class _Fanout:
    """The chain's final "logger": hands the finished event dict to each sink."""

    def _dispatch(self, **ed: Any) -> None:
        console = ed.pop("_console", True)
        for sink in (*_state.sinks, *_state.streams):
            try:
                if isinstance(sink, StreamSink):
                    sink(ed, console=console)
                else:
                    sink(ed)
            except Exception:
                pass  # a full disk or closed stream must not break the program
        if any(sink.refused for sink in _state.streams):
            say_refused_logs()  # the line above opened a path another user occupies

    debug = info = warning = error = msg = _dispatch


_HOST = socket.gethostname()
_chain: Any = None


def _get_chain() -> Any:
    """The private structlog chain, built at the first emitted event: structlog (and what it
    imports, rich among them when installed) costs a process that never emits nothing."""
    global _chain
    if _chain is None:
        import structlog

        _chain = structlog.wrap_logger(
            _Fanout(),
            processors=[
                _add_context,
                structlog.processors.TimeStamper(fmt="iso", utc=True, key="ts"),
                lambda _l, _m, ed: ed,  # a dict: passed to _Fanout as keyword arguments
            ],
            wrapper_class=structlog.BoundLogger,
        )
    return _chain


# --- sinks ---------------------------------------------------------------------------------------


# --- state ---------------------------------------------------------------------------------------


class _State:
    def __init__(self) -> None:
        self.settings = Settings()
        # re-entrant: a signal handler (a SIGTERM handler calling attnguard.finish()) runs in
        # the main thread, also while it holds the lock
        self.lock = threading.RLock()
        # (event, site, reason_code) -> count
        self.counts: dict[tuple[str, str | None, str | None], int] = {}
        # (event, site, reason_code) -> [applied, would_have, observed, internal_errors]
        self.kinds: dict[tuple[str, str | None, str | None], list[int]] = {}
        # Replaced whole (never changed in place), so a running emit sees one configuration.
        self.streams: tuple[StreamSink, ...] = ()
        self.sinks: list[Callable[..., None]] = [_to_stdlib]  # the logger, then capture()s
        self.exit_summary: Callable[[], None] | None = None
        self.on_first_event: Callable[[], None] | None = None  # a rank announces it will report
        self.first_event_seen = False
        self.helper = False  # marked a helper at activation (see is_helper)
        self.helper_identity = ""  # the launch identity it had then
        self.main_pid: int | None = None  # the process that activated (a fork is a helper)
        self.proc = new_process_id()
        self.announced: Settings | None = None  # the settings the last ``activated`` reported
        self.summarised = 0  # the pid of the process whose exit summary was emitted


_state = _State()


def _after_fork_in_child() -> None:
    """A forked child is a process of its own: a new id, none of its parent's counts (they are
    the parent's to report), and no lock another thread of the parent held at the fork."""
    _state.lock = threading.RLock()
    for sink in _state.streams:
        sink._lock = threading.RLock()
    _state.proc = new_process_id()
    _state.counts = {}
    _state.kinds = {}
    _state.first_event_seen = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def process_id() -> str:
    """This process's id, as every event carries it (``proc``)."""
    return _state.proc


def set_helper(helper: bool) -> None:
    """Mark this process as a helper (or not); called by activation."""
    _state.helper = helper
    _state.helper_identity = launch_identity()
    _state.main_pid = os.getpid()


def marked() -> bool:
    """True once activation has decided whether this process is a helper."""
    return _state.main_pid is not None


def announce(settings: Settings) -> bool:
    """True when ``activated`` should be emitted for ``settings``: once per process, and again
    only for different settings."""
    with _state.lock:
        if _state.announced == settings:
            return False
        _state.announced = settings
        return True


def is_helper() -> bool:
    """True in a helper process: forked from the guarded process, or marked a helper at
    activation and still holding the launch identity it had then (one that later gets a rank of
    its own, as Ray actors do, is a rank)."""
    if _state.main_pid is None:
        return False
    if _state.main_pid != os.getpid():
        return True
    return _state.helper and launch_identity() == _state.helper_identity


def configure_sinks(settings: Settings, eager: bool = False) -> None:
    """Make the stream sinks match ``settings``; the stdlib sink is always on.

    A target kept from before keeps its sink (and open file), updated in place; new ones are
    made (``eager``: their files opened now); the configuration is swapped in one assignment,
    so a line being written meanwhile goes to the old or the new one, never nowhere. An unusable
    path raises ValueError naming ATTNGUARD_LOG and leaves the settings in force as they were.
    """
    old = {sink.target: sink for sink in _state.streams}
    made: list[StreamSink] = []
    new: list[StreamSink] = []
    for target in settings.log_targets:
        fmt, threshold = settings.format_for(target), settings.threshold_for(target)
        sink = old.get(target)
        try:
            if sink is None:
                sink = StreamSink(target, fmt, threshold, settings.console_ranks, eager=eager)
                made.append(sink)
            elif eager and target != "stderr":
                with sink._lock:
                    sink.open_now()
        except OSError as exc:
            for s in made:
                s.close()
            raise _unwritable(settings, target, exc) from None
        new.append(sink)
    for sink in new:
        if sink not in made:
            sink.update(
                settings.format_for(sink.target),
                settings.threshold_for(sink.target),
                settings.console_ranks,
            )
    link_fallbacks(new, settings.format_for("stderr"))
    _state.settings = settings
    _state.streams = tuple(new)
    for sink in old.values():
        if sink not in new:
            sink.close()


def say_refused_logs() -> None:
    """One warning per log path another user occupied (their link or file), which this
    process's events went around to a fresh file of its own: where they are, and why."""
    for sink in _state.streams:
        refused = sink.take_refusal()
        if refused is None:
            continue
        asked, used, why = refused
        reason = (
            f"ATTNGUARD_LOG: {asked} is not used ({why}); this process writes its events to "
            f"{used} instead"
        )
        emit(
            "observed",
            site="attnguard.log",
            reason_code="log_path_refused",
            level="warning",
            reason=reason,
            log_file=used,
        )
        if not any(sink.target == "stderr" for sink in _state.streams):
            # the events go to files only: the terminal is told too, where else would one look
            StreamSink("stderr", "console")._to_stderr(f"attnguard WARNING: {reason}\n")


def _unwritable(settings: Settings, target: str, exc: OSError) -> ValueError:
    from ..config import LOG_TARGETS_HELP, shown

    return ValueError(
        f"attnguard: invalid ATTNGUARD_LOG={shown(settings.log)} (cannot write "
        f"{shown(exc.filename or target, quote=False)}: {exc.strerror or exc}); valid values: "
        f"{LOG_TARGETS_HELP}"
    )


def _kind(event: str, applied: Any) -> int | None:
    if event in _UNIQUE:
        return None
    if event == "internal_error":
        return _ERROR
    if event in OBSERVATIONS:
        return _OBSERVED  # a finding, even when it says ``applied: false``
    if event == "kernel_selected" and applied is None:
        return _OBSERVED  # the requested kernel stays: nothing changed
    if applied is not None:
        return _APPLIED if applied else _WOULD_HAVE
    return _APPLIED if _state.settings.changes_things else _WOULD_HAVE


def emit(
    event: str,
    *,
    site: str | None = None,
    reason_code: str | None = None,
    level: str | None = None,
    console: bool = True,
    **fields: Any,
) -> bool:
    """Record one occurrence; emit it the first time this (event, site, reason_code) is seen.

    Every occurrence is counted (``count``) and classified by its ``applied`` field: True (a
    change made), False (a change warn/strict mode did not make: "would have"), or absent (an
    observation for ``observed`` / ``plan_mismatch``, an error for ``internal_error``, otherwise
    what the mode does). ``level`` overrides the event's level; ``console=False`` keeps it off
    stderr (files and the logger still get it).

    Returns True when the event was emitted. Never called inside a torch.compile trace: callers
    on the hot path record before or after the traced region.
    """
    default = EVENTS.get(event)
    if default is None:
        raise ValueError(f"attnguard: unknown event {event!r}; valid events: {', '.join(EVENTS)}")
    if not known_reason(event, reason_code):
        raise ValueError(
            f"attnguard: unknown reason_code {reason_code!r} (attnguard.observability.reasons)"
        )
    key = (event, site, reason_code)
    kind = _kind(event, fields.get("applied"))
    with _state.lock:
        count = _state.counts.get(key, 0) + 1
        _state.counts[key] = count
        if kind is not None:
            tally = _state.kinds.get(key)
            if tally is None:
                tally = _state.kinds[key] = [0, 0, 0, 0]
            tally[kind] += 1
    if count > 1 and event not in _UNIQUE:
        return False
    if event not in _UNIQUE and not _state.first_event_seen:
        _first_event()
    if is_helper():
        fields["helper"] = True
    name = level if level in _LEVELNO else default
    if not _anyone_listens(_LEVELNO.get(name, 20)):
        return True  # counted (the summary has it); nothing would write it: build nothing
    getattr(_get_chain(), name)(
        event, site=site, reason_code=reason_code, count=count, _console=console, **fields
    )
    return True


def _first_event() -> None:
    """Tell the job this process has something to report (its rank 0 then waits for it at
    exit); retried at the next new event until the callback says it is done. Never raises."""
    hook = _state.on_first_event
    if hook is None:
        return
    try:
        _state.first_event_seen = bool(hook())
    except Exception:
        _state.first_event_seen = True  # an announcement is a courtesy: never a second try


def _anyone_listens(levelno: int) -> bool:
    """Would any sink write an event of this level? The "attnguard" logger only when it is
    enabled for the level (Python's default: WARNING and up); a stream only at or above its
    threshold. Where nothing would (an INFO ``activated`` on a default setup), the event is not
    rendered and structlog, with what it imports (rich, pygments where installed), is never
    imported: a process where nothing happens pays nothing for it."""
    for sink in _state.sinks:
        if sink is not _to_stdlib or stdlib_logger.isEnabledFor(levelno):
            return True
    return any(sink.threshold <= levelno for sink in _state.streams)


def counts() -> dict[tuple[str, str | None, str | None], int]:
    """A copy of the running counts, keyed by (event, site, reason_code)."""
    with _state.lock:
        return dict(_state.counts)


def kind_counts() -> dict[tuple[str, str | None, str | None], dict[str, int]]:
    """Per (event, site, reason_code): how many occurrences were applied, would-have (not
    applied: warn/strict mode, or a disabled remedy), observations, internal errors."""
    with _state.lock:
        return {k: dict(zip(KINDS, v, strict=True)) for k, v in _state.kinds.items()}


def summary_fields() -> dict[str, Any]:
    """Totals per kind (applied / would_have / observed / internal_errors), counts per event
    and per reason, and the sites; without the bookkeeping events."""
    per_event: dict[str, int] = {}
    per_reason: dict[str, int] = {}
    sites: dict[str, list[str]] = {}
    totals = dict.fromkeys(KINDS, 0)
    kinds = kind_counts()
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
        for k, v in kinds.get((event, site, reason), {}).items():
            totals[k] += v
    return {**totals, "events": per_event, "reasons": per_reason, "sites": sites}


def _summarise_once() -> None:
    """Emit the exit summary unless it was emitted already (by :func:`finish`, or before the
    atexit handlers). Never raises."""
    # Nothing may escape from here: an exception in an atexit callback is printed on stderr.
    # Nor may anything be imported here for the first time: an import that runs code from a
    # string (a dataclass, a namedtuple) clears CPython's record of an unhandled Ctrl-C, and
    # the process would exit 1 instead of dying of SIGINT (130 in a shell). The summary's
    # modules are imported when it becomes due (attnguard.runtime); a process where nothing
    # made it due has nothing to summarise.
    with contextlib.suppress(BaseException):
        with _state.lock:
            if _state.summarised == os.getpid():
                return
            _state.summarised = os.getpid()
        if _state.settings.enabled and _state.exit_summary and not nothing_to_summarise():
            _state.exit_summary()  # one job-wide summary from rank 0, else this process's own


def _before_atexit() -> None:
    """Run by the interpreter when the main thread has finished, before any atexit handler: the
    summary then still reaches handlers whose own atexit shutdown would come first (an
    OpenTelemetry LoggerProvider made after ``import attnguard`` registers one). Where threads
    of the program still run (non-daemon threads the interpreter is about to wait for), their
    events may yet come: the summary waits for the atexit handler, as it did before."""
    with contextlib.suppress(BaseException):
        me = threading.current_thread()
        if any(t is not me and not t.daemon and t.is_alive() for t in threading.enumerate()):
            return
        _summarise_once()


def _at_exit() -> None:
    _summarise_once()
    with contextlib.suppress(BaseException):
        for sink in _state.streams:
            sink.close()


def finish() -> None:
    """Emit the exit summary now rather than at exit (once per process): on rank 0 of a job the
    job's, after gathering every rank's record; on another rank, its record for rank 0. Call it
    before shutting down the logging your handlers send to (``provider.shutdown()``). Events
    that come later are still emitted, not counted in a second summary."""
    _summarise_once()


def nothing_to_summarise() -> bool:
    """True where the exit summary would be counted and dropped: nothing happened, and this is
    a helper (silent unless it changed something) or a single process whose summary nothing
    would write (INFO). Ranks of a job always take part (rank 0 gathers every rank's counts)."""
    with _state.lock:
        happened = any(key[0] not in _UNIQUE for key in _state.counts)
    if happened:
        return False
    if is_helper():
        return True
    return launch_context()["world_size"] <= 1 and not _anyone_listens(_LEVELNO["info"])


def register_exit_summary(
    summarise: Callable[[], None], on_first_event: Callable[[], bool] | None = None
) -> None:
    """At interpreter exit call ``summarise`` (once per process; the latest one given), and
    ``on_first_event`` when this process first records an event (True: done, else it is
    tried again at the next new event)."""
    _state.exit_summary = summarise
    _state.on_first_event = on_first_event
    if not getattr(_at_exit, "registered", False):
        _at_exit.registered = True  # type: ignore[attr-defined]
        atexit.register(_at_exit)
        before = getattr(threading, "_register_atexit", None)  # CPython 3.9+
        if before is not None:
            with contextlib.suppress(RuntimeError):  # already shutting down
                before(_before_atexit)


def reset_counts() -> None:
    """Forget counts and the last activation announced (tests; a fresh activate after deactivate
    keeps its history otherwise)."""
    with _state.lock:
        _state.counts.clear()
        _state.kinds.clear()
        _state.announced = None
        _state.first_event_seen = False


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
