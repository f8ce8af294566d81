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

from typing import Any

import torch

from .calls import BUCKET_ARGS, REGISTRY_KWARGS, seq_axis

Tensor = torch.Tensor

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


def sampler(setting: str) -> Sampler:
    found = _samplers.get(setting)
    if found is None:
        found = _samplers[setting] = Sampler(setting)
    return found


class Layout:
    """Where an entry's bucket facts sit in its calls (read once per entry): the query's slot,
    and the slots of the arguments of :data:`.calls.BUCKET_ARGS` it can be given."""

    def __init__(self, entry: Any, convention: str) -> None:
        params = entry.params
        index, self.q_key = entry.slots[entry.tensors[0]]
        self.q_index = _NOWHERE if index is None else index
        self.head_axis = entry.head_axis
        self.seq_axis = seq_axis(convention, entry)
        self.registry = convention == "transformers"
        self.reads = tuple(
            (params.index(n) if n in params else _NOWHERE, n)
            for n in BUCKET_ARGS
            if n in params or (self.registry and n in REGISTRY_KWARGS)
        )


_NOWHERE = 1 << 30  # no positional slot: keywords only
_PLAIN = (bool, int, float, str, tuple)


def bucket(entry: Any, layout: Layout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The call's bucket: cheap reads only (this runs for every call while the check is on)."""
    n = len(args)
    q = args[layout.q_index] if layout.q_index < n else kwargs.get(layout.q_key)
    key: list[Any] = [id(entry), type(args[0]) if layout.registry and n else None]
    if isinstance(q, Tensor):
        shape = q.shape
        axis = layout.seq_axis
        key += (q.dtype, shape[layout.head_axis], axis is not None and shape[axis] == 1)
    for index, name in layout.reads:
        value = args[index] if index < n else kwargs.get(name)
        if value is None or value.__class__ in _PLAIN:
            key.append(value)
        elif isinstance(value, Tensor):
            key.append(value.dim())
        elif isinstance(value, list):
            key.append(tuple(value))
        else:
            key.append(value.__class__)
    found = tuple(key)
    if len(_counters) >= MAX_BUCKETS and found not in _counters:
        return tuple(key[:3])
    return found


def take(entry: Any, layout: Layout, setting: str, args: tuple, kwargs: dict) -> bool:
    """Count this call in its bucket; True when it is one the setting checks. (Counted without a
    lock: two threads may both read a count before either writes it; a count off by one in a
    race moves which call is checked, never whether calls are.)"""
    key = bucket(entry, layout, args, kwargs)
    n = _counters.get(key, 0)
    _counters[key] = n + 1
    found = _samplers.get(setting)
    return (found if found is not None else sampler(setting)).takes(n)


def reset() -> None:
    """Forget the counters (tests)."""
    _counters.clear()
