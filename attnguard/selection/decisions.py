"""The decisions: made once per bucket, the same on every rank of a job, said once
(``kernel_selected``).

:func:`serve` is called by the call-time guard (:mod:`attnguard.callguard`) for every flash-attn
call the real kernel could compute while ``ATTNGUARD_KERNEL=fastest`` is on, with the settings it
needs (:class:`Options`). It answers with the candidate that computes the call (None: the
requested kernel). For a bucket seen for the first time it looks in this order:

1. this process's decisions;
2. the job's: with a process group up, its store holds the decision the first rank to decide
   posted (``compare_set``: the first writer wins, every rank adopts that value: ranks never
   diverge, and nobody waits for anybody);
3. the disk cache (:mod:`attnguard.selection.cache`);
4. a race on the call's own inputs (:mod:`attnguard.selection.race`), at most :data:`BUDGET_S`
   seconds per process in total (a race that would overrun it is not started). With several
   ranks, what a rank decided (a winner, or "the requested kernel" when its budget is spent) is
   posted to the store and the first posted decision is everybody's.

It never races inside a ``torch.compile`` trace or while a CUDA graph is being captured (the
decision must exist before: the first eager call makes it), under
``torch.use_deterministic_algorithms(True)`` (no candidate is vouched deterministic), or with
several ranks and no process group (a race's winner could differ per rank: a decision already in
this node's disk cache is used, else the requested kernel computes).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from .. import events
from . import buckets, cache, race
from .buckets import REQUESTED, Call
from .cache import Decision

BUDGET_S = 2.0


@dataclass(frozen=True)
class Options:
    """What the selection needs from attnguard's settings; the call guard passes them."""

    apply: bool = True  # fix mode: a decision serves calls; warn / strict: said, not applied
    version: str = ""  # attnguard's version: part of the fingerprint of a measured decision


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.made: dict[tuple[Any, ...], Decision] = {}
        self.impls: dict[tuple[str, str], Any] = {}
        self.spent_s = 0.0


_state = _State()


def reset() -> None:
    """Forget every decision of this process (tests; the disk cache stays)."""
    global _state
    _state = _State()
    cache.reset()


# --- deciding ---------------------------------------------------------------------------------


def _why_not_race() -> tuple[str, bool] | None:
    """Why no race may run now, and whether that passes (a later call may still decide)."""
    import torch

    try:
        if torch.cuda.is_current_stream_capturing():
            return "while a CUDA graph is being captured", True
    except Exception:
        pass
    if torch.are_deterministic_algorithms_enabled():
        return "torch.use_deterministic_algorithms(True) is on", True
    if _state.spent_s >= BUDGET_S:
        return f"this process's {BUDGET_S:g} s race budget is spent", False
    return None


def _kept(why: str) -> Decision:
    return Decision(REQUESTED, {REQUESTED: why}, source="not measured")


def _race(entry: Any, args: tuple, kwargs: dict, call: Call) -> Decision:
    from ..fallback import torch_flash

    q = call_arg(entry, args, kwargs, "q")
    names = buckets.candidates(call, torch_flash.can_run(q, q, q))
    impls = race.implementations(entry.name, entry.original, entry.params, names)
    t0 = time.perf_counter()
    try:
        left = BUDGET_S - _state.spent_s
        measured = race.measure(impls, entry.params, args, kwargs, call, budget_s=left)
    except race.OverBudget as exc:
        return _kept(f"{exc}, over the {left:.1f} s left of this process's race budget")
    finally:
        _state.spent_s += time.perf_counter() - t0
    verdict = race.pick(measured, call.dtype)
    return Decision(verdict.winner, verdict.why, {n: _jsonable(m) for n, m in measured.items()})


def _jsonable(m: race.Measured) -> dict[str, Any]:
    def num(x: float, places: int) -> float | None:
        return round(x, places) if x != float("inf") else None

    out: dict[str, Any] = {"ms": num(m.ms, 4), "out_diff": num(m.out_diff, 6)}
    if m.grad_diff is not None:
        out["grad_diff"] = num(m.grad_diff, 6)
    if m.error:
        out["error"] = m.error
    return out


def _same(a: Decision, b: Decision) -> bool:
    return a.as_json() == b.as_json()


def _agree(store: Any, key: str, call: Call, decision: Decision, fp: dict[str, Any]) -> Decision:
    """Post ``decision`` unless a rank posted first; every rank returns the posted one."""
    posted = store.compare_set(key, "", cache.record(call, decision, fp).decode())
    got = cache.parse(posted if isinstance(posted, bytes) else str(posted).encode(), call, fp)
    return decision if _same(got, decision) else _with_source(got, "this job")


