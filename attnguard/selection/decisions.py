"""The decisions: which kernel serves each bucket — made once, the same on every rank of a job,
said once (``kernel_selected``). Why a call ran on the kernel it ran on is decided here: the rules
are :func:`why_not`, the order :func:`decide`.

:func:`serve` is called by the call-time guard (:mod:`attnguard.callguard`) for a flash-attn
call the real kernel could compute while ``ATTNGUARD_KERNEL=fastest`` is on, with the settings it
needs (:class:`Options`), when :func:`attnguard.selection.served.served` has not served the call
by its signature: it describes the call once (:func:`~.buckets.describe_call`), decides its bucket
when that is new, remembers the signature for the next calls and answers with the candidate
that computes the call (None: the requested kernel). A bucket's decision is this process's from
its first call on; whether it is applied is the mode's at each call (fix: applied; warn, strict:
said, not applied).

For a bucket seen for the first time, :func:`decide` looks in this order:

1. the job's decision: with a process group of several ranks up, the one the first rank to decide
   posted to the group's store (``compare_set``: the first writer wins; every rank, whatever its
   GPU, reads the same key, and nobody waits for anybody);
2. this machine's disk cache (:mod:`attnguard.selection.cache`);
3. a race on the call's own inputs (:mod:`attnguard.selection.race`), within this process's race
   budget: :data:`FLOOR_S` seconds plus :data:`SHARE` of the time its selected calls spent in
   attention so far (the probe and timed rounds count; each candidate's warm-up, which also pays
   a kernel's cold start, is said but not counted); a race that would overrun it is not started;
4. with a process group up, what this rank decided — a winner, or "the requested kernel" when it
   may not race — is posted, and the first posted decision is everybody's.

What is read from the store or the disk is used only when :func:`why_not` allows it for this
call (a winner among its candidates; deterministic mode takes the requested kernel only).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

from ..observability import events
from . import buckets, cache, race, served
from .buckets import NOT_CUDA, REQUESTED, Call
from .cache import Decision

# A process's races may take FLOOR_S seconds, plus SHARE of the time its calls of decided
# buckets spent in attention so far (each bucket's calls x the time per call measured for the
# kernel that serves it): a long job may race a new shape late in its run.
FLOOR_S = 3.0
SHARE = 0.01
_DETERMINISTIC = "torch.use_deterministic_algorithms(True) is on"


@dataclass(frozen=True)
class Options:
    """What the selection needs from attnguard's settings; the call guard passes them."""

    apply: bool = True  # fix mode: a decision serves calls; warn / strict: said, not applied
    version: str = ""  # attnguard's version: part of the fingerprint of a measured decision
    cache_dir: str = ""  # ATTNGUARD_KERNEL_CACHE ("": $XDG_CACHE_HOME/attnguard/kernels)


@dataclass(frozen=True)
class Situation:
    """What this rank knows when it meets a bucket for the first time (the rules' facts)."""

    candidates: tuple[str, ...]  # what may compute this call here, the requested kernel first
    ranks: int = 1  # the job's world size
    group: bool = False  # a process group's store to agree through
    one_node: bool = False  # every rank of the job runs on this node: they read one disk
    deterministic: bool = False  # torch.use_deterministic_algorithms(True)
    capturing: bool = False  # a CUDA graph is being captured
    spent_s: float = 0.0  # what this process's races took so far (probes and timed rounds)
    attention_s: float = 0.0  # what its calls of decided buckets spent in attention so far

    @property
    def allowance_s(self) -> float:
        """What this process's races may take in all, now."""
        return FLOOR_S + SHARE * self.attention_s

    def budget(self) -> str:
        return (
            f"{self.spent_s:.2f} s of this process's {self.allowance_s:.2f} s race budget "
            f"({FLOOR_S:g} s + {SHARE:.0%} of the {self.attention_s:.1f} s its selected calls "
            "spent in attention so far)"
        )


