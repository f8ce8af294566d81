"""Opt-in kernel selection: the decisions — made once per shape bucket, remembered on disk, the same
on every rank of a job, said once (``kernel_selected``).

:func:`serve` is called by the call-time guard (:mod:`attnguard.callguard`) for every flash-attn
call the real kernel could compute while ``ATTNGUARD_KERNEL=fastest`` is on. It answers with the
candidate that computes the call (None: the requested kernel). For a bucket seen for the first
time it looks in this order:

1. this process's decisions;
2. the job's: with a process group up, its store holds the decision the first rank to decide
   posted (``compare_set``: the first writer wins, every rank adopts that value: ranks never
   diverge, and nobody waits for anybody);
3. the disk cache: ``$XDG_CACHE_HOME/attnguard/kernels/<fingerprint>/`` (default
   ``~/.cache/attnguard/...``), one file per bucket, fingerprinted by GPU model, torch, CUDA,
   flash-attn and attnguard versions, written first-writer-wins (:mod:`attnguard.safefiles`). A
   file that is corrupt, of another GPU or version, or not this user's is ignored (one
   ``observed`` event), never trusted, never a crash;
4. a race on the call's own inputs (:mod:`attnguard.race`), at most :data:`BUDGET_S` seconds per
   process in total (a race that would overrun it is not started). With several ranks, what a
   rank decided (a winner, or "the requested kernel" when its budget is spent) is posted to the
   store and the first posted decision is everybody's.

It never races inside a ``torch.compile`` trace or while a CUDA graph is being captured (the
decision must exist before: the first eager call makes it), under
``torch.use_deterministic_algorithms(True)`` (no candidate is vouched deterministic), or with
several ranks and no process group (a race's winner could differ per rank: a decision already in
this node's disk cache is used, else the requested kernel computes).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import events, race, safefiles, selection
from .selection import REQUESTED, Call, Measured

BUDGET_S = 2.0
SCHEMA = 1
_STORE_PREFIX = "attnguard/kernel/v1/"
_MAX_FILE_BYTES = 1 << 16


@dataclass
class Decision:
    winner: str
    why: dict[str, str] = field(default_factory=dict)
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: str = "measured"  # measured | this job (store) | disk cache | not measured

    def as_json(self) -> dict[str, Any]:
        return {"winner": self.winner, "why": self.why, "measured": self.measured}


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.made: dict[tuple[Any, ...], Decision] = {}
        self.impls: dict[tuple[str, str], Any] = {}
        self.spent_s = 0.0
        self.said: set[str] = set()
        self.fingerprint: tuple[str, dict[str, Any]] | None = None


_state = _State()


def reset() -> None:
    """Forget every decision of this process (tests; the disk cache stays)."""
    global _state
    _state = _State()


# --- where decisions live ---------------------------------------------------------------------


def fingerprint() -> tuple[str, dict[str, Any]]:
    """(hash, fields): what a measured decision holds for — this GPU model, torch, CUDA,
    flash-attn and attnguard."""
    if _state.fingerprint is None:
        import torch

        from . import __version__

        index = torch.cuda.current_device()
        fields = {
            "gpu": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "flash_attn": getattr(sys.modules.get("flash_attn"), "__version__", None),
            "attnguard": __version__,
        }
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        _state.fingerprint = (digest, fields)
    return _state.fingerprint


def cache_root() -> str:
    """Where every fingerprint's decisions live: ``$XDG_CACHE_HOME/attnguard/kernels``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnguard", "kernels")


def cache_dir() -> str:
    return os.path.join(cache_root(), fingerprint()[0])


def _bucket_id(bucket: tuple[Any, ...]) -> str:
    return hashlib.sha256(json.dumps(list(bucket), default=str).encode()).hexdigest()[:24]


def _bucket_json(call: Call) -> list[Any]:
    """The bucket as it reads back from JSON (tuples become lists, dtypes strings)."""
    return json.loads(json.dumps(list(call.bucket), default=str))


def _record(call: Call, decision: Decision) -> bytes:
    return json.dumps(
        {
            "schema": SCHEMA,
            "fingerprint": fingerprint()[1],
            "bucket": _bucket_json(call),
            **decision.as_json(),
        },
        sort_keys=True,
    ).encode()


