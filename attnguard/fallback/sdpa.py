"""torch SDPA plumbing shared by the twins, and explicit softmax attention where SDPA cannot go.

``sdpa`` never forces a backend: torch's dispatcher picks the fastest fused kernel that can take
the call (cuDNN, flash, memory-efficient), the math path only where none can. The explicit path
(:func:`explicit_attention`) computes what no SDPA call expresses: softcap, and the softmax LSE.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .masks import band_mask

Tensor = torch.Tensor

# Largest number of score elements the explicit (non-SDPA) path materialises at once; longer
# inputs are processed in blocks of query rows.
_MANUAL_CHUNK_ELEMS = 1 << 25
HALF_DTYPES = (torch.float16, torch.bfloat16)


def _sdpa_takes_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (key/value heads fewer than the query's
    without repeating them; torch 2.5 on), read from the op's own schema."""
    try:
        schema = torch.ops.aten.scaled_dot_product_attention.default._schema
        return any(a.name == "enable_gqa" for a in schema.arguments)
    except Exception:
        return False


# Read once at import, never inside a trace: torch.compile reads a module constant as a constant,
# and a call with a keyword the op lacks (a TypeError) is a graph break there, and an error with
# ``fullgraph=True``.
SDPA_TAKES_GQA = _sdpa_takes_gqa()


def repeat_kv_heads(x: Tensor, n_rep: int) -> Tensor:
    """(B, Hk, S, D) -> (B, Hk * n_rep, S, D), each key/value head repeated for its query heads
    (what ``enable_gqa`` spares where SDPA has it)."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


# --------------------------------------------------------------------------------------------
# SDPA plumbing
# --------------------------------------------------------------------------------------------


def _sdpa_heads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float,
) -> Tensor:
    """Run SDPA on (B, H, S, D) tensors; k/v may have fewer heads (GQA/MQA)."""
    kwargs: dict[str, Any] = {
        "attn_mask": attn_mask,
        "dropout_p": dropout_p,
        "is_causal": is_causal,
        "scale": scale,
    }
    hq, hk = q.shape[1], k.shape[1]
    if hq == hk:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    if SDPA_TAKES_GQA:
        try:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
        except RuntimeError:  # no backend takes GQA with this input
            pass
    rep = hq // hk
    k, v = repeat_kv_heads(k, rep), repeat_kv_heads(v, rep)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """SDPA in the input dtype, upcasting to float32 only if the backend rejects the dtype."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if attn_mask is not None and attn_mask.dtype != torch.bool and attn_mask.dtype != q.dtype:
        attn_mask = attn_mask.to(q.dtype)
    try:
        return _sdpa_heads(q, k, v, attn_mask, dropout_p, is_causal, scale)
    except RuntimeError:
        if q.dtype not in HALF_DTYPES:
            raise
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.float()
    out = _sdpa_heads(q.float(), k.float(), v.float(), attn_mask, dropout_p, is_causal, scale)
    return out.to(q.dtype)


def sdpa_bool_masked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    keep: Tensor | None,
    bias: Tensor | None,
    dropout_p: float,
    scale: float,
    empty: Tensor | None = None,
) -> Tensor:
    """SDPA with a bool keep-mask and/or float bias; rows marked in ``empty`` give zeros.

    ``keep`` is (..., Sq, Sk) and ``empty`` (..., Sq) marks its rows with no visible key (None
    when the caller knows there are none). Nothing here reads tensor values on the host, so
    the function traces under ``torch.compile(fullgraph=True)``.
    """
    if keep is not None and empty is not None:
        # Unmask empty rows so the softmax stays finite (no NaN in forward or backward),
        # then zero their output as flash-attn does.
        keep = keep | empty.unsqueeze(-1)
    attn_mask = keep
    if bias is not None:
        attn_mask = bias if keep is None else bias.masked_fill(~keep, -math.inf)
    out = sdpa(q, k, v, attn_mask, dropout_p, False, scale)
    if empty is not None:
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out


def causal_sdpa(q: Tensor, k: Tensor, v: Tensor, offset: int, p: float, scale: float) -> Tensor:
    """Causal SDPA on (B, H, S, D), query i seeing keys j <= i + offset."""
    sq, sk = q.shape[2], k.shape[2]
    if offset == 0 and sq == sk:
        return sdpa(q, k, v, None, p, True, scale)
    keep, empty = band_mask(sq, sk, offset, -1, 0, q.device)
    return sdpa_bool_masked(q, k, v, keep, None, p, scale, empty)