def why_not(
    step: str, s: Situation, found: Decision | None = None, projected_s: float = 0.0
) -> str | None:
    """The rules of the decisions, in one place: why this rank may not take ``step`` for a new
    bucket now (None: it may). :func:`decide` asks in this order:

    * ``"decide"``: not while a CUDA graph is captured, nor in deterministic mode with no process
      group to post to (the call keeps the requested kernel and a later call decides).
    * ``"adopt"`` ``found``, a decision read from the job's store or the disk: its winner must be
      one of this call's candidates (the store has no authentication, a file may be old or
      planted); in deterministic mode only the requested kernel. Every rank judges a posted
      decision alike, so a refused one leaves every rank on the requested kernel — except a rank
      in deterministic mode that finds another rank's winner already posted.
    * ``"read disk"``: not in deterministic mode; with several ranks and no process group only
      when every rank is on this node (the same file for all of them).
    * ``"race"``: not in deterministic mode (no candidate is vouched deterministic), not with
      several ranks and no process group (winners could differ per rank), not once this
      process's race budget is spent;
    * ``"spend"`` ``projected_s`` more on the race (projected from a warm run of the requested
      kernel): only within the race budget left.
    """
    if step == "decide":
        if s.capturing:
            return "while a CUDA graph is being captured"
        if s.deterministic and not s.group:
            return _DETERMINISTIC
        return None
    if step == "adopt":
        assert found is not None
        if found.winner not in s.candidates:
            shown = repr(found.winner[:40])
            return f"{shown} is not a candidate for this call ({', '.join(s.candidates)})"
        if s.deterministic and found.winner != REQUESTED:
            return f"{_DETERMINISTIC}: the requested kernel computes, not {found.winner}"
        return None
    if step == "read disk":
        if s.deterministic:
            return _DETERMINISTIC
        if s.ranks > 1 and not s.group and not s.one_node:
            return "ranks on several nodes and no process group: their disks may differ"
        return None
    if step == "race":
        if s.deterministic:
            return f"{_DETERMINISTIC} (no candidate is vouched deterministic)"
        if s.ranks > 1 and not s.group:
            return "several ranks and no process group up to agree through: no race"
        if s.spent_s >= s.allowance_s:
            return f"the race budget is spent: {s.budget()}"
        return None
    if step == "spend":
        if s.spent_s + projected_s > s.allowance_s:
            return f"this race would take about {projected_s:.2f} s more, over {s.budget()}"
        return None
    raise ValueError(f"unknown step {step!r}")


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.made: dict[tuple[Any, ...], Decision] = {}
        self.said: dict[tuple[Any, ...], bool] = {}  # bucket -> applied, as last said
        self.impls: dict[tuple[str, str], Any] = {}
        # decided bucket -> [eager calls served] (a cell: served signatures share it)
        self.calls: dict[tuple[Any, ...], list[int]] = {}
        self.call_ms: dict[tuple[Any, ...], float] = {}  # decided bucket -> ms per call
        self.spent_s = 0.0  # races: probes and timed rounds
        self.warm_up_s = 0.0  # races: warm-ups (said, not counted against the budget)
        self.forked = False  # a forked child: the parent's process group is not its own


_state = _State()


def reset() -> None:
    """Forget every decision of this process (tests; the disk cache stays)."""
    global _state
    _state = _State()
    cache.reset()
    served.reset()


def _after_fork_in_child() -> None:
    """A forked child decides its own buckets: a new lock (another thread of the parent may have
    held it at the fork), and no use of the parent's process-group store (its connection is the
    parent's)."""
    _state.lock = threading.RLock()
    _state.forked = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- deciding ---------------------------------------------------------------------------------


def situation(call: Call) -> Situation:
    """The facts :func:`why_not` reads, for ``call`` now."""
    import torch

    ranks = events.launch_context()["world_size"]
    try:
        capturing = bool(torch.cuda.is_current_stream_capturing())
    except Exception:
        capturing = False
    return Situation(
        candidates=call.candidates,
        ranks=ranks,
        group=not _state.forked and cache.job_store() is not None,
        one_node=os.environ.get("LOCAL_WORLD_SIZE", "").strip() == str(ranks),
        deterministic=torch.are_deterministic_algorithms_enabled(),
        capturing=capturing,
        spent_s=_state.spent_s,
        attention_s=_attention_s(),
    )


def _attention_s() -> float:
    """What this process's eager calls of decided buckets spent in attention so far, estimated:
    each bucket's calls x the time per call measured for the kernel that serves it."""
    calls = list(_state.calls.items())
    return sum(n[0] * _state.call_ms.get(b, 0.0) for b, n in calls) / 1e3


