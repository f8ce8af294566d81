"""The log file (``ATTNGUARD_LOG``): which file a process's events go to, opened and written so
that it can neither hang the program nor hand its events to another user (docs/files.md, "The
log file"). Paths are walked under :mod:`attnguard.safefiles`' rules (links only of yours or
root's, through descriptors).

* **opened without waiting** (``O_NONBLOCK``, ``O_NOCTTY``): opening a FIFO for writing would
  otherwise wait for a reader. A FIFO of yours that no process reads yet raises
  :class:`NoReader`: the sink holds its lines and tries the open again at its next line (a log
  shipper started after the program gets them all, the held ones first).
* **another user's file of any kind** at the end of the path (a regular file, a FIFO, a device,
  a socket, a directory) is never opened, nor written: the events go to a fresh file nobody can
  predict, beside it or in your private directory, as for another user's link on the way
  (:func:`open_log`; ``refused`` says why). Its owner is read before the open and again on the
  descriptor, so nothing swapped in between is written. The process's own streams reached
  through ``/proc`` (``/dev/stderr``) are the exception: the process holds them already.
* **written without waiting long**: a FIFO or device stays non-blocking; a line it cannot take
  waits at most :data:`WRITE_WAIT_S` for room (:func:`write_all`), then the file is given up like
  any file that fails a write (a reader that stopped reading must not stop the program). The
  process's own streams are written as the program writes them (blocking).
* created ``0666 & ~umask`` like any file the program writes, with its missing directories,
  and opened for appending.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from ..safefiles import (
    ForeignFile,
    UnsafeFile,
    Walk,
    absolute,
    check_link,
    kind_of,
    path_problem,
    private_dir,
    trusted_owner,
    walk_to,
)

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOCTTY = getattr(os, "O_NOCTTY", 0)  # a terminal of yours never becomes the controlling one
_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_APPEND | _CLOEXEC | _NONBLOCK | _NOCTTY
WRITE_WAIT_S = 2.0  # a FIFO's reader that takes nothing for this long is given up


class NoReader(OSError):
    """The log path is a FIFO of yours that no process has open for reading (yet)."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.ENXIO, "a FIFO that no process has open for reading", path)


def _stat(directory: int, name: str, follow: bool) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=directory, follow_symlinks=follow)
    except OSError:
        return None


def _refuse_foreign(st: os.stat_result, shown: str) -> None:
    if trusted_owner(st.st_uid):
        return
    what = "" if stat.S_ISREG(st.st_mode) else f" is {kind_of(st.st_mode)} that"
    raise ForeignFile(f"{shown}{what} belongs to another user (uid {st.st_uid})")


def _set_blocking(fd: int) -> None:
    try:
        import fcntl

        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    except (ImportError, OSError):
        pass  # left non-blocking: write_all waits for room (bounded)


def _open_at(path: str) -> int:
    walk, name, magic = walk_to(path, create_dirs=True)
    try:
        shown = walk.shown(name)
        if not magic:  # another user's file is not even opened (a FIFO's reader would see it)
            st = _stat(walk.fd, name, follow=False)
            if st is not None and not stat.S_ISLNK(st.st_mode):
                _refuse_foreign(st, shown)
        try:
            fd = os.open(name, _FLAGS | (0 if magic else _NOFOLLOW), 0o666, dir_fd=walk.fd)
        except OSError as exc:
            # EACCES for a file of another user in a sticky directory (fs.protected_regular,
            # fs.protected_fifos), ELOOP for a link swapped in since the walk, ENXIO for a FIFO
            # nobody reads: name which
            st = _stat(walk.fd, name, follow=magic)
            if st is not None and stat.S_ISLNK(st.st_mode):
                check_link(st, shown)
            if st is not None and not magic:
                _refuse_foreign(st, shown)
            if exc.errno == errno.ENXIO and st is not None and stat.S_ISFIFO(st.st_mode):
                raise NoReader(path) from None
            raise
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) or not magic:  # swapped since the look above
                _refuse_foreign(st, shown)
            if magic:
                _set_blocking(fd)  # the process's own stream, written as it writes it
        except BaseException:
            os.close(fd)
            raise
        return fd
    finally:
        walk.close()


