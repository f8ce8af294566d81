"""``--smoke``, shared by every benchmark: CI runs each bench this way (tests/test_bench_smoke.py)
so none of them rots between the runs that measure.

A smoke run takes seconds on a CPU: the smallest shapes and one round, the bench's own code paths
(argument parsing, model building, the guarded and unguarded runs, the report) on what this
machine has. What needs hardware it lacks (a CUDA GPU, two of them, the real flash-attn) is not
faked: each such part prints one ``SMOKE <bench>: skipped <part>: <why>`` line. The numbers a
smoke run prints mean nothing; it ends with ``SMOKE <bench>: ok`` when everything it ran worked.
"""

from __future__ import annotations

import os

_ran: list[str] = []


def _name() -> str:
    import __main__

    return os.path.basename(getattr(__main__, "__file__", "bench")).removesuffix(".py")


def ran(part: str) -> None:
    """Say that ``part`` ran (its code, at smoke size)."""
    _ran.append(part)
    print(f"SMOKE {_name()}: ran {part}", flush=True)


def skipped(part: str, why: str) -> None:
    """Say that ``part`` did not run here, and why."""
    print(f"SMOKE {_name()}: skipped {part}: {why}", flush=True)


def done() -> int:
    """The last line of a smoke run; exit status 0 (1 when nothing ran at all)."""
    if not _ran:
        print(f"SMOKE {_name()}: nothing ran", flush=True)
        return 1
    print(f"SMOKE {_name()}: ok", flush=True)
    return 0


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