def _kept(why: str, source: str = "not measured", differs: bool = False) -> Decision:
    return Decision(REQUESTED, {REQUESTED: why}, source=source, differs=differs)


def _race(entry: Any, args: tuple, kwargs: dict, call: Call, s: Situation) -> Decision:
    """Race the call's candidates (when the budget allows what the probe projects)."""
    impls = race.implementations(entry.name, entry.original, entry.params, list(s.candidates))
    run = race.Race(impls, entry.params, args, kwargs, call)
    try:
        try:
            probe_ms = run.probe() * 1e3
        except Exception as exc:
            return _kept(f"the requested kernel could not be timed: {race.error_text(exc)}")
        over = why_not("spend", s, projected_s=run.projected_s())
        if over is not None:
            kept = _kept(over)
            kept.probe_ms = probe_ms
            return kept
        measured = run.run()
    finally:
        _state.spent_s += run.timed_s
        _state.warm_up_s += run.warm_up_s
    verdict = race.pick(measured, call.dtype)
    cost = {"race_s": round(run.timed_s, 4), "warm_up_s": round(run.warm_up_s, 4)}
    return Decision(
        verdict.winner, verdict.why, {n: _jsonable(m) for n, m in measured.items()}, cost
    )


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


def _posted(raw: Any, call: Call, s: Situation) -> Decision:
    """The job's decision as this rank computes it: the posted one when the rules allow it here,
    else the requested kernel (and whether this rank then differs from the job)."""
    raw = raw if isinstance(raw, bytes) else str(raw).encode()
    try:
        found = cache.parse(raw, call, None)  # any GPU's: ranks agree whatever their GPUs
    except cache.NotADecision as exc:
        return _kept(f"the job's posted decision is not one ({exc})", source="this job")
    why = why_not("adopt", s, found)
    if why is None:
        found.source = "this job"
        return found
    differs = found.winner != REQUESTED and found.winner in s.candidates
    if differs:
        why += f"; the job's decision is {found.winner}: the ranks differ on this bucket"
    return _kept(f"the job's posted decision: {why}", source="this job", differs=differs)


def decide(entry: Any, args: tuple, kwargs: dict, call: Call, opts: Options) -> Decision | None:
    """The decision this rank uses for ``call``'s bucket (the module doc's order, the rules of
    :func:`why_not`); None when it cannot be made now but may be later."""
    s = situation(call)
    if why_not("decide", s) is not None:
        return None
    store = cache.job_store() if s.group else None
    key = cache.store_key(call)
    if store is not None:
        try:
            raw = store.get(key) if store.check([key]) else None
        except Exception:
            return _kept("the process group's store could not be read to agree")
        if raw is not None:
            return _posted(raw, call, s)
    fp = cache.fingerprint(opts.version)
    disk = cache.Disk(opts.cache_dir or cache.cache_root(), fp)
    decision = None
    if why_not("read disk", s) is None:
        found = disk.read(call)
        why = why_not("adopt", s, found) if found is not None else None
        if found is not None and why is None:
            found.source = "disk cache"
            decision = found
        elif why is not None:
            cache.ignored(why)
    if decision is None:
        why = why_not("race", s)
        decision = _kept(why) if why else _race(entry, args, kwargs, call, s)
        if decision.source == "measured":  # only measurements go to disk
            on_disk = disk.write_first(call, decision)
            first = on_disk is not None and not _same(on_disk, decision)
            if first and why_not("adopt", s, on_disk) is None:  # another process was first
                on_disk.source = "disk cache"
                decision = on_disk
    if store is not None:  # a kept decision is posted too: every rank then uses the same
        mine = cache.record(call, decision, fp[1])
        try:
            raw = store.compare_set(key, "", mine.decode())
        except Exception:
            return _kept("the process group's store could not be used to agree")
        if (raw if isinstance(raw, bytes) else str(raw).encode()) != mine:
            return _posted(raw, call, s)  # another rank posted first
    return decision


