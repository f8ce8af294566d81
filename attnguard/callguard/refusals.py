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
are pure and cheap (shapes and dtypes) and run on the slow path only, never on the fast check.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels import EntryKind
from .entry import Entry

Tensor = torch.Tensor

REMEDIED_DTYPES = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_INT32 = torch.int32
_REGISTRY = (EntryKind.REGISTRY_FLASH, EntryKind.REGISTRY_SDPA)


def as_made(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """Why this call must run as made (a short phrase), or None: the remedies may act. Plain
    reads of shapes and dtypes, traced as they are under torch.compile (no ``try``: where one
    fails on an odd argument, fail-open reports it and the original call runs)."""
    why = _dtype_refusal(entry, args, kwargs)
    return why if why is not None else _shape_refusal(entry, args, kwargs)


def _get(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """Argument ``name`` of the call, positional or keyword (None where not passed)."""
    slot = entry.slots.get(name)
    index = slot[0] if slot is not None else _position(entry.params, name)
    if index is not None and index < len(args):
        return args[index]
    return kwargs.get(name)


def _position(params: tuple[str, ...], name: str) -> int | None:
    return params.index(name) if name in params else None


_KVCACHE = ("q", "k_cache", "v_cache")


def _dtype_refusal(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The tensors whose dtypes a kernel reads: q/k/v (packed included); the caches and the new
    k/v of ``flash_attn_with_kvcache``. One that is no tensor at all: the kernel's to refuse."""
    kvcache = entry.kind == EntryKind.FLASH_KERNEL and entry.name == "flash_attn_with_kvcache"
    names = _KVCACHE if kvcache else entry.tensors
    ts = [_get(entry, args, kwargs, n) for n in names]
    if not all(isinstance(t, Tensor) for t in ts):
        return "q/k/v are not all tensors"
    if kvcache:
        ts += [t for t in (_get(entry, args, kwargs, n) for n in ("k", "v")) if t is not None]
    dts = [t.dtype for t in ts if isinstance(t, Tensor)]
    if entry.kind == EntryKind.XFORMERS and len(dts) == 3 and dts[1] is dts[2] is _INT32:
        # xformers' quantized key/value (packed int4 with scales): its own kernel computes
        # them, untouched; no cast and no twin can
        return "quantized key/value (int32): xformers' own kernels compute them"
    odd = [d for d in dts if d not in REMEDIED_DTYPES]
    if odd:
        return f"{str(odd[0]).replace('torch.', '')} attention inputs (no remedy computes them)"
    return None


def _shape_refusal(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    kind = entry.kind
    if kind == EntryKind.FLASH_KERNEL:
        check = _FLASH_CHECKS.get(entry.name)
        return check(entry, args, kwargs) if check is not None else None
    if kind == EntryKind.XFORMERS:
        q, k, v = (_get(entry, args, kwargs, n) for n in entry.tensors)
        return _xformers(q, k, v)
    if kind in _REGISTRY and kwargs.get("cache") is None:  # a paged cache: its own layout
        q, k, v = (_get(entry, args, kwargs, n) for n in entry.tensors)
        return _registry(q, k, v)
    return None  # another library's entry: its layout is its own


def _tensor_ranks(ranks: tuple[int, ...], *ts: Any) -> bool:
    return all(isinstance(t, Tensor) and t.dim() == r for t, r in zip(ts, ranks, strict=True))


def _heads(h: int, hk: int) -> str | None:
    if hk <= 0 or h % hk:
        return f"{hk} key/value heads do not divide {h} query heads"
    return None


def _dense(q: Any, k: Any, v: Any) -> str | None:
    """flash-attn 2 ``mha_fwd``: q (B, Sq, H, D), k and v (B, Sk, Hk, D)."""
    if not _tensor_ranks((4, 4, 4), q, k, v):
        return "q, k, v are not (batch, seqlen, nheads, headdim)"
    b, _, h, d = q.shape
    if k.shape[0] != b or tuple(v.shape) != tuple(k.shape) or k.shape[3] != d:
        return "k and v do not have shape (batch, seqlen_k, nheads_k, headdim) of q"
    return _heads(h, k.shape[2])


def _flash_func(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    q, k, v = (_get(entry, args, kwargs, n) for n in ("q", "k", "v"))
    return _dense(q, k, v)


def _flash_qkvpacked(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    qkv = _get(entry, args, kwargs, "qkv")
    if not _tensor_ranks((5,), qkv) or qkv.shape[2] != 3:
        return "qkv is not (batch, seqlen, 3, nheads, headdim)"
    return None


def _flash_kvpacked(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    q, kv = _get(entry, args, kwargs, "q"), _get(entry, args, kwargs, "kv")
    if not _tensor_ranks((5,), kv) or kv.shape[2] != 2:
        return "kv is not (batch, seqlen_k, 2, nheads_k, headdim)"
    return _dense(q, kv[:, :, 0], kv[:, :, 1])


def _varlen(q: Any, k: Any, v: Any, cu_q: Any, cu_k: Any, paged: bool) -> str | None:
    """flash-attn 2 ``mha_varlen_fwd``: q (total_q, H, D), k and v (total_k, Hk, D) or paged
    (num_blocks, block_size, Hk, D); cu_seqlens_q and cu_seqlens_k of batch + 1 each."""
    if not _tensor_ranks((3, 4 if paged else 3, 4 if paged else 3), q, k, v):
        return "q, k, v are not (total, nheads, headdim)"
    if tuple(v.shape) != tuple(k.shape) or k.shape[-1] != q.shape[-1]:
        return "k and v do not have shape (total_k, nheads_k, headdim) of q"
    cu = isinstance(cu_q, Tensor) and isinstance(cu_k, Tensor)
    if cu and (cu_q.dim() != 1 or cu_k.shape != cu_q.shape):
        return "cu_seqlens_q and cu_seqlens_k are not (batch + 1,) each"
    return _heads(q.shape[1], k.shape[-2])


def _flash_varlen(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    got = [_get(entry, args, kwargs, n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
    paged = _get(entry, args, kwargs, "block_table") is not None
    return _varlen(*got, paged)


def _flash_varlen_qkvpacked(
    entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    qkv = _get(entry, args, kwargs, "qkv")
    if not _tensor_ranks((4,), qkv) or qkv.shape[1] != 3:
        return "qkv is not (total, 3, nheads, headdim)"
    return None


def _flash_varlen_kvpacked(
    entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> str | None:
    q, kv = _get(entry, args, kwargs, "q"), _get(entry, args, kwargs, "kv")
    if not _tensor_ranks((4,), kv) or kv.shape[1] != 2:
        return "kv is not (total_k, 2, nheads_k, headdim)"
    cu = [_get(entry, args, kwargs, n) for n in ("cu_seqlens_q", "cu_seqlens_k")]
    return _varlen(q, kv[:, 0], kv[:, 1], *cu, False)


def _flash_kvcache(entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """flash-attn 2 ``mha_fwd_kvcache``: q (B, Sq, H, D); the caches (B_c, S, Hk, D) or paged
    (num_blocks, block_size, Hk, D), alike; new k and v (B, S_new, Hk, D)."""
    q, kc, vc, k, v = (_get(entry, args, kwargs, n) for n in ("q", "k_cache", "v_cache", "k", "v"))
    if not _tensor_ranks((4, 4, 4), q, kc, vc):
        return "q, k_cache, v_cache are not (batch, seqlen, nheads, headdim)"
    if tuple(vc.shape) != tuple(kc.shape) or kc.shape[3] != q.shape[3]:
        return (
            "k_cache and v_cache do not have shape (batch_cache, seqlen_cache, nheads_k, headdim)"
        )
    if (k is None) != (v is None):
        return "a new key without a value, or a value without a key"
    if k is not None:
        want = (q.shape[0], kc.shape[2], kc.shape[3])
        if not _tensor_ranks((4, 4), k, v) or tuple(v.shape) != tuple(k.shape):
            return "new k and v are not (batch, seqlen_new, nheads_k, headdim) alike"
        if (k.shape[0], k.shape[2], k.shape[3]) != want:
            return "new k and v do not fit the cache"
    return _heads(q.shape[2], kc.shape[2])


def _xformers(q: Any, k: Any, v: Any) -> str | None:
    """xformers' ``validate_inputs``: BMK, BMHK or BMGHK alike, one batch, key and value of one
    length, the same heads (no broadcasting), query and key of one head dimension."""
    if (
        not isinstance(q, Tensor)
        or q.dim() not in (3, 4, 5)
        or not _tensor_ranks((q.dim(), q.dim()), k, v)
    ):
        return "query/key/value are not all BMK, BMHK or BMGHK"
    quantized = v.dtype is _INT32
    b, _ = q.shape[:2]
    if k.shape[0] != b or v.shape[0] != b or k.shape[1] != v.shape[1]:
        return "query/key/value batch or key/value lengths differ"
    if tuple(k.shape[2:-1]) != tuple(q.shape[2:-1]) or tuple(v.shape[2:-1]) != tuple(q.shape[2:-1]):
        return "query/key/value heads differ"
    if not quantized and k.shape[-1] != q.shape[-1]:
        return "query and key head dimensions differ"
    return None


def _registry(q: Any, k: Any, v: Any) -> str | None:
    """transformers' attention registry: q (B, H, Sq, D), k and v (B, Hk, Sk, D) (v's head
    dimension may differ: multi-head latent attention)."""
    if not _tensor_ranks((4, 4, 4), q, k, v):
        return "query/key/value are not (batch, heads, seqlen, head_dim)"
    b, h, _, d = q.shape
    if k.shape[0] != b or v.shape[0] != b or tuple(k.shape[1:3]) != tuple(v.shape[1:3]):
        return "key/value batch, heads or lengths do not fit the query"
    if k.shape[3] != d:
        return "query and key head dimensions differ"
    return _heads(h, k.shape[1])


_FLASH_CHECKS = {
    "flash_attn_func": _flash_func,
    "flash_attn_qkvpacked_func": _flash_qkvpacked,
    "flash_attn_kvpacked_func": _flash_kvpacked,
    "flash_attn_varlen_func": _flash_varlen,
    "flash_attn_varlen_qkvpacked_func": _flash_varlen_qkvpacked,
    "flash_attn_varlen_kvpacked_func": _flash_varlen_kvpacked,
    "flash_attn_with_kvcache": _flash_kvcache,
}
