"""Where decisions live: this machine's disk cache and the job's process-group store, and the
record both hold (one JSON object per bucket).

* The disk cache: ``<root>/<fingerprint>/<bucket id>.json``, ``<root>`` being
  ``$XDG_CACHE_HOME/attnguard/kernels`` (default ``~/.cache/attnguard/kernels``). The
  fingerprint is a hash of what a measured decision holds for: the GPU model, torch, CUDA,
  flash-attn and attnguard versions. One file per bucket, written first-writer-wins, read under
  :mod:`attnguard.safefiles`' rules (a private directory, a regular file of this user, no link
  followed, bounded). A file that is corrupt, of another GPU or version, or not this user's is
  ignored with one ``observed`` event (``kernel_cache_ignored``), never trusted, never a crash.
* The job's store: with a process group of several ranks up, the default group's store; the
  first rank to decide posts its record there (``compare_set``) and every rank reads it back. Its
  key is the bucket's alone (:func:`store_key`): every rank of the job reads the same one,
  whatever its GPU. The store has no authentication: what it holds is checked like a file.

Nothing here decides anything: :mod:`attnguard.selection.decisions` does.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from .. import safefiles
from ..observability import events
from .buckets import CANDIDATES, Call

SCHEMA = 1
STORE_PREFIX = "attnguard/kernel/v2/"
MAX_FILE_BYTES = 1 << 16


@dataclass
class Decision:
    """Which candidate serves a bucket, why each lost or won, and what each measured."""

    winner: str
    why: dict[str, str] = field(default_factory=dict)
    measured: dict[str, dict[str, Any]] = field(default_factory=dict)
    cost: dict[str, float] = field(default_factory=dict)  # race_s, warm_up_s of its race
    source: str = "measured"  # measured | this job (store) | disk cache | not measured
    differs: bool = False  # this rank keeps the requested kernel where the job chose another
    probe_ms: float = 0.0  # one warm run of the requested kernel, when a race was not afforded

    def as_json(self) -> dict[str, Any]:
        out = {"winner": self.winner, "why": self.why, "measured": self.measured}
        return {**out, "cost": self.cost} if self.cost else out

    def call_ms(self) -> float:
        """The time one call of the bucket takes on the kernel that serves it, as measured (0:
        not measured)."""
        for name in (self.winner, "requested"):
            ms = _finite(self.measured.get(name, {}).get("ms"))
            if ms is not None and ms > 0:
                return ms
        return self.probe_ms


def _finite(value: Any) -> float | None:
    """``value`` as a finite float, else None (a stored number may be any JSON number: an
    integer too large for a float, NaN)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


class _State:
    def __init__(self) -> None:
        self.said: set[str] = set()
        self.fingerprints: dict[str, tuple[str, dict[str, Any]]] = {}


_state = _State()


def reset() -> None:
    """Forget what this process said and looked up (tests; the files stay)."""
    global _state
    _state = _State()


def fingerprint(version: str) -> tuple[str, dict[str, Any]]:
    """(hash, fields): what a measured decision holds for — this GPU model, torch, CUDA,
    flash-attn and attnguard ``version``."""
    found = _state.fingerprints.get(version)
    if found is None:
        import torch

        index = torch.cuda.current_device()
        fields = {
            "gpu": torch.cuda.get_device_name(index),
            "capability": list(torch.cuda.get_device_capability(index)),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "flash_attn": getattr(sys.modules.get("flash_attn"), "__version__", None),
            "attnguard": version,
        }
        digest = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]
        found = _state.fingerprints[version] = (digest, fields)
    return found


def cache_root() -> str:
    """Where every fingerprint's decisions live: ``$XDG_CACHE_HOME/attnguard/kernels``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "attnguard", "kernels")


def bucket_id(bucket: tuple[Any, ...]) -> str:
    return hashlib.sha256(json.dumps(list(bucket), default=str).encode()).hexdigest()[:24]


def store_key(call: Call) -> str:
    """The job-wide key of ``call``'s bucket in the process group's store."""
    return STORE_PREFIX + bucket_id(call.bucket)


def _bucket_json(call: Call) -> list[Any]:
    """The bucket as it reads back from JSON (tuples become lists, dtypes strings)."""
    return json.loads(json.dumps(list(call.bucket), default=str))


def record(call: Call, decision: Decision, fp: dict[str, Any]) -> bytes:
    """The stored form of ``decision`` for ``call``'s bucket, made on fingerprint ``fp``."""
    return json.dumps(
        {"schema": SCHEMA, "fingerprint": fp, "bucket": _bucket_json(call), **decision.as_json()},
        sort_keys=True,
    ).encode()


class NotADecision(ValueError):
    """Why stored bytes are not a decision this process may use."""


