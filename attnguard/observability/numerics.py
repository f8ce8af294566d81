"""This process's counts of the opt-in numbers check (``ATTNGUARD_VERIFY``, :mod:`attnguard.verify`):
how many sampled attention calls were checked against their family's reference, how many of those
did not match (each kind of mismatch is also a ``numerics_mismatch`` event), and how many sampled
calls were skipped, and why. They travel with the exit summary (the ``numerics`` field of a
``summary`` event and of a rank's record), so rank 0's job summary gives them per rank.

Skip reasons (a sampled call that was not compared):

* ``cuda_graph_capture``: the call ran while a CUDA graph was being captured (a reference computed
  there would be captured into the graph);
* ``dropout``: the call drops out (training with ``dropout > 0``): no two computations agree;
* ``no_reference``: attnguard knows no reference for the kernel (its semantics are its own: a
  user's attention function, flex attention, a paged entry that updates its cache inside);
* ``unsupported``: arguments the reference does not compute (paged KV caches, ...);
* ``too_large``: the reference would hold more memory than the check allows itself;
* ``error``: the check itself failed (one ``internal_error`` event says where).

Calls traced into a ``torch.compile`` graph are neither checked nor counted: the guard's Python
does not run when the compiled graph does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Mapping
from typing import Any

SKIP_REASONS = (
    "cuda_graph_capture",
    "dropout",
    "no_reference",
    "unsupported",
    "too_large",
    "error",
)
_MAX_COUNT = 1 << 62

_lock = threading.Lock()
_counts = {"checked": 0, "mismatched": 0}
_skipped: dict[str, int] = {}


def note_checked(mismatched: bool) -> None:
    with _lock:
        _counts["checked"] += 1
        if mismatched:
            _counts["mismatched"] += 1


def note_skipped(reason: str) -> None:
    with _lock:
        _skipped[reason] = _skipped.get(reason, 0) + 1


def snapshot() -> dict[str, Any]:
    """``{"checked", "mismatched", "skipped": {reason: n}}``, or ``{}`` where nothing was sampled."""
    with _lock:
        if not _counts["checked"] and not _skipped:
            return {}
        return {**_counts, "skipped": dict(sorted(_skipped.items()))}


def _count(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < _MAX_COUNT:
        return None
    return value


def clean(raw: Any) -> dict[str, Any]:
    """The well-formed part of a record's ``numerics`` (another version's, or edited: only what
    checks out; ``{}`` for none)."""
    if not isinstance(raw, Mapping):
        return {}
    checked, mismatched = _count(raw.get("checked", 0)), _count(raw.get("mismatched", 0))
    if checked is None or mismatched is None or mismatched > checked:
        return {}
    skipped: dict[str, int] = {}
    given = raw.get("skipped", {})
    if isinstance(given, Mapping):
        for reason in SKIP_REASONS:
            n = _count(given.get(reason))
            if n:
                skipped[reason] = n
    if not checked and not skipped:
        return {}
    return {"checked": checked, "mismatched": mismatched, "skipped": skipped}


def merge(per_rank: Iterable[tuple[int, Any]]) -> dict[str, Any]:
    """Totals over ranks and each rank's own counts (``per_rank``), or ``{}`` where no rank
    sampled a call."""
    total: dict[str, Any] = {"checked": 0, "mismatched": 0, "skipped": {}, "per_rank": {}}
    for rank, raw in per_rank:
        one = clean(raw)
        if not one:
            continue
        total["per_rank"][str(rank)] = one
        total["checked"] += one["checked"]
        total["mismatched"] += one["mismatched"]
        for reason, n in one["skipped"].items():
            total["skipped"][reason] = total["skipped"].get(reason, 0) + n
    return total if total["per_rank"] else {}


def headline(numerics: Mapping[str, Any]) -> str:
    """The summary's words for the counts ("" where nothing was sampled)."""
    if not numerics:
        return ""
    skipped = sum(numerics.get("skipped", {}).values())
    text = (
        f"numbers checked on {numerics['checked']} sampled attention call(s), "
        f"{numerics['mismatched']} mismatched"
    )
    if skipped:
        why = ", ".join(f"{r} {n}" for r, n in numerics["skipped"].items())
        text += f", {skipped} skipped ({why})"
    per_rank = numerics.get("per_rank")
    if per_rank and len(per_rank) > 1:
        text += (
            " (per rank: "
            + "; ".join(
                f"{r}: {c['checked']} checked, {c['mismatched']} mismatched"
                for r, c in per_rank.items()
            )
            + ")"
        )
    return text


def reset() -> None:
    """Forget the counts (tests; a forked child starts its own)."""
    with _lock:
        _counts.update(checked=0, mismatched=0)
        _skipped.clear()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _counts.update(checked=0, mismatched=0)
    _skipped.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
