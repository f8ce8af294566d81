"""Which calls the numbers check takes: deterministic counters per bucket of calls.

A *bucket* is what a kernel's code path depends on: the entry point (and the module type for
transformers' registry), the query's dtype and head dimension, whether it decodes (one query
row), and the values of the arguments that change the path (causal, window, softcap, the kind
and rank of a mask or bias, ALiBi, a paged cache). ``ATTNGUARD_VERIFY`` says which calls of
each bucket are taken: ``all``; a rate ``r`` (every ``round(1 / r)``-th call, the bucket's first
call included, so a bug in a rare shape is met at its first call); ``first:N`` (the first N).
Counters are per process (each rank checks its own sample) and never reset: the same program
checks the same calls.
"""

from __future__ import annotations

import threading
from typing import Any

from .calls import BUCKET_ARGS, seq_axis

MAX_BUCKETS = 4096  # beyond: buckets by entry point and dtype only


class Sampler:
    """The parsed setting (one per settings value)."""

    def __init__(self, setting: str) -> None:
        self.setting = setting
        self.first = 0
        self.period = 1
        if setting.startswith("first:"):
            self.first = int(setting[6:])
        elif setting != "all":
            self.period = max(1, round(1.0 / float(setting)))

    def takes(self, n: int) -> bool:
        """Whether the bucket's ``n``-th call (0 first) is checked."""
        if self.first:
            return n < self.first
        return n % self.period == 0


_samplers: dict[str, Sampler] = {}
_counters: dict[Any, int] = {}
_lock = threading.Lock()


def sampler(setting: str) -> Sampler:
    found = _samplers.get(setting)
    if found is None:
        found = _samplers[setting] = Sampler(setting)
    return found


class Layout:
    """Where an entry's bucket facts sit in its calls (read once per entry)."""

    def __init__(self, entry: Any, convention: str) -> None:
        params = entry.params
        self.positions = {n: (params.index(n) if n in params else -1) for n in BUCKET_ARGS}
        self.query = entry.slots[entry.tensors[0]]
        self.seq_axis = seq_axis(convention, entry)
        self.registry = convention == "transformers"


def bucket(entry: Any, layout: Layout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from .calls import bucket_flags

    index, key = layout.query
    q = args[index] if index is not None and index < len(args) else kwargs.get(key)
    site = (id(entry), type(args[0]) if layout.registry and args else None)
    if q is None or not hasattr(q, "dtype"):
        return site
    axis = layout.seq_axis
    decode = axis is not None and q.dim() > axis and q.shape[axis] == 1
    head_dim = q.shape[entry.head_axis] if q.dim() else 0
    key_ = (*site, q.dtype, head_dim, decode, bucket_flags(entry, layout.positions, args, kwargs))
    if len(_counters) >= MAX_BUCKETS and key_ not in _counters:
        return (*site, q.dtype)
    return key_


def take(entry: Any, layout: Layout, setting: str, args: tuple, kwargs: dict) -> bool:
    """Count this call in its bucket; True when it is one the setting checks."""
    key = bucket(entry, layout, args, kwargs)
    with _lock:
        n = _counters.get(key, 0)
        _counters[key] = n + 1
    return sampler(setting).takes(n)


def reset() -> None:
    """Forget the counters (tests)."""
    with _lock:
        _counters.clear()
