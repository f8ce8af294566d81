"""The one place that decides which files attnguard may create, write, follow and trust.

attnguard touches files in these ways, each with its own rule (docs/files.md says the same):

* **every path** is walked one directory at a time through descriptors (:class:`Walk`): a
  symbolic link anywhere on it is followed only when it belongs to you or to root (so
  ``/dev/stderr`` and your own links work, while a link another user planted in a shared
  directory such as /tmp is refused: the ``fs.protected_symlinks`` rule, whatever the kernel's
  setting, for directories on the way too), and nothing can be swapped in between a check and
  the use.
* **the log file** (``ATTNGUARD_LOG``): its rules are :mod:`attnguard.observability.logfile`'s
  (opened without ever waiting; another user's file of any kind is never opened), on this
  module's walk.
* **your private directory** (:func:`private_dir`): ``$XDG_RUNTIME_DIR/attnguard``, else
  ``~/.cache/attnguard/run``, else ``$TMPDIR/attnguard-<uid>``: the first that is a real
  directory of yours no one else can write to. Nobody else can create anything in the first
  two, so knowing their names gives nothing.
* **the job rendezvous directory** (ranks leave their exit counts there): created ``0700`` and
  used only when it is a real directory, not a link, owned by you and writable by no one else
  (:class:`PrivateDir`). Every file in it is created ``0600`` with ``O_EXCL | O_NOFOLLOW`` under
  a temporary name and renamed into place; a file is read only when it is a regular file of
  yours under a size bound. All of it goes through a descriptor of the checked directory.
* **files handed to ``attnguard summary``**: read only when they are regular files (a FIFO or a
  device is refused without being opened), in bounded chunks (:mod:`attnguard.observability.eventfiles`).
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

TYPE_CHECKING = False  # typing is not imported at start-up (the hook may load this module)
if TYPE_CHECKING:
    from collections.abc import Mapping

# Path limits of Linux (PATH_MAX, NAME_MAX): a longer value can only fail later, less clearly.
MAX_PATH = 4096
MAX_NAME = 255

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_MAX_LINK_HOPS = 40  # the kernel's own limit
# Directories on a walk: O_PATH (Linux) needs no read permission, only search on the way.
_DIR_WALK = (getattr(os, "O_PATH", 0) or os.O_RDONLY) | _DIRECTORY | _NOFOLLOW | _CLOEXEC


class UnsafeFile(OSError):
    """A file or directory attnguard refuses to use; ``str()`` says why."""


class ForeignFile(UnsafeFile):
    """Refused because another user's link or file stands there (a path they occupy)."""


def _uid() -> int | None:
    return os.geteuid() if hasattr(os, "geteuid") else None


def trusted_owner(uid: int) -> bool:
    me = _uid()
    return me is None or uid in (me, 0)


def kind_of(mode: int) -> str:
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


def absolute(path: str) -> str:
    """``path`` made absolute without collapsing ``..`` in text (the walk takes it physically)."""
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


def _parts(path: str) -> list[str]:
    return [p for p in path.split(os.sep) if p not in ("", ".")]


def check_link(st: os.stat_result, shown: str) -> None:
    if not trusted_owner(st.st_uid):
        raise ForeignFile(
            f"{shown} is a symbolic link that belongs to another user (uid {st.st_uid}); "
            "attnguard follows only your own links and root's"
        )


class Walk:
    """A directory reached one component at a time through descriptors: a symbolic link on the
    way is followed only after its owner was checked (you or root), so nothing another user
    planted anywhere on a path is followed, and nothing can be swapped in between the check and
    the use. ``fd`` is the directory's descriptor, ``real`` its path with every link resolved."""

    def __init__(self, path: str, create: bool = False, mode: int = 0o777) -> None:
        self.fd = os.open("/", _DIR_WALK)
        self.real: list[str] = []
        self.hops = 0
        try:
            self.enter(_parts(absolute(path)), create, mode)
        except BaseException:
            self.close()
            raise

    def shown(self, name: str = "") -> str:
        return os.sep + os.sep.join([*self.real, name] if name else self.real)

    def in_proc(self) -> bool:
        """In /proc, whose links (``/proc/self/fd/2``, where ``/dev/stderr`` leads) name files a
        process holds open: only the kernel can follow them."""
        return bool(self.real) and self.real[0] == "proc"

    def _move(self, name: str) -> None:
        fd = os.open(name, _DIR_WALK, dir_fd=self.fd)
        try:
            if not stat.S_ISDIR(os.fstat(fd).st_mode):  # swapped for something else
                raise UnsafeFile(f"{self.shown(name)} is not a directory")
        except BaseException:
            os.close(fd)
            raise
        os.close(self.fd)
        self.fd = fd

    def follow(self, name: str, st: os.stat_result) -> list[str]:
        """The components a trusted link ``name`` of this directory stands for (an absolute
        target restarts the walk at the root)."""
        self.hops += 1
        if self.hops > _MAX_LINK_HOPS:
            raise UnsafeFile(f"{self.shown(name)}: too many levels of symbolic links")
        check_link(st, self.shown(name))
        target = os.readlink(name, dir_fd=self.fd)
        if os.path.isabs(target):
            self._move("/")
            self.real = []
        return _parts(target)

    def enter(self, parts: list[str], create: bool = False, mode: int = 0o777) -> None:
        todo = list(reversed(parts))
        while todo:
            name = todo.pop()
            if name == "..":
                self._move("..")
                self.real = self.real[:-1]
                continue
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, mode, dir_fd=self.fd)
                except FileExistsError:
                    pass
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                todo.extend(reversed(self.follow(name, st)))
                continue
            self._move(name)
            self.real.append(name)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def walk_to(path: str, create_dirs: bool) -> tuple[Walk, str, bool]:
    """(the directory, the final name in it, whether the kernel must follow that name): every
    link on the way and at the end is checked, the end's chain followed to what it names."""
    head, name = os.path.split(absolute(path))
    walk = Walk(head, create=create_dirs)
    try:
        while True:
            try:
                st = os.stat(name, dir_fd=walk.fd, follow_symlinks=False)
            except FileNotFoundError:
                return walk, name, False  # to be created
            if not stat.S_ISLNK(st.st_mode):
                return walk, name, False
            if walk.in_proc():
                check_link(st, walk.shown(name))
                return walk, name, True
            parts = walk.follow(name, st)
            if not parts:
                raise UnsafeFile(f"{walk.shown(name)} is a link to nothing")
            walk.enter(parts[:-1])
            name = parts[-1]
    except BaseException:
        walk.close()
        raise


