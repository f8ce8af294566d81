"""Reading one attention call for the numbers check, in its entry point's calling convention:
its arguments by name, q/k/v in flash layout, the arguments that matter to its numbers, and the
explicit float64 reference of its family's rules (:mod:`.explicit`) where that can express it.

Conventions (how an entry point is called): ``flash_attn`` (flash-attn's functions, known by
name), ``xformers`` (``memory_efficient_attention``), ``transformers`` (the attention registry:
``fn(module, query, key, value, attention_mask, ...)``, q/k/v as (B, H, S, D)), ``diffusers``
(the dispatcher's backend functions: keywords, q/k/v as (B, S, H, D)).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernel_identity import DROPOUT_FAMILIES, Family
from ..kernels import REGISTRY_KINDS, EntryKind
from . import explicit
from .explicit import Rules

Tensor = torch.Tensor

FLASH, XFORMERS, TRANSFORMERS, DIFFUSERS = "flash_attn", "xformers", "transformers", "diffusers"
_KIND_CONVENTION = {EntryKind.FLASH_KERNEL: FLASH, EntryKind.XFORMERS: XFORMERS}
# the arguments whose values change a kernel's code path: part of a call's sampling bucket
BUCKET_ARGS = (
    "causal",
    "window_size",
    "softcap",
    "is_causal",
    "sliding_window",
    "attn_bias",
    "attention_mask",
    "attn_mask",
    "alibi_slopes",
    "block_table",
)
# the ones transformers' registry functions get as keywords (not parameters of every function)
REGISTRY_KWARGS = frozenset({"sliding_window", "softcap", "is_causal"})
# the query's sequence axis, per convention (None: packed rows)
_SEQ_AXIS = {FLASH: 1, XFORMERS: 1, TRANSFORMERS: 2, DIFFUSERS: 1}


def convention_of(entry: Any) -> str | None:
    """How ``entry`` is called (what its integration said, else what its kind implies)."""
    given = getattr(entry, "convention", "") or None
    if given is not None:
        return given
    if entry.kind in _KIND_CONVENTION:
        return _KIND_CONVENTION[entry.kind]
    return TRANSFORMERS if entry.kind in REGISTRY_KINDS else None


def signature_of(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


@dataclass
class Call:
    """One sampled call, read: ``named`` holds every argument by name (defaults filled in)."""

    convention: str
    name: str
    family: Family | None
    named: dict[str, Any]
    q: Tensor  # flash layout (B, S, H, D); packed rows (T, H, D)
    k: Tensor
    v: Tensor
    dropout: float = 0.0
    unsupported: str = ""  # why the reference cannot compute this call ("" where it can)
    matters: dict[str, Any] = field(default_factory=dict)  # the arguments events name

    @property
    def qkv(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.q, self.k, self.v

    @property
    def keys(self) -> int:
        """Keys per query at most: the accumulation length."""
        if self.convention == FLASH and "max_seqlen_k" in self.named:
            return int(self.named.get("max_seqlen_k") or self.k.shape[0])
        return int(self.k.shape[-3]) if self.k.dim() >= 3 else int(self.k.shape[0])


def read(entry: Any, convention: str, family: Family | None, args: tuple, kwargs: dict) -> Call:
    """The call's arguments by name, q/k/v and the arguments that matter to its numbers."""
    sig = signature_of(entry.original) or signature_of(entry.twin)
    if sig is None:
        raise TypeError(f"{entry.name}: no signature to read its arguments by")
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    named: dict[str, Any] = {}
    for key, value in bound.arguments.items():
        kind = sig.parameters[key].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL:
            named[key] = value
    reader = _READERS[convention]
    return reader(entry.name, family, named)


def on_one_device(call: Call) -> Call:
    """The call with every tensor argument on the query's device (the guard aligns a call whose
    inputs it found on several devices before the kernel; its reference is computed so too)."""
    dev = call.q.device
    moved = {
        key: value.to(dev) if isinstance(value, Tensor) and value.device != dev else value
        for key, value in call.named.items()
    }
    if all(moved[key] is call.named[key] for key in moved):
        return call
    again = _READERS[call.convention](call.name, call.family, moved)
    again.dropout = call.dropout
    return again