BiasRows = Callable[[int, int, torch.dtype], Tensor]


def explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    keep: Tensor | None,
    softcap: float,
    bias_rows: BiasRows | None,
    dropout_p: float,
    sinks_lse: bool = False,
) -> tuple[Tensor, Tensor]:
    """Explicit softmax attention on (B, H, S, D) in float32 (float64 stays float64).

    Used where SDPA cannot express the computation (softcap) or the lse is wanted. ``keep`` is
    a bool mask broadcastable to (B, H, Sq, Sk); ``bias_rows(r0, r1, dtype)`` gives the additive
    bias of query rows [r0, r1), broadcastable to (B, H, r1 - r0, Sk). Returns (out in the
    input dtype, float32 lse of shape (B, H, Sq) with +inf for empty rows). The lse carries no
    gradient (as flash-attn's) unless ``sinks_lse``: attention sinks are computed from it, so it
    then stays in the compute dtype and carries its gradient where autograd is on.
    """
    b, h, sq, _ = q.shape
    hk, sk = k.shape[1], k.shape[2]
    g = h // hk
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    qc = q.to(cdt).reshape(b, hk, g, sq, q.shape[-1])
    kc = k.to(cdt).unsqueeze(2).transpose(-1, -2)
    vc = v.to(cdt).unsqueeze(2)
    step = max(1, _MANUAL_CHUNK_ELEMS // max(1, b * h * sk))
    outs, lses = [], []
    for r0 in range(0, sq, step):
        r1 = min(sq, r0 + step)
        s = torch.matmul(qc[:, :, :, r0:r1], kc).reshape(b, h, r1 - r0, sk) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        if bias_rows is not None:
            s = s + bias_rows(r0, r1, cdt)
        if keep is not None:
            s = s.masked_fill(~keep[..., r0:r1, :], -math.inf)
        m = s.detach().amax(dim=-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        denom = p.sum(dim=-1, keepdim=True)
        empty = denom.detach().squeeze(-1) == 0
        denom = denom.clamp_min(torch.finfo(cdt).tiny)  # empty rows: no 0, nor a NaN gradient
        p = p / denom
        with torch.set_grad_enabled(sinks_lse and torch.is_grad_enabled()):
            lse = (m + denom.log()).squeeze(-1)
            lse = torch.where(empty, torch.full_like(lse, math.inf), lse)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p, training=True)
        o = torch.matmul(p.reshape(b, hk, g, r1 - r0, sk), vc)
        outs.append(o.reshape(b, h, r1 - r0, v.shape[-1]))
        lses.append(lse if sinks_lse else lse.float())
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def masked_attention(
    qt: Tensor,
    kt: Tensor,
    vt: Tensor,
    *,
    keep: Tensor | None,
    empty: Tensor | None,
    bias_rows: BiasRows | None,
    scale: float,
    softcap: float,
    dropout_p: float,
    need_lse: bool,
    explicit: bool = False,
    sinks_lse: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Attention on (B, H, S, D) with a keep-mask, its empty rows and an optional bias.

    SDPA where it can express the call, the explicit path for softcap, the lse, or where the
    caller asks for it (``explicit``: a reproducible backward SDPA would not give).
    """
    if softcap > 0 or need_lse or explicit:
        out, lse = explicit_attention(
            qt,
            kt,
            vt,
            scale=scale,
            keep=keep,
            softcap=softcap,
            bias_rows=bias_rows,
            dropout_p=dropout_p,
            sinks_lse=sinks_lse,
        )
        return out, (lse if need_lse else None)
    if bias_rows is None:
        return sdpa_bool_masked(qt, kt, vt, keep, None, dropout_p, scale, empty), None
    # The bias is kept in float32 as flash-attn does; half inputs are upcast for the call.
    bias = bias_rows(0, qt.shape[2], torch.float32)
    dtype = qt.dtype
    if dtype in HALF_DTYPES:
        qt, kt, vt = qt.float(), kt.float(), vt.float()
    return sdpa_bool_masked(qt, kt, vt, keep, bias, dropout_p, scale, empty).to(dtype), None


def compiling() -> bool:
    """True while torch.compile traces (a static fact within one trace)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False
