"""The one place that decides which files attnguard may create, write, follow and trust.

attnguard touches files in three ways, each with its own rule (docs/files.md says the same):

* **the log file** (``ATTNGUARD_LOG``): created ``0666 & ~umask`` like any file the program
  writes, opened for appending. A symbolic link is followed only when it belongs to you or to
  root (so ``/dev/stderr`` and your own links work, while a link another user planted in a shared
  directory such as /tmp is refused: the ``fs.protected_symlinks`` rule, whatever the kernel's
  setting). An existing regular file of another user is refused too.
* **the job rendezvous directory** (ranks leave their exit counts there): created ``0700`` and
  used only when it is a real directory, not a link, owned by you and writable by no one else.
  Every file in it is created ``0600`` with ``O_EXCL | O_NOFOLLOW`` under a temporary name and
  renamed into place; a file is read only when it is a regular file of yours under a size bound.
  All of it goes through a descriptor of the checked directory, so nothing can be swapped in
  between the check and the use.
* **files handed to ``attnguard summary``**: read only when they are regular files (a FIFO or a
  device is refused without being opened), in bounded chunks (:mod:`attnguard.eventfiles`).
* **the kernel-decision cache** (``ATTNGUARD_KERNEL=fastest``,
  :mod:`attnguard.selection.cache`): a private directory as the rendezvous is (``0700``, ours,
  not writable by others), one ``0600`` file per decision written first-writer-wins, read under
  the same rules and a size bound.

Errors are :class:`UnsafeFile` (with the reason to show) or the OSError of the system call.
"""

from __future__ import annotations

import errno
import os
import stat

# Path limits of Linux (PATH_MAX, NAME_MAX): a longer value can only fail later, less clearly.
MAX_PATH = 4096
MAX_NAME = 255

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_MAX_LINK_HOPS = 40  # the kernel's own limit


class UnsafeFile(OSError):
    """A file or directory attnguard refuses to use; ``str()`` says why."""


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def _trusted_owner(uid: int) -> bool:
    me = _uid()
    return me is None or uid in (me, 0)


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def path_problem(path: str) -> str | None:
    """Why ``path`` can never name a file (length, a null byte), or None."""
    if "\0" in path:
        return "the path contains a null byte"
    if len(path.encode("utf-8", "surrogateescape")) >= MAX_PATH:
        return f"the path is {len(path)} characters long (at most {MAX_PATH - 1})"
    for part in path.split(os.sep):
        if len(part.encode("utf-8", "surrogateescape")) > MAX_NAME:
            return f"a path component is {len(part)} characters long (at most {MAX_NAME})"
    return None


def make_dirs(path: str, mode: int = 0o777) -> None:
    """``os.makedirs(path, exist_ok=True)`` without recursion (any depth, no RecursionError)."""
    missing = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        missing.append(p)
        up = os.path.dirname(p)
        if up == p:
            break
        p = up
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            if not os.path.isdir(d):
                raise


def check_links(path: str) -> None:
    """Raise UnsafeFile when following ``path`` would pass a symbolic link that belongs to
    someone other than you or root. Walks the chain of links of the last component (where an
    attacker plants them: a name in a shared directory); a link whose target cannot be looked
    at (a ``/proc/self/fd`` entry naming a pipe, a dangling link) ends the walk."""
    cur = os.path.abspath(path)
    for _ in range(_MAX_LINK_HOPS):
        try:
            st = os.lstat(cur)
        except OSError:
            return
        if not stat.S_ISLNK(st.st_mode):
            return
        if not _trusted_owner(st.st_uid):
            raise UnsafeFile(
                f"{cur} is a symbolic link that belongs to another user (uid {st.st_uid}); "
                "attnguard follows only your own links and root's"
            )
        cur = os.path.normpath(os.path.join(os.path.dirname(cur), os.readlink(cur)))
    raise UnsafeFile(f"{path}: too many levels of symbolic links")