class _NotADecision(ValueError):
    """Why stored bytes are not a decision this process may use."""


def _parse(raw: bytes, call: Call) -> Decision:
    """A stored decision for ``call``'s bucket; :class:`_NotADecision` says why it is not one."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise _NotADecision("unreadable (not JSON)") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise _NotADecision("not a kernel decision of this schema")
    if data.get("fingerprint") != fingerprint()[1]:
        raise _NotADecision("made on another GPU or with other versions")
    if data.get("bucket") != _bucket_json(call):
        raise _NotADecision("for another bucket")
    winner = data.get("winner")
    names = [c.name for c in selection.CANDIDATES if call.entry in c.entries]
    if winner not in names:
        raise _NotADecision(f"unknown winner {str(winner)[:40]!r}")
    why = data.get("why") if isinstance(data.get("why"), dict) else {}
    measured = data.get("measured") if isinstance(data.get("measured"), dict) else {}
    return Decision(
        winner,
        {str(k)[:40]: str(v)[:200] for k, v in why.items()},
        {str(k)[:40]: v for k, v in measured.items() if isinstance(v, dict)},
    )


def _ignored(why: str) -> None:
    key = "cache:" + why.split(":")[0]
    if key in _state.said:
        return
    _state.said.add(key)
    events.emit(
        "observed",
        site="attnguard.kernel_cache",
        reason_code="kernel_cache_ignored",
        reason=f"a cached kernel decision was ignored: {why}; it is measured again",
    )


def _cache() -> safefiles.PrivateDir | None:
    """This machine's private cache directory for this fingerprint, or None (one event why)."""
    path = cache_dir()
    try:
        safefiles.make_dirs(os.path.dirname(path))
        return safefiles.PrivateDir(path)
    except OSError as exc:
        _ignored(f"the cache directory cannot be used ({_why(exc)})")
        return None


def _why(exc: OSError) -> str:
    return str(exc) if isinstance(exc, safefiles.UnsafeFile) else exc.strerror or type(exc).__name__