def _scale(value: Any, head_dim: int) -> float:
    return float(value) if value is not None else head_dim**-0.5


# --- flash-attn's functions ----------------------------------------------------------------------


def _flash(name: str, family: Family | None, a: dict[str, Any]) -> Call:
    if "qkv" in a:
        q, k, v = a["qkv"].unbind(dim=-3)
    elif "kv" in a:
        q = a["q"]
        k, v = a["kv"].unbind(dim=-3)
    elif name == "flash_attn_with_kvcache":
        q, k, v = a["q"], a["k_cache"], a["v_cache"]
    else:
        q, k, v = a["q"], a["k"], a["v"]
    call = Call(FLASH, name, family, a, q, k, v, dropout=float(a.get("dropout_p") or 0.0))
    window = a.get("window_size", (-1, -1))
    call.matters = {
        "causal": bool(a.get("causal")),
        "window": list(window) if window is not None else None,
        "softcap": float(a.get("softcap") or 0.0),
        "scale": _scale(a.get("softmax_scale"), q.shape[-1]),
        "dropout": call.dropout,
        "gqa": [q.shape[-2], k.shape[-2]],
        "alibi": a.get("alibi_slopes") is not None,
        "sinks": a.get("s_aux") is not None,
    }
    if a.get("block_table") is not None:
        call.unsupported = "paged KV cache (block_table)"
    return call


def _flash_rules(call: Call, sq: int, sk: int, seqlen_k: int) -> Rules:
    a = call.named
    causal, window = bool(a.get("causal")), tuple(a.get("window_size") or (-1, -1))
    if call.family in (Family.FA3, Family.FA4):
        causal, win = explicit.fa3_window(window, causal, sq, sk)
    else:
        causal, win = explicit.fa2_window(window, causal, seqlen_k)
    return Rules(
        scale=_scale(a.get("softmax_scale"), call.q.shape[-1]),
        causal="bottom_right" if causal else "",
        window=win,
        softcap=float(a.get("softcap") or 0.0),
        alibi=a.get("alibi_slopes"),
        sinks=a.get("s_aux"),
    )


def flash_explicit(call: Call, u: float) -> tuple[Tensor, Tensor] | None:
    """flash-attn's function computed by :func:`.explicit.attend` (None: not expressible)."""
    a = call.named
    if call.unsupported:
        return None
    if call.name == "flash_attn_with_kvcache":
        return _kvcache_explicit(call, u)
    if "cu_seqlens_q" in a or "cu_seqlens" in a:
        return _varlen_explicit(call, u)
    q, k, v = call.q, call.k, call.v
    return explicit.attend(q, k, v, _flash_rules(call, q.shape[1], k.shape[1], k.shape[1]), u)


def _varlen_explicit(call: Call, u: float) -> tuple[Tensor, Tensor]:
    a = call.named
    cu_q = a.get("cu_seqlens_q", a.get("cu_seqlens"))
    cu_k = a.get("cu_seqlens_k", a.get("cu_seqlens"))
    max_k = int(a.get("max_seqlen_k", a.get("max_seqlen")) or 0)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    q, k, v = call.q, call.k, call.v
    shape = (q.shape[0], q.shape[1], v.shape[-1])
    out = torch.full(shape, math.nan, dtype=torch.float64, device=q.device)
    allow = torch.zeros_like(out)
    slopes = a.get("alibi_slopes")
    for i in range(len(cq) - 1):
        qs, ks = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        if cq[i + 1] <= cq[i]:
            continue
        rules = _flash_rules(call, cq[i + 1] - cq[i], ck[i + 1] - ck[i], max_k)
        if slopes is not None and slopes.dim() == 2:
            rules = Rules(**{**rules.__dict__, "alibi": slopes[i]})
        o, al = explicit.attend(q[None, qs], k[None, ks], v[None, ks], rules, u)
        out[qs], allow[qs] = o[0], al[0]
    return out, allow