def _check_opened_log(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and not _trusted_owner(st.st_uid):
        raise UnsafeFile(f"{path} belongs to another user (uid {st.st_uid})")


def open_log(path: str) -> int:
    """Open (creating it and its directories) the log file ``path`` for appending; returns the
    descriptor. Raises UnsafeFile or OSError."""
    why = path_problem(path)
    if why is not None:
        raise UnsafeFile(why)
    make_dirs(os.path.dirname(os.path.abspath(path)))
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | _CLOEXEC
    try:
        fd = os.open(path, flags | _NOFOLLOW, 0o666)
    except OSError:
        # ELOOP, or EACCES for O_CREAT on a link in a sticky directory: a link is there
        if not os.path.islink(path):
            raise
        check_links(path)  # follow it only when it is trusted
        fd = os.open(path, flags, 0o666)
    try:
        _check_opened_log(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def probe_log(path: str) -> None:
    """Open ``path`` as the guarded program will, then close it; a file created only for the
    probe is removed again. Raises UnsafeFile or OSError exactly where :func:`open_log` would.
    Something other than a regular file (a FIFO, a terminal) is not opened: an open and a close
    would be seen by whoever reads at the other end (a FIFO's reader would get its end)."""
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        check_links(path)
        if not os.access(path, os.W_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return
    existed = os.path.lexists(path)
    fd = open_log(path)
    try:
        created = not existed and stat.S_ISREG(os.fstat(fd).st_mode)
    finally:
        os.close(fd)
    if created:
        try:
            if os.stat(path).st_size == 0:
                os.unlink(path)
        except OSError:
            pass


def regular_file_problem(path: str) -> str | None:
    """Why ``path`` is not a regular file that can be read without blocking, or None (looked at
    with ``stat``: a FIFO or a device is never opened)."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # the open reports it
    return None if stat.S_ISREG(st.st_mode) else f"{_kind(st.st_mode)}, not a regular file"


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file ``path`` (a FIFO or device raises UnsafeFile
    without being opened for blocking reads)."""
    why = regular_file_problem(path)
    if why is not None:
        raise UnsafeFile(why)
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | _CLOEXEC)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # swapped since the stat
        os.close(fd)
        raise UnsafeFile(f"{_kind(st.st_mode)}, not a regular file")
    return fd


class PrivateDir:
    """A directory only this user can write to, used through a descriptor of it.

    Created ``0700`` (its parent must exist); an existing one is used only when it is a real
    directory (not a link), owned by this user, with no group or other write permission.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        try:
            self.fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                raise UnsafeFile(f"{path} is not a directory (a link or a file)") from None
            raise
        try:
            st = os.fstat(self.fd)
            me = _uid()
            if me is not None and st.st_uid != me:
                raise UnsafeFile(f"{path} belongs to another user (uid {st.st_uid})")
            if st.st_mode & 0o022:
                raise UnsafeFile(
                    f"{path} can be written by other users (mode {oct(st.st_mode & 0o7777)})"
                )
        except BaseException:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __enter__(self) -> PrivateDir:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _fresh(self, name: str, data: bytes) -> str:
        """A new ``0600`` temporary file beside ``name`` holding ``data``; returns its name."""
        tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=self.fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except BaseException:
            os.close(fd)
            self.remove(tmp)
            raise
        os.close(fd)
        return tmp

    def write(self, name: str, data: bytes) -> None:
        """Atomically make ``name`` hold ``data`` (``0600``, via a fresh temporary file)."""
        tmp = self._fresh(name, data)
        os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def write_first(self, name: str, data: bytes) -> bool:
        """Make ``name`` hold ``data`` unless it exists: the first writer wins (a hard link of
        a fresh ``0600`` temporary file, atomic). True when this call wrote it."""
        tmp = self._fresh(name, data)
        try:
            os.link(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=False)
            return True
        except FileExistsError:
            return False
        finally:
            self.remove(tmp)

    def read(self, name: str, max_bytes: int) -> tuple[bytes, float]:
        """(content, mtime) of ``name``: a regular file of this user of at most ``max_bytes``.
        Raises FileNotFoundError when absent, UnsafeFile when it is not to be trusted."""
        try:
            fd = os.open(name, os.O_RDONLY | _NOFOLLOW | _NONBLOCK | _CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.EMLINK):
                raise UnsafeFile(f"{name} is a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise UnsafeFile(f"{name} is {_kind(st.st_mode)}")
            me = _uid()
            if me is not None and st.st_uid != me:
                raise UnsafeFile(f"{name} belongs to another user (uid {st.st_uid})")
            if st.st_size > max_bytes:
                raise UnsafeFile(f"{name} is {st.st_size} bytes (at most {max_bytes})")
            chunks = []
            left = max_bytes + 1
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 16))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
            data = b"".join(chunks)
            if len(data) > max_bytes:
                raise UnsafeFile(f"{name} is over {max_bytes} bytes")
            return data, st.st_mtime
        finally:
            os.close(fd)

    def names(self) -> list[str]:
        try:
            return os.listdir(self.fd)
        except OSError:
            return []

    def remove(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except OSError:
            pass

    def remove_dir(self) -> None:
        """Remove the directory when it is empty (a late rank's file keeps it)."""
        try:
            os.rmdir(self.path)
        except OSError:
            pass


def user_temp_dir() -> PrivateDir:
    """This user's private directory under the system temp directory (``attnguard-<uid>``)."""
    import tempfile

    me = _uid()
    user = str(me) if me is not None else os.environ.get("USERNAME", "user")
    return PrivateDir(os.path.join(tempfile.gettempdir(), f"attnguard-{user}"))
