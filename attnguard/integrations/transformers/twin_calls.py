"""What reaches attnguard's twins of transformers' flash path, recorded for the exit summary's
advice (:mod:`attnguard.observability.workload`): packed rows and sliding windows, which
transformers' sdpa path does not compute as flash does, so the advice never sends a job that had
them there.

Nothing is read from a tensor. A sliding window is a keyword of the registry call. Packed rows
are what transformers' flash path itself found: it calls ``flash_attn_varlen_func`` for a
registry call without an attention mask only for packed rows (``position_ids`` restarting, read by
its own ``_is_packed_sequence``, or ``cu_seq_lens_*`` given); with a mask it unpads a padded
batch instead. So the registry entry, while the twins serve it, marks whether the call on this
thread came without a mask, and the varlen twin handed to the flash path reads the mark. Neither
records anything inside a ``torch.compile`` trace, nor once everything is known.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...observability import workload

_is_compiling = torch.compiler.is_compiling
_call = threading.local()  # .maskless: the registry call on this thread came without a mask
WATCH = [True]  # False once every fact below is known: the registry entry stops marking calls


def note_registry_call(mask: Any, kwargs: dict[str, Any]) -> None:
    """A flash registry call the twins serve (outside a compiled graph): mark whether it came
    without a mask, and note a sliding window."""
    _call.maskless = mask is None
    if not workload.seen(workload.TWIN_CALLS):
        workload.note(workload.TWIN_CALLS)
    window = kwargs.get("sliding_window")
    if type(window) is int and window > 0 and not workload.seen(workload.SLIDING_WINDOW):
        workload.note(workload.SLIDING_WINDOW)
    if workload.seen(workload.PACKED_ROWS) and workload.seen(workload.SLIDING_WINDOW):
        WATCH[0] = False


@functools.cache
def recording_varlen(twin: Callable[..., Any]) -> Callable[..., Any]:
    """``twin`` (the varlen twin as transformers' flash path gets it), noting packed rows."""

    @functools.wraps(twin)
    def flash_attn_varlen_func(*args: Any, **kwargs: Any) -> Any:
        if WATCH[0] and not _is_compiling() and getattr(_call, "maskless", False):
            workload.note(workload.PACKED_ROWS)
        return twin(*args, **kwargs)

    return flash_attn_varlen_func


@contextmanager
def unwatched() -> Iterator[None]:
    """While open, this thread's calls are not the program's (the probe's own, on stand-ins)."""
    before = getattr(_call, "maskless", False)
    _call.maskless = False
    try:
        yield
    finally:
        _call.maskless = before


def reset() -> None:
    """Watch again (tests, after the recorded facts were forgotten)."""
    WATCH[0] = True
    _call.maskless = False