def _decide(entry: Any, args: tuple, kwargs: dict, call: Call, opts: Options) -> Decision | None:
    """The decision every rank of this job uses for ``call``'s bucket (the module doc's order);
    None when it cannot be made now but may be later (a CUDA graph capture, deterministic mode
    switched on for a while)."""
    launch = events.launch_context()
    store = cache.job_store()
    fp = cache.fingerprint(opts.version)
    disk = cache.Disk(cache.cache_root(), fp)
    key = cache.STORE_PREFIX + fp[0] + "/" + cache.bucket_id(call.bucket)
    if store is not None:
        try:
            if store.check([key]):
                return _with_source(cache.parse(store.get(key), call, fp[1]), "this job")
        except Exception:
            return _kept("the process group's store could not be read to agree")
    if launch["world_size"] > 1 and store is None:
        # several ranks and no group to agree through: no race (its winner could differ per
        # rank); a decision already on this node's disk is the same file for every rank
        one_node = os.environ.get("LOCAL_WORLD_SIZE", "").strip() == str(launch["world_size"])
        found = disk.read(call) if one_node else None
        if found is not None:
            return _with_source(found, "disk cache")
        return _kept("several ranks and no process group up to agree through: no race")
    decision = disk.read(call)
    if decision is not None:
        decision.source = "disk cache"
    else:
        blocked = _why_not_race()
        if blocked is not None and blocked[1]:
            return None
        decision = _kept(blocked[0]) if blocked else _race(entry, args, kwargs, call)
        if decision.source != "not measured":  # only measurements go to disk
            on_disk = disk.write_first(call, decision)
            if on_disk is not None and not _same(on_disk, decision):
                decision = _with_source(on_disk, "disk cache")  # another process was first
    if store is not None:  # a kept decision is posted too: every rank then uses the same
        try:
            decision = _agree(store, key, call, decision, fp[1])
        except Exception:
            return _kept("the process group's store could not be used to agree")
    return decision


def _with_source(decision: Decision, source: str) -> Decision:
    decision.source = source
    return decision


def call_arg(entry: Any, args: tuple, kwargs: dict, name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    try:
        i = entry.params.index(name)
    except ValueError:
        return None
    return args[i] if i < len(args) else None


def _say(entry: Any, call: Call, decision: Decision, apply: bool) -> None:
    """One ``kernel_selected`` per site and bucket: the candidates measured, the winner, why."""
    changed = decision.winner != REQUESTED
    fields: dict[str, Any] = {
        "requested": entry.name,
        "selected": decision.winner if changed else entry.name,
        "source": decision.source,
        "candidates": decision.measured,
        "why": decision.why,
        "bucket": [str(x) for x in call.bucket[1:]],
    }
    if changed:
        fields["applied"] = apply
        code = "faster_kernel"
        reason = (
            f"{entry.name} ({call.label}): {decision.winner} computes the same numbers faster "
            f"({decision.why.get(decision.winner, '')})"
        )
    else:
        code = "not_raced" if decision.source == "not measured" else "requested_kept"
        reason = (
            f"{entry.name} ({call.label}): the requested kernel stays "
            f"({decision.why.get(REQUESTED, '')})"
        )
    events.emit(
        "kernel_selected",
        site=f"{entry.site}#{cache.bucket_id(call.bucket)[:8]}",
        reason_code=code,
        reason=reason,
        level="warning" if changed and apply else "info",
        **fields,
    )


def serve(entry: Any, args: tuple, kwargs: dict, opts: Options) -> Any:
    """The candidate that computes this call (a callable with the entry's signature), or None
    for the requested kernel. Fail-open is the caller's (:mod:`attnguard.callguard`)."""
    named = dict(zip(entry.params, args, strict=False))
    named.update(kwargs)
    key = buckets.bucket(entry.name, named)
    if isinstance(key, str):
        return None  # a call the switch leaves alone
    decision = _state.made.get(key)
    if decision is None:
        if events.is_compiling():
            return None  # no side effect inside a trace: the first eager call decides
        call = buckets.describe(entry.name, named)
        with _state.lock:
            decision = _state.made.get(call.bucket)
            if decision is None:
                decision = _decide(entry, args, kwargs, call, opts)
                if decision is None:
                    return None
                _say(entry, call, decision, opts.apply)
                if not opts.apply:  # warn mode: said, not applied
                    decision = Decision(REQUESTED, decision.why, decision.measured, decision.source)
                _state.made[call.bucket] = decision
    if decision.winner == REQUESTED:
        return None
    impl = _state.impls.get((entry.name, decision.winner))
    if impl is None:
        names = [decision.winner]
        impl = race.implementations(entry.name, entry.original, entry.params, names)[names[0]]
        _state.impls[(entry.name, decision.winner)] = impl
    return impl