def _kvcache_explicit(call: Call, u: float) -> tuple[Tensor, Tensor] | None:
    """Keys: each row's first ``cache_seqlens[b]`` cached keys, then the new ``k`` (never what the
    kernel wrote into the cache: a kernel that writes wrong places is caught too)."""
    a = call.named
    for name in ("rotary_cos", "cache_batch_idx", "cache_leftpad", "alibi_slopes"):
        if a.get(name) is not None:
            return None
    lens = a.get("cache_seqlens")
    k_new, v_new = a.get("k"), a.get("v")
    q, kc, vc = call.q, call.k, call.v
    b, capacity = q.shape[0], kc.shape[1]
    if lens is None:
        if k_new is not None:
            return None
        old = [capacity] * b
    elif isinstance(lens, int):
        old = [lens] * b
    else:
        old = [int(x) for x in lens.reshape(-1).tolist()]
        old = old * b if len(old) == 1 else old
    outs, allows = [], []
    for i in range(b):
        keys, values = kc[i : i + 1, : old[i]], vc[i : i + 1, : old[i]]
        if k_new is not None:
            keys = torch.cat([keys, k_new[i : i + 1].to(keys.dtype)], dim=1)
            values = torch.cat([values, v_new[i : i + 1].to(values.dtype)], dim=1)
        rules = _flash_rules(call, q.shape[1], keys.shape[1], capacity)
        o, al = explicit.attend(q[i : i + 1], keys, values, rules, u)
        outs.append(o)
        allows.append(al)
    return torch.cat(outs), torch.cat(allows)


def used_values(call: Call) -> Tensor:
    """The values a call can read (a KV cache: only its filled part and the new values)."""
    if call.name != "flash_attn_with_kvcache":
        return call.v
    lens = call.named.get("cache_seqlens")
    parts = [call.named["v"]] if call.named.get("v") is not None else []
    if lens is None:
        return call.v
    top = lens if isinstance(lens, int) else int(lens.max())
    return torch.cat([call.v[:, :top].reshape(-1), *[p.reshape(-1) for p in parts]])


# --- xformers ---------------------------------------------------------------------------------------


def _xformers(name: str, family: Family | None, a: dict[str, Any]) -> Call:
    q, k, v = a["query"], a["key"], a["value"]
    if q.dim() == 3:
        q, k, v = q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2)
    elif q.dim() == 5:
        q, k, v = q.flatten(2, 3), k.flatten(2, 3), v.flatten(2, 3)
    call = Call(XFORMERS, name, family, a, q, k, v, dropout=float(a.get("p") or 0.0))
    bias = a.get("attn_bias")
    call.matters = {
        "bias": None if bias is None else type(bias).__name__,
        "scale": _scale(a.get("scale"), q.shape[-1]),
        "dropout": call.dropout,
        "gqa": [q.shape[-2], k.shape[-2]],
    }
    return call


def xformers_explicit(call: Call, u: float) -> tuple[Tensor, Tensor] | None:
    a = call.named
    bias = a.get("attn_bias")
    kind = type(bias).__name__
    rules = Rules(scale=_scale(a.get("scale"), call.q.shape[-1]), empty="nan")
    if kind == "LowerTriangularMask":
        rules = Rules(scale=rules.scale, causal="top_left", empty="nan")
    elif kind == "LowerTriangularFromBottomRightMask":
        rules = Rules(scale=rules.scale, causal="bottom_right", empty="nan")
    elif isinstance(bias, Tensor) and not hasattr(type(bias), "materialize"):
        mask = bias
        if a["query"].dim() == 5:
            mask = mask.flatten(1, 2) if mask.dim() == 5 else mask
        elif a["query"].dim() == 3 and mask.dim() == 3:
            mask = mask.unsqueeze(1)
        rules = Rules(scale=rules.scale, mask=mask, empty="nan")
    elif bias is not None:
        return None
    out, allow = explicit.attend(call.q, call.k, call.v, rules, u)
    shape = a["query"].shape[:-1] + (call.v.shape[-1],)
    return out.reshape(shape), allow.reshape(shape)


# --- transformers' attention registry ---------------------------------------------------------