def parse(raw: bytes, call: Call, fp: dict[str, Any] | None) -> Decision:
    """A stored decision for ``call``'s bucket, made on fingerprint ``fp`` (None: on any);
    :class:`NotADecision` says why it is not one. Whether this call may use it is the rules'
    (:func:`attnguard.selection.decisions.why_not`)."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        raise NotADecision("unreadable (not JSON)") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise NotADecision("not a kernel decision of this schema")
    if fp is not None and data.get("fingerprint") != fp:
        raise NotADecision("made on another GPU or with other versions")
    if data.get("bucket") != _bucket_json(call):
        raise NotADecision("for another bucket")
    winner = data.get("winner")
    names = [c.name for c in CANDIDATES if call.entry in c.entries]
    if winner not in names:
        raise NotADecision(f"unknown winner {str(winner)[:40]!r}")
    why = data.get("why") if isinstance(data.get("why"), dict) else {}
    measured = data.get("measured") if isinstance(data.get("measured"), dict) else {}
    cost = data.get("cost") if isinstance(data.get("cost"), dict) else {}
    costs = {str(k)[:40]: _finite(v) for k, v in cost.items()}
    return Decision(
        winner,
        {str(k)[:40]: str(v)[:200] for k, v in why.items()},
        {str(k)[:40]: _measurement(v) for k, v in measured.items() if isinstance(v, dict)},
        {k: v for k, v in costs.items() if v is not None},
    )


def _measurement(stored: dict[Any, Any]) -> dict[str, Any]:
    """One candidate's stored measurement as events may carry it: its numbers finite floats
    (else None), its error a short string; nothing else."""
    out: dict[str, Any] = {k: _finite(stored.get(k)) for k in _MEASURED if k in stored}
    if "error" in stored:
        out["error"] = str(stored["error"])[:200]
    return out


_MEASURED = ("ms", "out_diff", "grad_diff")


def ignored(why: str) -> None:
    """One ``observed`` event per kind of cached decision this process ignored."""
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


def _why(exc: OSError) -> str:
    return str(exc) if isinstance(exc, safefiles.UnsafeFile) else exc.strerror or type(exc).__name__


class Disk:
    """This fingerprint's directory of the disk cache."""

    def __init__(self, root: str, fp: tuple[str, dict[str, Any]]) -> None:
        self.path = os.path.join(root, fp[0])
        self.fp = fp[1]

    def _open(self) -> safefiles.PrivateDir | None:
        """The private directory, or None (one event why)."""
        try:
            safefiles.make_dirs(os.path.dirname(self.path))
            return safefiles.PrivateDir(self.path)
        except OSError as exc:
            ignored(f"the cache directory cannot be used ({_why(exc)})")
            return None

    def read(self, call: Call, folder: safefiles.PrivateDir | None = None) -> Decision | None:
        """The decision on disk for ``call``'s bucket; None when there is none to use."""
        own = folder is None
        folder = folder or self._open()
        if folder is None:
            return None
        try:
            raw, _ = folder.read(bucket_id(call.bucket) + ".json", MAX_FILE_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            ignored(f"cannot be read ({_why(exc)})")
            return None
        finally:
            if own:
                folder.close()
        try:
            return parse(raw, call, self.fp)
        except NotADecision as exc:
            ignored(str(exc))
            return None

    def write_first(self, call: Call, decision: Decision) -> Decision | None:
        """Store ``decision`` unless a file for the bucket exists; returns the decision on disk
        afterwards (ours, or the one another process wrote first), None when the cache cannot
        be used."""
        folder = self._open()
        if folder is None:
            return None
        with folder:
            try:
                folder.write_first(
                    bucket_id(call.bucket) + ".json", record(call, decision, self.fp)
                )
            except OSError as exc:
                ignored(f"cannot be written ({_why(exc)})")
                return None
            return self.read(call, folder)


def job_store() -> Any:
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


def listing(root: str | None = None) -> list[dict[str, Any]]:
    """The decisions in a disk cache (``attnguard doctor``), read under the cache's own rules:
    a fingerprint directory only when it is a real directory of this user that no one else may
    write, a file only when it is a regular file of this user (no link followed, a FIFO never
    opened) of at most :data:`MAX_FILE_BYTES`. What cannot be used is named with the reason,
    never read; strings are as stored (the caller shows them safely)."""
    base = root or cache_root()
    out: list[dict[str, Any]] = []
    try:
        prints = sorted(os.listdir(base))[:_MAX_LISTED]
    except OSError:
        return out
    for fp in prints:
        path = os.path.join(base, fp)
        if not os.path.lexists(path):
            continue  # gone since the listing: nothing to make
        try:
            folder = safefiles.PrivateDir(path)
        except OSError as exc:
            out.append({"file": path, "error": _why(exc)})
            continue
        with folder:
            names = sorted(n for n in folder.names() if n.endswith(".json"))
            for name in names[:_MAX_LISTED]:
                try:
                    raw, _ = folder.read(name, MAX_FILE_BYTES)
                except OSError as exc:
                    out.append({"file": os.path.join(path, name), "error": _why(exc)})
                    continue
                out.append({"file": os.path.join(path, name), **_shown(raw)})
    return out


_MAX_LISTED = 500


def _shown(raw: bytes) -> dict[str, Any]:
    """What doctor shows of one record: its GPU, bucket, winner and why, as strings (cut)."""
    try:
        data = json.loads(raw.decode("utf-8", "replace"))
    except (ValueError, RecursionError):
        return {"error": "not JSON"}
    if not isinstance(data, dict):
        return {"error": "not a kernel decision"}
    fp, bucket, why = data.get("fingerprint"), data.get("bucket"), data.get("why")
    cost = data.get("cost") if isinstance(data.get("cost"), dict) else {}
    winner = str(data.get("winner"))[:40]
    return {
        "gpu": str(fp.get("gpu"))[:80] if isinstance(fp, dict) else "?",
        "bucket": "/".join(str(x) for x in bucket)[:300] if isinstance(bucket, list) else "?",
        "winner": winner,
        "why": str(why.get(winner, ""))[:200] if isinstance(why, dict) else "",
        **{k: v for k, v in cost.items() if k in _COST and isinstance(v, (int, float))},
    }


_COST = ("race_s", "warm_up_s")
