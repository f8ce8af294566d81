"""What happened in this process that the exit summary's advice depends on: the facts it records.

The advice for a reason code (:mod:`attnguard.observability.advice`) is a function of these facts,
never a fixed string: whether this process saw a CUDA GPU (and which compute capability), and
what reached attnguard's twins of transformers' flash code path (packed rows, sliding windows),
so that a hint that could not be followed here, or one that would change the numbers, is not
given. The facts travel with the summary (the ``facts`` field of a ``summary`` event and of a
rank's record), so ``attnguard summary FILES`` and rank 0's job summary advise from the facts of
the processes that had the events, not from the machine that reads them.

Recording is cheap and happens outside any ``torch.compile`` trace: callers check
``torch.compiler.is_compiling()`` first. A fact is only ever set, never cleared (a fork keeps its
parent's: they describe the same program).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# the facts recorded while the program runs (set once, never cleared)
PACKED_ROWS = "packed_rows"  # transformers' flash path on the twins got packed rows (varlen)
SLIDING_WINDOW = "sliding_window"  # a sliding window reached the twins of the flash path
TWIN_CALLS = "twin_calls"  # a flash call on the twins was seen outside a compiled graph
# read at the summary, from what attnguard.facts read during the run (never read for the summary)
DEVICE = "device"  # "cuda" / "cpu"; absent when this process never looked
CAPABILITY = "capability"  # the compute capability of this rank's GPU, "9.0"

FLAGS = (PACKED_ROWS, SLIDING_WINDOW, TWIN_CALLS)

_lock = threading.Lock()
_flags: dict[str, bool] = {}
# () -> {"device": ..., "capability": ...} from what the guard already read; set at activation
_machine: list[Callable[[], dict[str, Any]]] = []


def note(flag: str) -> None:
    """Record that ``flag`` (one of :data:`FLAGS`) happened in this process."""
    if not _flags.get(flag):
        with _lock:
            _flags[flag] = True


def seen(flag: str) -> bool:
    return bool(_flags.get(flag))


def set_machine_reader(reader: Callable[[], dict[str, Any]]) -> None:
    """``reader()`` returns this process's device facts (``device``, ``capability``) from what
    attnguard already read; it is never made to read anything new at exit."""
    _machine[:] = [reader]


def snapshot() -> dict[str, Any]:
    """This process's facts as they travel in its summary and its rank record."""
    out: dict[str, Any] = {}
    if _machine:
        try:
            out.update(clean(_machine[0]()))
        except Exception:
            pass  # the advice then says what holds on any machine
    with _lock:
        out.update({k: True for k, v in _flags.items() if v})
    return out


def clean(raw: Any) -> dict[str, Any]:
    """The facts of ``raw`` that attnguard knows, checked (a file of another version, or edited,
    yields only what is well-formed)."""
    out: dict[str, Any] = {}
    if not isinstance(raw, Mapping):
        return out
    for flag in FLAGS:
        if raw.get(flag) is True:
            out[flag] = True
    if raw.get(DEVICE) in ("cuda", "cpu"):
        out[DEVICE] = raw[DEVICE]
    cap = raw.get(CAPABILITY)
    if out.get(DEVICE) == "cuda" and isinstance(cap, str) and _capability(cap) is not None:
        out[CAPABILITY] = cap
    return out


def _capability(text: str) -> tuple[int, int] | None:
    major, _, minor = text.partition(".")
    if major.isdigit() and minor.isdigit() and len(text) <= 7:
        return int(major), int(minor)
    return None


def merge(many: Iterable[Any]) -> dict[str, Any]:
    """The facts of several processes (a job's ranks, the files ``attnguard summary`` reads): a
    flag holds when it held anywhere; a GPU when any process had one, with the lowest compute
    capability among them (what every rank's GPU can run)."""
    out: dict[str, Any] = {}
    caps: list[tuple[tuple[int, int], str]] = []
    for raw in many:
        one = clean(raw)
        for flag in FLAGS:
            if one.get(flag):
                out[flag] = True
        device = one.get(DEVICE)
        if device == "cuda" or (device == "cpu" and DEVICE not in out):
            out[DEVICE] = device
        cap = one.get(CAPABILITY)
        if cap is not None:
            parsed = _capability(cap)
            if parsed is not None:
                caps.append((parsed, cap))
    if out.get(DEVICE) == "cuda" and caps:
        out[CAPABILITY] = min(caps)[1]
    return out


def reset() -> None:
    """Forget the recorded flags (tests)."""
    with _lock:
        _flags.clear()
