"""Where rendered events go: one JSON line or one console line each, to stderr or a log file.

Writing never disturbs the program: a log file is written unbuffered, one ``os.write`` per line,
and given up after its first OSError (a full disk, a file-size limit, a FIFO whose reader left):
one line on stderr says so (path, errno), the file keeps whole lines only (a line cut short by
the error is taken back), and from then on what matters most still reaches stderr: warnings,
errors and the exit summary (:meth:`StreamSink._fall_back`). On stderr the program's own stream
is flushed first and our line goes straight to the file descriptor underneath, so nothing of ours
stays buffered in it.
Files are opened by :func:`attnguard.observability.logfile.open_log` (its rules: docs/files.md);
a path another user occupies is replaced by a fresh file of this process's own, which the sink
reports (:meth:`StreamSink.take_refusal`) for :mod:`attnguard.observability.events` to say. A FIFO
of yours that nobody reads yet is opened again at each later line, its lines held meanwhile
(bounded); those still held at the end are counted on stderr.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..launch import launch_context
from . import logfile

LEVELNO = {"debug": 10, "info": 20, "warning": 30, "error": 40}
HELD_BYTES = 1 << 20  # lines held for a FIFO's reader that has not come yet

stdlib_logger = logging.getLogger("attnguard")
# Keeps logging's last-resort handler from printing our records a second time on stderr when the
# app configured no logging at all. Handlers the app adds still receive everything.
stdlib_logger.addHandler(logging.NullHandler())


def to_stdlib(ed: dict[str, Any]) -> None:
    """One LogRecord per event, every field an attribute. A field whose name the record already
    has (a standard attribute, or one the app's record factory sets, such as ``rank``) is
    stored as ``ag_<name>``: ``extra=`` would refuse the whole record instead.

    OpenTelemetry's event conventions on top: ``event.name`` (``attnguard.<event>``, few values:
    one per event name) on every record, and ``error.type`` (the failing exception's fully
    qualified type, else its name) on ``internal_error``."""
    levelno = LEVELNO.get(ed["level"], 20)
    if not stdlib_logger.isEnabledFor(levelno):
        return
    try:
        fn, lno, func, _ = stdlib_logger.findCaller()
    except Exception:
        fn, lno, func = __file__, 0, "to_stdlib"
    record = stdlib_logger.makeRecord(
        stdlib_logger.name,
        levelno,
        fn,
        lno,
        "%s: %s",
        (ed["event"], ed.get("reason") or ""),
        None,
        func,
    )
    conventions = {"event.name": f"attnguard.{ed['event']}"}
    if ed["event"] == "internal_error":
        conventions["error.type"] = ed.get("error_type") or ed.get("reason_code") or "Exception"
    attrs = record.__dict__
    taken = set(attrs) | {"message", "asctime"}
    for key, value in {**ed, **conventions}.items():
        name = key
        while name in taken:
            name = f"ag_{name}"
        attrs[name] = value
        taken.add(name)
    stdlib_logger.handle(record)


def render_json(ed: dict[str, Any]) -> str:
    """One JSON object on one line (non-JSON values become strings)."""
    return json.dumps(ed, default=str, separators=(", ", ": "))


# JSON keeps everything; the console line keeps what a person scans for. The summary's counts
# and advice are already in its reason.
_CONSOLE_SKIP = frozenset(
    {"schema", "event", "level", "ts", "pid", "proc", "host", "reason", "mode"}
    | {"settings", "keys", "sites", "events", "reasons", "advice", "event_ranks", "reason_ranks"}
    | {"per_rank", "rank_procs", "ignored_records"}
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


def _write_all(write: Callable[[Any], Any], data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = write(view)
        if not n:  # None: a non-blocking stream that is full; give the line up
            return
        view = view[n:]


def link_fallbacks(sinks: list[StreamSink], stderr_format: str) -> None:
    """Where each file sink's lines go once its file is given up (:meth:`StreamSink._fall_back`):
    stderr in ``stderr_format``, except what the stderr sink among ``sinks`` shows anyway."""
    beside = next((s for s in sinks if s.target == "stderr"), None)
    for sink in sinks:
        sink.stderr_format, sink.beside = stderr_format, beside


class StreamSink:
    """Writes rendered events at or above ``threshold`` to stderr or a (per-rank) file.

    ``ranks``: stderr lines only from these ranks (None: all). ``eager``: open the file now, so
    an unusable path is a clear error at activation (helpers open it at their first line only).
    A settings change updates a sink in place (:meth:`update`): the file stays open.
    """

    def __init__(
        self,
        target: str,
        fmt: str,
        threshold: str = "info",
        ranks: tuple[int, ...] | None = None,
        eager: bool = False,
    ) -> None:
        self.target = target
        self.update(fmt, threshold, ranks)
        self._fd: int | None = None
        self._opened: str | None = None  # the path the descriptor belongs to
        # (path asked for, path used, why) when another user occupied the path: told once
        self.refused: tuple[str, str, str] | None = None
        self._broken = False  # a file that failed once is not written again
        # where its lines go once the file is given up: stderr in this format, except what the
        # stderr sink of the same settings (``beside``) shows anyway (configure_sinks sets both)
        self.stderr_format = "json"
        self.beside: StreamSink | None = None
        self._closed = False  # replaced by a settings change: late lines are dropped
        self._dead_stream: Any = None  # the stderr object that failed (a new one is tried)
        self._held: list[bytes] = []  # lines for a FIFO nobody reads yet
        self._held_bytes = 0
        self._dropped = 0  # lines beyond HELD_BYTES
        self._lock = threading.RLock()  # a signal handler may emit while the main thread writes
        if eager and target != "stderr":
            self.open_now()

    def update(self, fmt: str, threshold: str, ranks: tuple[int, ...] | None) -> None:
        self.render = render_json if fmt == "json" else render_console
        self.threshold = LEVELNO.get(threshold, 20)
        self.ranks = ranks

    def path(self) -> str:
        ctx = launch_context()
        return self.target.format(rank=ctx["rank"], pid=os.getpid())

    def _open(self) -> int:
        p = self.path()
        if self._fd is not None and p != self._opened:
            self._close()  # the rank was set after start-up (Ray): its own file from now on
        if self._fd is None:
            opened = logfile.open_log(p)  # NoReader: a FIFO nobody reads yet
            self._fd, self._opened = opened.fd, p
            if opened.refused is not None:
                self.refused = (p, opened.path, opened.refused)
        return self._fd

    def open_now(self) -> None:
        """Open the file now (an unusable path raises OSError); a FIFO nobody reads yet is
        opened at a later line."""
        try:
            self._open()
        except logfile.NoReader:
            pass

    def take_refusal(self) -> tuple[str, str, str] | None:
        """(path asked for, path used, why) once after the path was refused, else None."""
        refused, self.refused = self.refused, None
        return refused

    def wants(self, ed: dict[str, Any], console: bool = True) -> bool:
        if LEVELNO.get(ed.get("level", "info"), 20) < self.threshold:
            return False
        if self.target != "stderr":
            return True
        return console and (self.ranks is None or ed.get("rank") in self.ranks)

    def __call__(self, ed: dict[str, Any], console: bool = True) -> None:
        if not self.wants(ed, console):
            return
        line = self.render(ed) + "\n"
        with self._lock:
            if self._closed:
                return
            if self.target == "stderr":
                self._to_stderr(line)
                return
            if not self._broken:
                self._to_file(line.encode("utf-8"))
                if not self._broken:
                    return
            self._fall_back(ed, console)

    def _fall_back(self, ed: dict[str, Any], console: bool) -> None:
        """A line for the file given up: to stderr when it matters most (a warning or an error,
        the exit summary) and is meant for a console, unless the stderr sink beside this one
        shows it anyway."""
        if not console:
            return
        if (
            LEVELNO.get(ed.get("level", "info"), 20) < LEVELNO["warning"]
            and ed.get("event") != "summary"
        ):
            return
        beside = self.beside
        if beside is not None and not beside._closed and beside.wants(ed, console):
            return
        render = render_console if self.stderr_format == "console" else render_json
        self._to_stderr(render(ed) + "\n")

    def _to_file(self, data: bytes | None) -> None:
        """Write ``data`` (None: only what is held), the held lines first; hold it while the
        file is a FIFO nobody reads. Called with the lock held."""
        try:
            fd = self._open()
        except logfile.NoReader:
            if data is not None:
                if self._held_bytes + len(data) > HELD_BYTES:
                    self._dropped += 1
                else:
                    self._held.append(data)
                    self._held_bytes += len(data)
            return
        except OSError as exc:
            self._give_up(exc)
            return
        try:
            while self._held:
                logfile.write_all(fd, self._held[0])
                self._held_bytes -= len(self._held.pop(0))
            if data is not None:
                logfile.write_all(fd, data)
        except OSError as exc:
            self._give_up(exc)  # full disk, file gone, a reader that left: never raise

    def _give_up(self, exc: OSError) -> None:
        """The file failed: never written again, and said once on stderr (the lines held for a
        FIFO's reader are lost with it, counted)."""
        lost = len(self._held) + self._dropped
        self._broken = True
        self._held.clear()
        self._held_bytes = self._dropped = 0
        self._close()
        code = errno.errorcode.get(exc.errno or 0, "")
        why = (
            f"{code} ({exc.strerror})" if code and exc.strerror else str(exc) or type(exc).__name__
        )
        held = f"; {lost} event line(s) held for it are lost" if lost else ""
        self._to_stderr(
            f"attnguard WARNING: ATTNGUARD_LOG: cannot write {self._shown_path()}: {why}; "
            f"the log file is given up{held}; from now on this process's warnings, errors and "
            "exit summary go to stderr\n"
        )

    def _shown_path(self) -> str:
        try:
            return self._opened or self.path()
        except Exception:
            return self.target

    def _to_stderr(self, line: str) -> None:
        stream = sys.stderr
        if stream is None or stream is self._dead_stream:
            return
        # The program's pending output first (its order is kept), then ours, past its buffer.
        with contextlib.suppress(Exception):
            stream.flush()
        raw = getattr(getattr(stream, "buffer", None), "raw", None)
        try:
            if raw is not None and callable(getattr(raw, "write", None)):
                enc = getattr(stream, "encoding", None) or "utf-8"
                _write_all(raw.write, line.encode(enc, "backslashreplace"))
            else:
                stream.write(line)
                stream.flush()
        except Exception:
            self._dead_stream = stream

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            if self._held and not self._broken and not self._closed:
                self._to_file(None)  # a reader that came since the last line
            unwritten = len(self._held) + self._dropped
            if unwritten and not self._broken:
                self._to_stderr(
                    f"attnguard WARNING: ATTNGUARD_LOG: no process opened the FIFO "
                    f"{self.path()} for reading; {unwritten} event line(s) of "
                    "this process were not written\n"
                )
            self._held.clear()
            self._held_bytes = self._dropped = 0
            self._closed = True
            self._close()