def _read_disk(call: Call, folder: safefiles.PrivateDir | None = None) -> Decision | None:
    own = folder is None
    folder = folder or _cache()
    if folder is None:
        return None
    try:
        raw, _ = folder.read(_bucket_id(call.bucket) + ".json", _MAX_FILE_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        _ignored(f"cannot be read ({_why(exc)})")
        return None
    finally:
        if own:
            folder.close()
    try:
        return _parse(raw, call)
    except _NotADecision as exc:
        _ignored(str(exc))
        return None


def _write_disk_first(call: Call, decision: Decision) -> Decision | None:
    """Store ``decision`` unless a file for the bucket exists; returns the decision on disk
    afterwards (ours, or the one another process wrote first), None when the cache cannot be
    used."""
    folder = _cache()
    if folder is None:
        return None
    with folder:
        try:
            folder.write_first(_bucket_id(call.bucket) + ".json", _record(call, decision))
        except OSError as exc:
            _ignored(f"cannot be written ({_why(exc)})")
            return None
        return _read_disk(call, folder)


def _store() -> Any:
    """The default process group's store when a group of several ranks is up, else None."""
    if "torch.distributed" not in sys.modules:
        return None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from torch.distributed import distributed_c10d as c10d

            return c10d._get_default_store()
    except Exception:
        pass
    return None


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
    from .fallback import torch_flash

    q = call_arg(entry, args, kwargs, "q")
    names = selection.candidates(call, torch_flash.can_run(q, q, q))
    impls = race.implementations(entry.name, entry.original, entry.params, names)
    t0 = time.perf_counter()
    try:
        left = BUDGET_S - _state.spent_s
        measured = race.measure(impls, entry.params, args, kwargs, call, budget_s=left)
    except race.OverBudget as exc:
        return _kept(f"{exc}, over the {left:.1f} s left of this process's race budget")
    finally:
        _state.spent_s += time.perf_counter() - t0
    verdict = selection.pick(measured, call.dtype)
    return Decision(verdict.winner, verdict.why, {n: _jsonable(m) for n, m in measured.items()})


def _jsonable(m: Measured) -> dict[str, Any]:
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


def _agree(store: Any, key: str, call: Call, decision: Decision) -> Decision:
    """Post ``decision`` unless a rank posted first; every rank returns the posted one."""
    posted = store.compare_set(key, "", _record(call, decision).decode())
    got = _parse(posted if isinstance(posted, bytes) else str(posted).encode(), call)
    return decision if _same(got, decision) else _with_source(got, "this job")


def _decide(entry: Any, args: tuple, kwargs: dict, call: Call) -> Decision | None:
    """The decision every rank of this job uses for ``call``'s bucket (the module doc's order);
    None when it cannot be made now but may be later (a CUDA graph capture, deterministic mode
    switched on for a while)."""
    launch = events.launch_context()
    store = _store()
    key = _STORE_PREFIX + fingerprint()[0] + "/" + _bucket_id(call.bucket)
    if store is not None:
        try:
            if store.check([key]):
                return _with_source(_parse(store.get(key), call), "this job")
        except Exception:
            return _kept("the process group's store could not be read to agree")
    if launch["world_size"] > 1 and store is None:
        # several ranks and no group to agree through: no race (its winner could differ per
        # rank); a decision already on this node's disk is the same file for every rank
        one_node = os.environ.get("LOCAL_WORLD_SIZE", "").strip() == str(launch["world_size"])
        found = _read_disk(call) if one_node else None
        if found is not None:
            return _with_source(found, "disk cache")
        return _kept("several ranks and no process group up to agree through: no race")
    decision = _read_disk(call)
    if decision is not None:
        decision.source = "disk cache"
    else:
        blocked = _why_not_race()
        if blocked is not None and blocked[1]:
            return None
        decision = _kept(blocked[0]) if blocked else _race(entry, args, kwargs, call)
        if decision.source != "not measured":  # only measurements go to disk
            on_disk = _write_disk_first(call, decision)
            if on_disk is not None and not _same(on_disk, decision):
                decision = _with_source(on_disk, "disk cache")  # another process was first
    if store is not None:  # a kept decision is posted too: every rank then uses the same
        try:
            decision = _agree(store, key, call, decision)
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
        site=f"{entry.site}#{_bucket_id(call.bucket)[:8]}",
        reason_code=code,
        reason=reason,
        level="warning" if changed and apply else "info",
        **fields,
    )


def serve(entry: Any, args: tuple, kwargs: dict) -> Any:
    """The candidate that computes this call (a callable with the entry's signature), or None
    for the requested kernel. Fail-open is the caller's (:mod:`attnguard.callguard`)."""
    named = dict(zip(entry.params, args, strict=False))
    named.update(kwargs)
    key = selection.bucket(entry.name, named)
    if isinstance(key, str):
        return None  # a call the switch leaves alone
    decision = _state.made.get(key)
    if decision is None:
        if events.is_compiling():
            return None  # no side effect inside a trace: the first eager call decides
        call = selection.describe(entry.name, named)
        with _state.lock:
            decision = _state.made.get(call.bucket)
            if decision is None:
                from . import runtime

                decision = _decide(entry, args, kwargs, call)
                if decision is None:
                    return None
                apply = runtime.settings().changes_things
                _say(entry, call, decision, apply)
                if not apply:  # warn mode: said, not applied
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


def cached(directory: str | None = None) -> list[dict[str, Any]]:
    """The decisions in this machine's disk cache (``attnguard doctor``): every fingerprint
    directory, each file's bucket and winner; unreadable files are named, never raised."""
    base = directory or cache_root()
    out: list[dict[str, Any]] = []
    try:
        prints = sorted(os.listdir(base))
    except OSError:
        return out
    for fp in prints:
        folder = os.path.join(base, fp)
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".json"))
        except OSError:
            continue
        for name in names[:500]:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as fh:
                    data = json.loads(fh.read(_MAX_FILE_BYTES + 1))
                out.append(
                    {
                        "fingerprint": data.get("fingerprint"),
                        "bucket": data.get("bucket"),
                        "winner": data.get("winner"),
                        "why": (data.get("why") or {}).get(data.get("winner"), ""),
                    }
                )
            except Exception as exc:
                out.append({"file": path, "error": type(exc).__name__})
    return out
