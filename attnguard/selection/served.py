"""The calls of decided buckets, served by their signature: what a decode loop pays per call
under ``ATTNGUARD_KERNEL=fastest``.

:func:`served` is the call guard's first question for a selected call, and for most calls its
only one: it reads the call's *signature* (its tensors' shapes, dtypes and devices, whether
autograd records, every other argument as passed) and answers with what the bucket's decision
serves calls like it with: the kernel, or None for the requested kernel. A call not served yet
gets its signature back (a tuple: empty where the call has none), which
:func:`attnguard.selection.decisions.serve` takes on from there: it describes the call once,
decides its bucket when that is new, and has :func:`remember` serve the next calls like it.

Everything is read inline, in this one function (no call of its own but torch's compile check):
a decided call leaves the guard twice, into :func:`served` and into the kernel that serves it.

Calls alike in their signature have one bucket: a signature holds every fact the bucket is made
from (:func:`attnguard.selection.buckets.bucket`). A ``flash_attn_func`` call — a decode loop's —
is compared field by field with what was remembered (its keyword arguments as a dict), rather
than hashed; its signature also holds every fact the call guard checks (the three tensors'
dtypes and devices, the head dim in the shape), so the guard serves such a call before checking
it: a call alike passed the check when it was remembered.
"""

from __future__ import annotations

from typing import Any

import torch

# a traced call is never served from here: nothing is counted inside a torch.compile trace
_COMPILING = torch.compiler.is_compiling
_GRAD_ENABLED = torch.is_grad_enabled
_TENSOR = torch.Tensor
_MAX = 4096  # signatures per entry: a job whose shapes never repeat starts over rather than grow
_NONE: dict[Any, Any] = {}

# flash_attn_func: k.shape -> its latest record (q.shape, dtype, device, is_cuda, grad, keyword
# arguments, apply, count cell, kernel, the record before it or None): the other facts compared
# one by one and the keyword arguments as a dict, cheaper than building and hashing a tuple of
# them at every call
_dense: dict[Any, tuple[Any, ...]] = {}
_RECORDS = 8  # records of one key shape (layers that differ in their window, say)
# the other entries: entry -> signature -> (its bucket's call count cell, None for a call left
# alone; the kernel or None; whether the mode applied decisions when it was remembered)
_tables: dict[str, dict[tuple[Any, ...], tuple[list[int] | None, Any, bool]]] = {}


def served(name: str, args: tuple[Any, ...], kwargs: dict[str, Any], apply: bool) -> Any:
    """The kernel this call's decided bucket serves it with (None: the requested kernel), or
    this call's signature where it is not served yet (the mode changed since, or a new one), as
    a tuple: empty where the call has none (inside a trace; tensors given by name; an argument
    that cannot be hashed; a ``flash_attn_func`` call whose tensors the guard's check would not
    pass), and the bucket is computed at each call. Never raises."""
    if _COMPILING():
        return ()
    try:
        if name == "flash_attn_func":
            q, k, v = args  # (not three tensors by position: no signature, below)
            dtype = q.dtype
            device = q.get_device()
            if (
                k.dtype is not dtype
                or v.dtype is not dtype
                or k.get_device() != device
                or v.get_device() != device
            ):
                return ()  # not a call the guard's check passes: never served from here
            grad = _GRAD_ENABLED() and (q.requires_grad or k.requires_grad or v.requires_grad)
            shape = q.shape
            cuda = q.is_cuda
            kshape = k.shape
            r = _dense.get(kshape)
            while r is not None:
                if (
                    r[0] == shape
                    and r[1] is dtype
                    and r[2] == device
                    and r[3] is cuda
                    and r[4] is grad
                    and r[6] is apply
                    and r[5] == kwargs  # (ALiBi slopes, a tensor: never in a record)
                ):
                    if r[7] is not None:
                        r[7][0] += 1  # the bucket's call count (a cell its records share)
                    return r[8]
                r = r[9]
            return (shape, kshape, dtype, device, cuda, grad)
        # flash_attn_varlen_func, flash_attn_with_kvcache: checked by the guard first
        q = args[0]
        grad = False
        parts: list[Any] = []
        for a in args:
            if isinstance(a, _TENSOR):
                parts.append(a.shape)
                grad = grad or a.requires_grad
            else:
                parts.append(a)
        for key, a in kwargs.items():
            parts.append(key)
            if isinstance(a, _TENSOR):
                parts.append(a.shape)
                grad = grad or a.requires_grad
            else:
                parts.append(a)
        if name == "flash_attn_varlen_func":
            # the longest lengths by value (the bucket reads them; flash-attn's own function
            # reads a tensor's on the host too)
            n = len(args)
            most_q = args[5] if n > 5 else kwargs["max_seqlen_q"]
            most_k = args[6] if n > 6 else kwargs["max_seqlen_k"]
            parts.append(most_q if most_q.__class__ is int else int(most_q))
            parts.append(most_k if most_k.__class__ is int else int(most_k))
        sig = (*parts, q.dtype, q.is_cuda, grad and _GRAD_ENABLED())
        hit = _tables.get(name, _NONE).get(sig)
    except Exception:  # an argument that is not what the entry takes, or cannot be hashed
        return ()
    if hit is None or hit[2] is not apply:
        return sig
    if hit[0] is not None:
        hit[0][0] += 1  # the bucket's call count (a shared cell: no tuple hashed here)
    return hit[1]


def signature(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """The call's signature as :func:`served` reads it (empty: none)."""
    got = served(name, args, kwargs, None)  # type: ignore[arg-type]  # no mode: never a hit
    return got if got.__class__ is tuple else ()


def remember(
    name: str,
    sig: tuple[Any, ...],
    kwargs: dict[str, Any],
    count: list[int] | None,
    kernel: Any,
    apply: bool,
) -> None:
    """Serve later calls with signature ``sig`` (and, for ``flash_attn_func``, these keyword
    arguments) with ``kernel`` (None: the requested one) while the mode's ``apply`` stays what it
    is; ``count``: the bucket's call count cell (None: a call the switch leaves alone). Bounded:
    a job whose shapes never repeat starts over rather than grow."""
    if name != "flash_attn_func":
        table = _tables.get(name)
        if table is None or len(table) >= _MAX:
            table = _tables[name] = {}
        table[sig] = (count, kernel, apply)
        return
    if any(isinstance(a, _TENSOR) for a in kwargs.values()):
        return  # compared as a dict, a tensor would be compared by value
    shape, kshape, dtype, device, cuda, grad = sig
    facts = (shape, dtype, device, cuda, grad, dict(kwargs))
    older = []
    r = _dense.get(kshape)
    while r is not None and len(older) < _RECORDS - 1:
        if r[:6] != facts:
            older.append(r[:9])
        r = r[9]
    if len(_dense) >= _MAX:
        _dense.clear()
    chain = None
    for r in reversed(older):
        chain = (*r, chain)
    _dense[kshape] = (*facts, apply, count, kernel, chain)


def reset() -> None:
    """Forget every remembered signature (with the decisions: tests, benchmarks)."""
    _tables.clear()
    _dense.clear()
