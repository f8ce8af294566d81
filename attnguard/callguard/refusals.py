"""Calls the guard leaves exactly as made, decided from their arguments alone.

Two kinds, both the caller's to fix and neither attnguard's to remedy:

* **q/k/v of a dtype no remedy computes**: complex (a rotary embedding left in
  ``view_as_complex`` form), integer, bool, float8 — and, for ``flash_attn_with_kvcache``, a
  cache or new k/v of such a dtype (an int8 cache). Casting them to a floating dtype would turn
  a type error into numbers (a complex cast drops the imaginary part). The remedies work only
  with the real floating dtypes torch's attention computes in (:data:`REMEDIED_DTYPES`).
  xformers' quantized call (int32 key and value: packed int4 with scales) is its own
  convention: its kernel computes it untouched, and no twin could.
* **arguments the kernel itself refuses**: ranks, batch sizes, sequence lengths, heads and head
  dimensions that do not fit together (key/value heads that do not divide the query heads,
  ...), checked as the kernel checks them (flash-attn 2's ``mha_fwd`` family, xformers'
  ``validate_inputs``, the layout of transformers' attention registry). A twin would refuse
  them too, from inside attnguard, and read as attnguard's own failure.

Such a call runs as the caller made it, so its answer is the kernel's own: its error, type and
message unchanged, and no event (nothing was changed). Only where the kernel raises on other
grounds first (CPU tensors into flash-attn) is that its answer, as without attnguard. The checks
are pure and cheap (shapes and dtypes, about a microsecond: each entry's checker is made once,
with its arguments' positions) and run on the slow path only, never on the fast check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..kernels import EntryKind
from .entry import Entry

Tensor = torch.Tensor

REMEDIED_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_INT32 = torch.int32
_REGISTRY = (EntryKind.REGISTRY_FLASH, EntryKind.REGISTRY_SDPA)

Slot = tuple[int | None, str]  # (positional index, keyword name) of an argument
Check = Callable[[tuple[Any, ...], dict[str, Any]], str | None]
# (the tensors, a reader of any other argument by name, the call's args and kwargs) -> why the
# kernel refuses the call, or None
Other = Callable[[str, tuple[Any, ...], dict[str, Any]], Any]
Shapes = Callable[[list[Any], Other, tuple[Any, ...], dict[str, Any]], str | None]


def as_made(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why this call must run as made (a short phrase), or None: the remedies may act. Plain
    reads of shapes and dtypes, traced as they are under torch.compile (no ``try``: where one
    fails on an odd argument, fail-open reports it and the original call runs)."""
    check = getattr(entry, "_as_made", None)
    if check is None:
        check = entry._as_made = _checker(entry)  # type: ignore[attr-defined]
    return check(args, kwargs)


def _slot(entry: Entry, name: str) -> Slot:
    slot = entry.slots.get(name)
    if slot is not None:
        return slot
    return (entry.params.index(name) if name in entry.params else None), name