def _transformers(name: str, family: Family | None, a: dict[str, Any]) -> Call:
    q, k, v = (a[n].transpose(1, 2) for n in ("query", "key", "value"))
    dropout = float(a.get("dropout") or 0.0)
    if family is not None and family not in DROPOUT_FAMILIES:
        dropout = 0.0  # flash-attn 3 / 4: transformers' flash path hands them none
    call = Call(TRANSFORMERS, name, family, a, q, k, v, dropout=dropout)
    mask = a.get("attention_mask")
    call.matters = {
        "causal": a.get("is_causal", getattr(a.get("module"), "is_causal", None)),
        "sliding_window": a.get("sliding_window"),
        "softcap": a.get("softcap"),
        "scale": _scale(a.get("scaling"), q.shape[-1]),
        "dropout": dropout,
        "gqa": [q.shape[-2], k.shape[-2]],
        "mask": None if mask is None else list(mask.shape),
        "sinks": a.get("s_aux") is not None,
    }
    return call


def sdpa_explicit(call: Call, u: float) -> tuple[Tensor, Tensor] | None:
    """transformers' sdpa entry: SDPA's semantics (top-left causal where no mask is given and the
    query has more than one row, the 4-D mask cut to the keys)."""
    a = call.named
    mask = a.get("attention_mask")
    if mask is not None and (not isinstance(mask, Tensor) or mask.dim() != 4):
        return None
    if mask is not None:
        mask = mask[:, :, :, : call.k.shape[1]]
    causal = a.get("is_causal")
    if causal is None:
        causal = getattr(a.get("module"), "is_causal", True)
    causal = bool(causal) and call.q.shape[1] > 1 and mask is None
    rules = Rules(
        scale=_scale(a.get("scaling"), call.q.shape[-1]),
        causal="top_left" if causal else "",
        mask=mask,
        empty="nan",
    )
    out, allow = explicit.attend(call.q, call.k, call.v, rules, u)
    return out, allow  # (B, S, H, D): the registry's own output layout


# --- diffusers' dispatcher ----------------------------------------------------------------------


def _diffusers(name: str, family: Family | None, a: dict[str, Any]) -> Call:
    q, k, v = a["query"], a["key"], a["value"]
    call = Call(DIFFUSERS, name, family, a, q, k, v, dropout=float(a.get("dropout_p") or 0.0))
    mask = a.get("attn_mask")
    call.matters = {
        "causal": bool(a.get("is_causal")),
        "window": a.get("window_size"),
        "scale": _scale(a.get("scale"), q.shape[-1]),
        "dropout": call.dropout,
        "gqa": [q.shape[-2], k.shape[-2]],
        "mask": None if mask is None else list(mask.shape),
    }
    if a.get("_parallel_config") is not None:
        call.unsupported = "context parallelism"
    return call


def diffusers_explicit(call: Call, u: float) -> tuple[Tensor, Tensor] | None:
    """The backend's documented semantics: SDPA's for torch's backends, flash-attn 2's for
    flash / flash_varlen, xformers' for xformers; a mask only where the backend is SDPA's (the
    others turn masks into what their kernels take)."""
    a = call.named
    if call.unsupported:
        return None
    mask, causal = a.get("attn_mask"), bool(a.get("is_causal"))
    scale = _scale(a.get("scale"), call.q.shape[-1])
    if call.family is Family.SDPA:
        if mask is not None and not isinstance(mask, Tensor):
            return None
        rules = Rules(scale=scale, causal="top_left" if causal else "", mask=mask, empty="nan")
    elif mask is not None:
        return None
    elif call.family is Family.FA2:
        window = a.get("window_size") or (-1, -1)
        causal, win = explicit.fa2_window(tuple(window), causal, call.k.shape[1])
        rules = Rules(scale=scale, causal="bottom_right" if causal else "", window=win)
    elif call.family is Family.XFORMERS:
        rules = Rules(scale=scale, causal="top_left" if causal else "", empty="nan")
    else:
        return None
    return explicit.attend(call.q, call.k, call.v, rules, u)


_READERS: dict[str, Callable[[str, Family | None, dict[str, Any]], Call]] = {
    FLASH: _flash,
    XFORMERS: _xformers,
    TRANSFORMERS: _transformers,
    DIFFUSERS: _diffusers,
}


PACKED_FUNCTIONS = frozenset(
    {
        "flash_attn_varlen_func",
        "flash_attn_varlen_qkvpacked_func",
        "flash_attn_varlen_kvpacked_func",
    }
)


def seq_axis(convention: str, entry: Any) -> int | None:
    if convention == FLASH and entry.name in PACKED_FUNCTIONS:
        return None
    return _SEQ_AXIS.get(convention)
