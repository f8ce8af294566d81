"""Who this process is in a launched job: rank, local rank and world size from the launcher's
environment (torchrun, accelerate, or set later by the program itself, as Ray actors do), and the
launch identity that tells a rank of its own from a helper of its parent. Read fresh at every call:
a variable set after start-up counts from then on. Imports ``os`` only: the start-up hook asks
:func:`helper_of_guarded_parent` in every guarded process."""

from __future__ import annotations

import os
import time

# When attnguard was first imported in this process: at start-up under the ATTNGUARD=1 hook (which
# activates only later, at the first import of a library to guard), else at ``import attnguard``.
# A job-summary rendezvous ignores files older than this (events.STARTED).
STARTED = time.time()


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


# What makes a process a rank of a job of its own: a child whose identity equals the one its
# guarded parent had is a helper of that parent (same RANK, same launch); one with another
# identity (a torchrun worker, a Ray actor once it set RANK) is a rank.
IDENTITY_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def launch_identity(environ: dict[str, str] | os._Environ[str] | None = None) -> str:
    """This process's launch identity now (see :data:`IDENTITY_VARS`), or that of ``environ``."""
    env = os.environ if environ is None else environ
    return "|".join(env.get(v, "") for v in IDENTITY_VARS)


_launcher: tuple[int, str] | None = None  # (this process's pid, its launcher_id)
_WRAPPER_DEPTH = 8  # wrappers of one rank to look through (a shell script, bash -c, env, ...)


def _proc(pid: int, name: str, limit: int = 1 << 20) -> bytes | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read(limit)
    except OSError:
        return None


def _identity_of(pid: int) -> str | None:
    """The launch identity process ``pid`` started with (None: not readable, another user's)."""
    data = _proc(pid, "environ")
    if data is None:
        return None
    pairs = (item.decode("utf-8", "replace").partition("=") for item in data.split(b"\0") if item)
    return launch_identity({key: value for key, _, value in pairs})


def launcher_id() -> str:
    """The launch this rank belongs to, the same for every rank it started: host name, pid and
    start time (a reused pid is another process) of the process that started it. That is the
    parent (torchrun's agent, ``mp.spawn``'s parent, a shell starting ranks in the background),
    looking through parents that are this rank itself: started with its launch identity (a
    wrapper script of one rank, ``torchrun --no-python``). Read once per process, so a launcher
    that ends first changes nothing."""
    global _launcher
    pid = os.getpid()
    if _launcher is None or _launcher[0] != pid:
        import socket

        mine = launch_identity()
        parent, started = os.getppid(), ""
        for _ in range(_WRAPPER_DEPTH + 1):
            stat = _proc(parent, "stat", 4096)
            if stat is None:
                break
            fields = stat.rsplit(b")", 1)[-1].split()
            started = fields[19].decode("ascii", "replace") if len(fields) > 19 else ""
            if parent <= 1 or _identity_of(parent) != mine:
                break
            parent = int(fields[1])  # a wrapper of this rank: its parent launched it
        _launcher = (pid, f"{socket.gethostname()}:{parent}:{started}")
    return _launcher[1]


# Set by a process when attnguard activates in it, for the children it starts from then on:
# "<pid>:<launch identity>". A child that finds another pid with its own launch identity (same
# RANK, same launch) is a helper of that process (DataLoader worker, a tokenizer or any tool it
# runs), not a rank of the job; a torchrun worker has a new identity (and a Ray actor gets one
# when it sets RANK: events.is_helper reads the identity again). A process that never activates
# marks nothing and passes on what it inherited: a Python wrapper of a rank (launcher -> python
# wrap.py -> python train.py) leaves its child a rank, and a tool an activated rank runs through
# such a wrapper is still that rank's helper. The cost: a child started before its parent
# activates is a program of its own, as it cannot be told apart from the rank a wrapper starts.
PARENT_VAR = "ATTNGUARD_INTERNAL_PARENT"
_decided: tuple[int, bool, str] | None = None  # (pid, helper, launch identity) as decided


def helper_of_guarded_parent() -> bool:
    """True when this process is a helper of a process where attnguard was active when it
    started this one (see :data:`PARENT_VAR`). Decided once: at start-up by the hook when it
    runs, else at activation; a forked child decides anew, and so does a helper whose launch
    identity has changed since (a Ray actor setting RANK before it imports what is guarded)."""
    global _decided
    me, mine = os.getpid(), launch_identity()
    if _decided is not None and _decided[0] == me and (not _decided[1] or _decided[2] == mine):
        return _decided[1]
    mark = os.environ.get(PARENT_VAR, "")
    pid, _, identity = mark.partition(":")
    helper = bool(mark) and pid != str(me) and identity == mine
    _decided = (me, helper, mine)
    return helper


def mark_process() -> bool:
    """At activation: True when this process is a helper of a guarded parent; otherwise mark it
    the parent of the children it starts from now on (they inherit the variable)."""
    helper = helper_of_guarded_parent()
    if not helper:
        os.environ[PARENT_VAR] = f"{os.getpid()}:{launch_identity()}"
    return helper