def _say(entry: Any, call: Call, decision: Decision, apply: bool) -> None:
    """``kernel_selected`` for a site and bucket: the candidates measured, the winner, why, and
    whether it is applied (said again, counted, when a mode change flips that)."""
    changed = decision.winner != REQUESTED
    fields: dict[str, Any] = {
        "requested": entry.name,
        "selected": decision.winner if changed else entry.name,
        "source": decision.source,
        "candidates": decision.measured,
        "why": decision.why,
        "bucket": [str(x) for x in call.bucket[1:]],
        "cost": _cost(decision),
    }
    if changed:
        fields["applied"] = apply
        code = "faster_kernel"
        reason = (
            f"{entry.name} ({call.label}): {decision.winner} computes the same numbers faster "
            f"({decision.why.get(decision.winner, '')})"
        )
    else:
        code = "requested_kept" if decision.measured else "not_raced"
        reason = (
            f"{entry.name} ({call.label}): the requested kernel stays "
            f"({decision.why.get(REQUESTED, '')})"
        )
    events.emit(
        "kernel_selected",
        site=f"{entry.site}#{cache.bucket_id(call.bucket)[:8]}",
        reason_code=code,
        reason=reason,
        level="warning" if (changed and apply) or decision.differs else "info",
        **fields,
    )


def _cost(decision: Decision) -> dict[str, float]:
    """What races cost: this decision's own race (when this process ran it) and this process's
    races so far against what they may take."""
    out = dict(decision.cost) if decision.source == "measured" else {}
    s = Situation((), spent_s=_state.spent_s, attention_s=_attention_s())
    out.update(
        process_races_s=round(_state.spent_s, 4),
        process_warm_ups_s=round(_state.warm_up_s, 4),
        process_allowance_s=round(s.allowance_s, 4),
    )
    return out


def serve(
    entry: Any, args: tuple, kwargs: dict, opts: Options, sig: tuple[Any, ...] | None = None
) -> Any:
    """The candidate that computes this call (a callable taking ``(args, kwargs)``), or None for
    the requested kernel. ``sig``: what :func:`~.served.served` answered for the call (its
    signature; ``None``: not asked yet, asked here). Fail-open is the caller's
    (:mod:`attnguard.callguard`).

    The call is described once (:func:`~.buckets.describe_call`: its bucket, or why the switch
    leaves it alone, and its candidates); a new bucket is decided (:func:`decide`) and said
    (``kernel_selected``); the signature is remembered, so that the next calls like this one are
    served by :func:`~.served.served` alone. Inside a torch.compile trace nothing is decided,
    said, counted or remembered: a decided bucket's kernel goes into the graph, an undecided one
    keeps the requested kernel."""
    if sig is None:
        found = served.served(entry.name, args, kwargs, opts.apply)
        if found.__class__ is not tuple:
            return found
        sig = found
    tracing = events.is_compiling()
    call = buckets.describe_call(entry, args, kwargs, sig, tracing)
    key = call.bucket
    if call.skip is not None:
        # a call left alone is served as such from now on (not a non-CUDA one: the guard's
        # check tells a CPU call from a meta one, a signature does not)
        if sig and call.skip is not NOT_CUDA:
            served.remember(entry.name, sig, kwargs, None, None, opts.apply)
        return None
    decision = _state.made.get(key)
    if decision is None or (decision.winner != REQUESTED and _state.said.get(key) != opts.apply):
        if tracing:
            return None  # no side effect inside a trace: the first eager call decides
        with _state.lock:
            decision = _state.made.get(key)
            if decision is None:
                decision = decide(entry, args, kwargs, call, opts)
                if decision is None:
                    return None
                _state.call_ms[key] = decision.call_ms()
                _state.made[key] = decision
            if _state.said.get(key) != opts.apply:
                _state.said[key] = opts.apply
                _say(entry, call, decision, opts.apply)
    if tracing:  # what the budget grows with (a traced graph's calls: not)
        count = None
    else:
        count = _state.calls.get(key)
        if count is None:
            count = _state.calls[key] = [0]
        count[0] += 1
    impl = None
    if decision.winner != REQUESTED and opts.apply:
        impl = _state.impls.get((entry.name, decision.winner))
        if impl is None:
            names = [decision.winner]
            impl = race.implementations(entry.name, entry.original, entry.params, names)[names[0]]
            _state.impls[(entry.name, decision.winner)] = impl
    if sig and not tracing:
        served.remember(entry.name, sig, kwargs, count, impl, opts.apply)
    return impl
