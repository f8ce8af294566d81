"""Who this process is in a launched job: rank, local rank and world size from the launcher's
environment (torchrun, accelerate, or set later by the program itself, as Ray actors do), and the
launch identity that tells a rank of its own from a helper of its parent. Read fresh at every call:
a variable set after start-up counts from then on. Imports ``os`` only: the start-up hook marks
every guarded process with :func:`mark_process`."""

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


def launch_identity() -> str:
    """This process's launch identity now (see :data:`IDENTITY_VARS`)."""
    env = os.environ
    return "|".join(env.get(v, "") for v in IDENTITY_VARS)


# Set by a guarded process for its children: "<pid>:<launch identity>". A child that finds another
# pid with its own launch identity (same RANK, same launch) is a helper of that process
# (DataLoader worker, a tool it runs), not a rank of the job; a torchrun worker has a new identity
# (and a Ray actor gets one when it sets RANK: events.is_helper reads the identity again).
PARENT_VAR = "ATTNGUARD_INTERNAL_PARENT"
_marked: tuple[int, bool] | None = None  # (pid, helper) as decided in this process


def mark_process() -> bool:
    """True when this process is a helper of a guarded parent; otherwise mark it the parent of
    its own children (they inherit the variable). Decided once per process: at start-up by the
    hook when it runs (so children it starts before attnguard activates are its helpers), else
    at activation; a forked child decides anew."""
    global _marked
    me = os.getpid()
    if _marked is not None and _marked[0] == me:
        return _marked[1]
    mark = os.environ.get(PARENT_VAR, "")
    pid, _, identity = mark.partition(":")
    helper = bool(mark) and pid != str(me) and identity == launch_identity()
    if not helper:
        os.environ[PARENT_VAR] = f"{me}:{launch_identity()}"
    _marked = (me, helper)
    return helper