def _read(slot: Slot, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    index, name = slot
    if index is not None and index < len(args):
        return args[index]
    return kwargs.get(name)


def _checker(entry: Entry) -> Check:
    """The check of one entry's calls, its arguments' positions read once."""
    kind = entry.kind
    kvcache = kind == EntryKind.FLASH_KERNEL and entry.name == "flash_attn_with_kvcache"
    slots = [_slot(entry, n) for n in (("q", "k_cache", "v_cache") if kvcache else entry.tensors)]
    extra = [_slot(entry, n) for n in ("k", "v")] if kvcache else []
    xformers = kind == EntryKind.XFORMERS
    shapes = _shapes_of(entry)
    named: dict[str, Slot] = {}
    ok = REMEDIED_DTYPES

    def other(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        slot = named.get(name)
        if slot is None:
            slot = named[name] = _slot(entry, name)
        return _read(slot, args, kwargs)

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        ts = [_read(s, args, kwargs) for s in slots]
        for t in ts:
            if not isinstance(t, Tensor):
                return "q/k/v are not all tensors"
        if xformers and ts[1].dtype is _INT32 and ts[2].dtype is _INT32:
            # xformers' quantized key/value (packed int4 with scales): its own kernel computes
            # them, untouched; no cast and no twin can
            return "quantized key/value (int32): xformers' own kernels compute them"
        for t in ts:
            if t.dtype not in ok:
                return f"{str(t.dtype).replace('torch.', '')} inputs (no remedy computes them)"
        for s in extra:
            t = _read(s, args, kwargs)
            if isinstance(t, Tensor) and t.dtype not in ok:
                return f"{str(t.dtype).replace('torch.', '')} inputs (no remedy computes them)"
        return None if shapes is None else shapes(ts, other, args, kwargs)

    return check


def _shapes_of(entry: Entry) -> Shapes | None:
    kind = entry.kind
    if kind == EntryKind.FLASH_KERNEL:
        return _FLASH_CHECKS.get(entry.name)
    if kind == EntryKind.XFORMERS:
        return _xformers
    if kind in _REGISTRY:
        return _registry
    return None  # another library's entry: its layout is its own


def _ranks(ranks: tuple[int, ...], *ts: Any) -> bool:
    for t, r in zip(ts, ranks, strict=True):
        if not isinstance(t, Tensor) or t.dim() != r:
            return False
    return True


def _heads(h: int, hk: int) -> str | None:
    if hk <= 0 or h % hk:
        return f"{hk} key/value heads do not divide {h} query heads"
    return None


def _dense(qs: Any, ks: Any, vs: Any) -> str | None:
    """flash-attn 2 ``mha_fwd`` on the shapes: q (B, Sq, H, D), k and v (B, Sk, Hk, D)."""
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        return "q, k, v are not (batch, seqlen, nheads, headdim)"
    if ks != vs or ks[0] != qs[0] or ks[3] != qs[3]:
        return "k and v do not have shape (batch, seqlen_k, nheads_k, headdim) of q"
    return _heads(qs[2], ks[2])


def _flash_func(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    q, k, v = ts
    return _dense(q.shape, k.shape, v.shape)


def _flash_qkvpacked(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    (qkv,) = ts
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        return "qkv is not (batch, seqlen, 3, nheads, headdim)"
    return None


def _flash_kvpacked(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    q, kv = ts
    kvs = kv.shape
    if len(kvs) != 5 or kvs[2] != 2:
        return "kv is not (batch, seqlen_k, 2, nheads_k, headdim)"
    k = (kvs[0], kvs[1], kvs[3], kvs[4])
    return _dense(q.shape, k, k)


def _varlen(
    qs: Any, ks: Any, vs: Any, other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """flash-attn 2 ``mha_varlen_fwd`` on the shapes: q (total_q, H, D), k and v (total_k, Hk,
    D) or paged (num_blocks, block_size, Hk, D); cu_seqlens_q and cu_seqlens_k of batch + 1
    each."""
    rank = 4 if other("block_table", args, kwargs) is not None else 3
    if len(qs) != 3 or len(ks) != rank or ks != vs or ks[-1] != qs[-1]:
        return "k and v do not have shape (total_k, nheads_k, headdim) of q (total_q, ...)"
    cu_q, cu_k = other("cu_seqlens_q", args, kwargs), other("cu_seqlens_k", args, kwargs)
    cu = isinstance(cu_q, Tensor) and isinstance(cu_k, Tensor)
    if cu and (cu_q.dim() != 1 or cu_k.shape != cu_q.shape):
        return "cu_seqlens_q and cu_seqlens_k are not (batch + 1,) each"
    return _heads(qs[1], ks[-2])


def _flash_varlen(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    q, k, v = ts
    return _varlen(q.shape, k.shape, v.shape, other, args, kwargs)


def _flash_varlen_qkvpacked(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    (qkv,) = ts
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        return "qkv is not (total, 3, nheads, headdim)"
    return None


def _flash_varlen_kvpacked(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    q, kv = ts
    kvs = kv.shape
    if len(kvs) != 4 or kvs[1] != 2:
        return "kv is not (total_k, 2, nheads_k, headdim)"
    k = (kvs[0], kvs[2], kvs[3])
    return _varlen(q.shape, k, k, other, args, kwargs)


def _flash_kvcache(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """flash-attn 2 ``mha_fwd_kvcache``: q (B, Sq, H, D); the caches (B_c, S, Hk, D) or paged
    (num_blocks, block_size, Hk, D), alike; new k and v (B, S_new, Hk, D)."""
    q, kc, vc = ts
    if not _ranks((4, 4, 4), q, kc, vc):
        return "q, k_cache, v_cache are not (batch, seqlen, nheads, headdim)"
    if vc.shape != kc.shape or kc.shape[3] != q.shape[3]:
        return (
            "k_cache and v_cache do not have shape (batch_cache, seqlen_cache, nheads_k, headdim)"
        )
    k, v = other("k", args, kwargs), other("v", args, kwargs)
    if (k is None) != (v is None):
        return "a new key without a value, or a value without a key"
    if k is not None:
        if not _ranks((4, 4), k, v) or v.shape != k.shape:
            return "new k and v are not (batch, seqlen_new, nheads_k, headdim) alike"
        if (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], kc.shape[2], kc.shape[3]):
            return "new k and v do not fit the cache"
    return _heads(q.shape[2], kc.shape[2])


def _xformers(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """xformers' ``validate_inputs``: BMK, BMHK or BMGHK alike, one batch, key and value of one
    length, the same heads (no broadcasting), query and key of one head dimension."""
    q, k, v = ts
    n = q.dim()
    if n not in (3, 4, 5) or k.dim() != n or v.dim() != n:
        return "query/key/value are not all BMK, BMHK or BMGHK"
    qs, ks, vs = q.shape, k.shape, v.shape
    if ks[0] != qs[0] or vs[0] != qs[0] or ks[1] != vs[1]:
        return "query/key/value batch or key/value lengths differ"
    if ks[2:-1] != qs[2:-1] or vs[2:-1] != qs[2:-1]:
        return "query/key/value heads differ"
    if ks[-1] != qs[-1]:
        return "query and key head dimensions differ"
    return None


def _registry(
    ts: list[Any], other: Other, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    """transformers' attention registry: q (B, H, Sq, D), k and v (B, Hk, Sk, D) (v's head
    dimension may differ: multi-head latent attention). A paged cache has its own layout."""
    if other("cache", args, kwargs) is not None:
        return None
    q, k, v = ts
    if not _ranks((4, 4, 4), q, k, v):
        return "query/key/value are not (batch, heads, seqlen, head_dim)"
    qs, ks, vs = q.shape, k.shape, v.shape
    if ks[0] != qs[0] or vs[0] != qs[0] or ks[1:3] != vs[1:3]:
        return "key/value batch, heads or lengths do not fit the query"
    if ks[3] != qs[3]:
        return "query and key head dimensions differ"
    return _heads(qs[1], ks[1])


_FLASH_CHECKS: dict[str, Shapes] = {
    "flash_attn_func": _flash_func,
    "flash_attn_qkvpacked_func": _flash_qkvpacked,
    "flash_attn_kvpacked_func": _flash_kvpacked,
    "flash_attn_varlen_func": _flash_varlen,
    "flash_attn_varlen_qkvpacked_func": _flash_varlen_qkvpacked,
    "flash_attn_varlen_kvpacked_func": _flash_varlen_kvpacked,
    "flash_attn_with_kvcache": _flash_kvcache,
}
