"""Who this process is in a launched job: rank, local rank and world size from the launcher's
environment (torchrun, accelerate, or set later by the program itself, as Ray actors do), and the
launch identity that tells a rank of its own from a helper of its parent. Read fresh at every call:
a variable set after start-up counts from then on."""

from __future__ import annotations

import os


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