class OpenedLog:
    """A log file opened for appending: ``fd``, the ``path`` it has, and ``refused``: why the
    path asked for was not used (another user's link or file there), else None."""

    __slots__ = ("fd", "path", "refused")

    def __init__(self, fd: int, path: str, refused: str | None = None) -> None:
        self.fd, self.path, self.refused = fd, path, refused


def _fresh_name(name: str) -> str:
    """``ag-0.jsonl`` -> ``ag-0.<16 random hex digits>.jsonl``: nobody can predict it."""
    stem, dot, ext = name.rpartition(".")
    token = os.urandom(8).hex()
    return f"{stem}.{token}.{ext}" if dot and stem else f"{name}.{token}"


def _fresh_log(directory: int, shown: str, name: str) -> OpenedLog:
    fresh = _fresh_name(name)
    flags = _FLAGS | os.O_EXCL | _NOFOLLOW
    fd = os.open(fresh, flags, 0o666, dir_fd=directory)
    return OpenedLog(fd, os.path.join(shown, fresh))


def open_log(path: str) -> OpenedLog:
    """Open (creating it and its directories) the log file ``path`` for appending, never
    waiting.

    Where another user occupies the path (their link anywhere on it, their file of any kind at
    its end), the events go to a fresh file nobody can predict instead: beside it when its
    directory is reached through trusted links, else in your private directory
    (:func:`attnguard.safefiles.private_dir`); ``refused`` says why. Raises :class:`NoReader`
    for a FIFO of yours that nobody reads yet, UnsafeFile or OSError when no file can be
    opened."""
    why = path_problem(path)
    if why is not None:
        raise UnsafeFile(why)
    try:
        return OpenedLog(_open_at(path), path)
    except ForeignFile as exc:
        refused = str(exc)
    except (UnsafeFile, NoReader):
        raise
    except OSError as exc:  # named by the path asked for (the walk knows one component)
        raise OSError(exc.errno, exc.strerror, path) from None
    name = os.path.basename(path) or "attnguard.jsonl"
    try:
        try:
            walk = Walk(os.path.dirname(absolute(path)), create=True)
        except ForeignFile:
            with private_dir() as own:
                opened = _fresh_log(own.fd, own.path, name)
        else:
            try:
                opened = _fresh_log(walk.fd, walk.shown(), name)
            finally:
                walk.close()
    except OSError as exc:
        why = str(exc) if isinstance(exc, UnsafeFile) else exc.strerror or type(exc).__name__
        raise UnsafeFile(f"{refused}; no file of this process's own instead: {why}") from None
    opened.refused = refused
    return opened


def _wait_for_room(fd: int, seconds: float) -> None:
    try:
        import select

        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        poller.poll(max(1, int(seconds * 1000)))
    except (ImportError, AttributeError, OSError, ValueError):
        time.sleep(min(seconds, 0.01))


def write_all(fd: int, data: bytes) -> None:
    """Write ``data`` (one line) whole to the log's descriptor; a non-blocking FIFO or device
    that takes nothing for :data:`WRITE_WAIT_S` raises TimeoutError (the sink then gives the file
    up). A regular file keeps whole lines only: where a write error (a full disk, a file-size
    limit) cuts the line short, the part written is taken back before the error is raised."""
    view = memoryview(data)
    deadline = None
    try:
        while view:
            try:
                n = os.write(fd, view)
            except BlockingIOError:
                n = 0
            if n:
                view = view[n:]
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + WRITE_WAIT_S
            if now >= deadline:
                raise TimeoutError(errno.ETIMEDOUT, f"no room in the log for {WRITE_WAIT_S:g} s")
            _wait_for_room(fd, deadline - now)
    except OSError:
        if 0 < len(view) < len(data):
            _take_back(fd, len(data) - len(view))
        raise


def _take_back(fd: int, written: int) -> None:
    """Cut the last ``written`` bytes (a line the disk took only part of) off a regular file,
    where they are still its end (nothing appended after them)."""
    try:
        st = os.fstat(fd)
        end = os.lseek(fd, 0, os.SEEK_CUR)
        if stat.S_ISREG(st.st_mode) and st.st_size == end and end >= written:
            os.ftruncate(fd, end - written)
    except OSError:
        pass