def make_dirs(path: str, mode: int = 0o777) -> None:
    """``os.makedirs(path, exist_ok=True)`` without recursion (any depth), following only
    trusted links on the way (UnsafeFile otherwise)."""
    Walk(path, create=True, mode=mode).close()


def check_links(path: str) -> None:
    """Raise UnsafeFile when following ``path`` would pass a symbolic link that belongs to
    someone other than you or root: every link on the way (directories included) and the chain
    of the last component."""
    walk, _name, _magic = walk_to(path, create_dirs=False)
    walk.close()


def regular_file_problem(path: str) -> str | None:
    """Why ``path`` is not a regular file that can be read without blocking, or None (looked at
    with ``stat``: a FIFO or a device is never opened)."""
    try:
        st = os.stat(path)
    except OSError:
        return None  # the open reports it
    return None if stat.S_ISREG(st.st_mode) else f"{kind_of(st.st_mode)}, not a regular file"


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
        raise UnsafeFile(f"{kind_of(st.st_mode)}, not a regular file")
    return fd


class PrivateDir:
    """A directory only this user can write to, used through a descriptor of it.

    Created ``0700`` (its parent must exist); an existing one is used only when it is a real
    directory (not a link), owned by this user, with no group or other write permission.
    """

    def __init__(self, path: str, parent: int | None = None) -> None:
        """``parent``: a descriptor of the directory ``path`` names an entry of (else its
        parent is reached through trusted links only, as every path here)."""
        self.path = path
        name = os.path.basename(path)
        walk = None
        if parent is None:
            walk = Walk(os.path.dirname(absolute(path)))
            parent = walk.fd
        try:
            try:
                os.mkdir(name, 0o700, dir_fd=parent)
            except FileExistsError:
                pass
            try:
                self.fd = os.open(
                    name, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=parent
                )
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
                    raise UnsafeFile(f"{path} is not a directory (a link or a file)") from None
                raise
        finally:
            if walk is not None:
                walk.close()
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

    def sub(self, name: str) -> PrivateDir:
        """The private directory ``name`` inside this one (created ``0700`` if need be)."""
        return PrivateDir(os.path.join(self.path, name), parent=self.fd)

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
                raise UnsafeFile(f"{name} is {kind_of(st.st_mode)}")
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


_IN_CACHE = os.path.join("attnguard", "run")


def private_dir_candidates(environ: Mapping[str, str] | None = None) -> list[str]:
    """Where this user's private directory may be, best first (see :func:`private_dir`); the
    one under the cache directory is the one whose parents may be made."""
    env = os.environ if environ is None else environ
    out = []
    runtime = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        out.append(os.path.join(runtime, "attnguard"))
    cache = env.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):
        home = env.get("HOME") or os.path.expanduser("~")
        cache = os.path.join(home, ".cache") if os.path.isabs(home) else ""
    if cache:
        out.append(os.path.join(cache, _IN_CACHE))
    me = _uid()
    user = str(me) if me is not None else env.get("USERNAME", "user")
    tmp = next((env[v] for v in ("TMPDIR", "TEMP", "TMP") if os.path.isabs(env.get(v, ""))), "/tmp")
    out.append(os.path.join(tmp, f"attnguard-{user}"))
    return out


def private_dir(environ: Mapping[str, str] | None = None) -> PrivateDir:
    """This user's private directory: the first of :func:`private_dir_candidates` that is (or
    can be made) a :class:`PrivateDir`. ``$XDG_RUNTIME_DIR/attnguard`` (a directory only you
    can write to, made by your login session), else ``$XDG_CACHE_HOME/attnguard/run`` (in your
    home), else ``$TMPDIR/attnguard-<uid>``: a name in a shared directory that another user
    could take first, used only when neither of the others can be. Raises UnsafeFile naming
    what each candidate lacked."""
    tried = []
    for path in private_dir_candidates(environ):
        try:
            if path.endswith(_IN_CACHE):
                make_dirs(os.path.dirname(path))  # the cache's parents, as any program makes them
            return PrivateDir(path)
        except OSError as exc:
            why = str(exc) if isinstance(exc, UnsafeFile) else exc.strerror or type(exc).__name__
            tried.append(f"{path}: {why}")
    raise UnsafeFile("no private directory (" + "; ".join(tried) + ")")
