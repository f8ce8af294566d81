"""Stand-in implementations of flash-attn 2.x and xformers attention on torch SDPA.

attnguard uses these when the real kernel cannot run (CPU tensors, flash-attn missing or
broken, xformers ops not loadable): each function takes exactly the arguments of the function
it mirrors and returns the same shapes, computed with
``torch.nn.functional.scaled_dot_product_attention`` (SDPA) where possible.

Conventions kept from the real kernels:

* flash-attn: layout ``(batch, seqlen, nheads, headdim)``; varlen ``(total, nheads, headdim)``
  with int32 ``cu_seqlens`` and no attention across sequences; GQA/MQA when k/v have fewer
  heads; causal masks and sliding windows are aligned to the bottom-right corner (query ``i``
  sees keys ``j <= i + seqlen_k - seqlen_q``), window values normalised as flash-attn's C++
  entry points do; rows with no visible key give zeros; ``softcap > 0`` computes
  ``softcap * tanh(scores * scale / softcap)``; ALiBi adds ``-slope * |i + Sk - Sq - j|``
  after scaling and softcapping; dropout is applied whenever ``dropout_p > 0``.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: ``softmax_lse`` is float32,
  ``(batch, nheads, seqlen_q)`` (varlen: ``(nheads, total_q)``), ``+inf`` for fully masked
  rows like flash-attn; the third item (flash-attn's debug ``S_dmask``, which is empty unless
  dropout is on) is always ``None``. With causal ALiBi, flash-attn's own kernel drops the
  row-constant part of the bias, so its lse differs from ours by that constant; ``out`` agrees.
* ``deterministic`` is accepted and ignored (the forward pass is deterministic anyway).
* ``torch.compile(fullgraph=True)`` traces every function as one graph: mask decisions are
  made from shapes and window values, never from tensor values. ``flash_attn_varlen_func``
  reads ``cu_seqlens`` on the host in eager calls; under compile it switches to a padded-batch
  formulation that needs ``max_seqlen_q/k`` to bound the lengths, as flash-attn does. Block-
  diagonal xformers biases carry their lengths as Python lists: one graph per distinct list.
* xformers: layouts ``[B, M, K]``, ``[B, M, H, K]`` and ``[B, M, G, H, K]``; ``attn_bias`` may be
  ``None``, an additive tensor, or any ``xformers.ops.fmha.attn_bias`` object (recognised by
  duck typing; xformers is never imported here). Note that xformers' ``LowerTriangularMask``
  is aligned top-left (query ``i`` sees keys ``j <= i``) unlike flash-attn's causal mask.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "FLASH_FUNCTIONS",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "xformers_memory_efficient_attention",
]

Tensor = torch.Tensor
FlashResult = Tensor | tuple[Tensor, Tensor, None]

# Largest number of score elements the explicit (non-SDPA) path materialises at once; longer
# inputs are processed in blocks of query rows.
_MANUAL_CHUNK_ELEMS = 1 << 25
_HALF_DTYPES = (torch.float16, torch.bfloat16)


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
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)
    except (TypeError, RuntimeError):  # torch < 2.5, or no backend takes GQA with this input
        rep = hq // hk
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def _sdpa(
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
        if q.dtype not in _HALF_DTYPES:
            raise
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.float()
    out = _sdpa_heads(q.float(), k.float(), v.float(), attn_mask, dropout_p, is_causal, scale)
    return out.to(q.dtype)


def _sdpa_bool_masked(
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
    out = _sdpa(q, k, v, attn_mask, dropout_p, False, scale)
    if empty is not None:
        out = out.masked_fill(empty.unsqueeze(-1), 0.0)
    return out


# --------------------------------------------------------------------------------------------
# flash-attn semantics
# --------------------------------------------------------------------------------------------


def _normalize_window(window_size: Sequence[int], causal: bool, seqlen_k: int) -> tuple[int, int]:
    """Window (left, right) as flash-attn's mha_fwd / set_params_fprop normalise it."""
    left, right = int(window_size[0]), int(window_size[1])
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def _band_mask(
    sq: int, sk: int, offset: int, left: int, right: int, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Keep-mask for query ``i`` seeing keys ``i + offset - left <= j <= i + offset + right``.

    A negative ``left``/``right`` leaves that side open. Returns ``(keep, empty)``: the (Sq, Sk)
    bool keep-mask, None when every key is visible to every query, and the (Sq,) bool mask of
    rows that see no key, None when there are none. Both decisions are made from the Python
    ints alone, never from tensor values, so they are static under ``torch.compile`` (a host
    read such as ``bool(keep.all())`` would break the graph). Needs ``sq, sk >= 1``.
    """
    # Row i sees keys [max(0, i + offset - left), min(sk - 1, i + offset + right)]; the last
    # row has the largest lower bound and row 0 the smallest upper bound.
    lower_open = left < 0 or sq - 1 + offset - left <= 0
    upper_open = right < 0 or offset + right >= sk - 1
    if lower_open and upper_open:
        return None, None
    i = torch.arange(sq, device=device).unsqueeze(1) + offset
    j = torch.arange(sk, device=device).unsqueeze(0)
    keep: Tensor | None = None
    if not lower_open:
        keep = j >= i - left
    if not upper_open:
        below = j <= i + right
        keep = below if keep is None else keep & below
    assert keep is not None
    # Rows [first_seen, end_seen) see at least one key: the upper bound must reach key 0 and
    # the lower bound must stay within key sk - 1 (with both bounds set, lower <= upper).
    first_seen = max(0, -(offset + right)) if right >= 0 else 0
    end_seen = min(sq, sk - offset + left) if left >= 0 else sq
    if first_seen == 0 and end_seen >= sq:
        return keep, None
    r = torch.arange(sq, device=device)
    return keep, (r < first_seen) | (r >= end_seen)


def _padded_band(
    len_q: Tensor, len_k: Tensor, sq: int, sk: int, left: int, right: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Masks for a padded batch of sequences with their own lengths (bottom-right aligned).

    Returns keep (B, 1, Sq, Sk): key ``j < len_k[b]`` inside the (left, right) window of query
    ``i`` aligned to sequence ``b``'s lengths; empty (B, 1, Sq): rows with no visible key;
    rel (B, 1, Sq, Sk): ``i + len_k[b] - len_q[b] - j`` (for ALiBi). All tensor ops: the
    lengths are data, not shapes.
    """
    dev = len_q.device
    i = torch.arange(sq, device=dev).view(1, sq, 1) + (len_k - len_q).view(-1, 1, 1)
    j = torch.arange(sk, device=dev).view(1, 1, sk)
    rel = i - j
    keep = (j < len_k.view(-1, 1, 1)).expand(-1, sq, -1)
    if left >= 0:
        keep = keep & (rel <= left)
    if right >= 0:
        keep = keep & (rel >= -right)
    keep = keep.unsqueeze(1)
    return keep, ~keep.any(dim=-1), rel.unsqueeze(1)


def _alibi_bias(
    slopes: Tensor, row0: int, row1: int, sq: int, sk: int, dtype: torch.dtype
) -> Tensor:
    """ALiBi bias -slope * |i + Sk - Sq - j| for query rows [row0, row1): (B|1, H, rows, Sk)."""
    slopes = slopes.to(dtype)
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0)
    i = torch.arange(row0, row1, device=slopes.device, dtype=dtype).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=slopes.device, dtype=dtype).unsqueeze(0)
    return -slopes[:, :, None, None] * (i - j).abs()


_BiasRows = Callable[[int, int, torch.dtype], Tensor]


def _explicit_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    keep: Tensor | None,
    softcap: float,
    bias_rows: _BiasRows | None,
    dropout_p: float,
) -> tuple[Tensor, Tensor]:
    """Explicit softmax attention on (B, H, S, D) in float32 (float64 stays float64).

    Used where SDPA cannot express the computation (softcap) or the lse is wanted. ``keep`` is
    a bool mask broadcastable to (B, H, Sq, Sk); ``bias_rows(r0, r1, dtype)`` gives the additive
    bias of query rows [r0, r1), broadcastable to (B, H, r1 - r0, Sk). Returns (out in the
    input dtype, float32 lse of shape (B, H, Sq) with +inf for empty rows).
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
        p = p / denom.clamp_min(torch.finfo(cdt).tiny)
        with torch.no_grad():
            lse = (m + denom.log()).squeeze(-1)
            lse = torch.where(denom.squeeze(-1) == 0, torch.full_like(lse, math.inf), lse)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p, training=True)
        o = torch.matmul(p.reshape(b, hk, g, r1 - r0, sk), vc)
        outs.append(o.reshape(b, h, r1 - r0, v.shape[-1]))
        lses.append(lse.float())
    return torch.cat(outs, dim=2).to(q.dtype), torch.cat(lses, dim=2)


def _masked_attention(
    qt: Tensor,
    kt: Tensor,
    vt: Tensor,
    *,
    keep: Tensor | None,
    empty: Tensor | None,
    bias_rows: _BiasRows | None,
    scale: float,
    softcap: float,
    dropout_p: float,
    need_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """Attention on (B, H, S, D) with a keep-mask, its empty rows and an optional bias.

    SDPA where it can express the call, the explicit path for softcap or the lse.
    """
    if softcap > 0 or need_lse:
        out, lse = _explicit_attention(
            qt,
            kt,
            vt,
            scale=scale,
            keep=keep,
            softcap=softcap,
            bias_rows=bias_rows,
            dropout_p=dropout_p,
        )
        return out, (lse if need_lse else None)
    if bias_rows is None:
        return _sdpa_bool_masked(qt, kt, vt, keep, None, dropout_p, scale, empty), None
    # The bias is kept in float32 as flash-attn does; half inputs are upcast for the call.
    bias = bias_rows(0, qt.shape[2], torch.float32)
    dtype = qt.dtype
    if dtype in _HALF_DTYPES:
        qt, kt, vt = qt.float(), kt.float(), vt.float()
    return _sdpa_bool_masked(qt, kt, vt, keep, bias, dropout_p, scale, empty).to(dtype), None


def _flash_core(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    dropout_p: float,
    softmax_scale: float | None,
    window: tuple[int, int],
    softcap: float,
    alibi_slopes: Tensor | None,
    need_lse: bool,
    lens: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """flash-attn forward on (B, Sq, H, D) / (B, Sk, Hk, D) with an already normalised window.

    ``lens`` = (len_q, len_k), int64 (B,) tensors, marks a padded batch: sequence ``b`` holds
    only its first len_q[b] queries and len_k[b] keys, its mask is aligned to its own lengths
    and the output rows past len_q[b] are meaningless.
    """
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if k.shape[2] != v.shape[2] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"number of heads in key/value ({hk}) must divide query heads ({h})")
    if k.dtype != q.dtype:
        k = k.to(q.dtype)
    if v.dtype != q.dtype:
        v = v.to(q.dtype)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window
    if sq == 0 or sk == 0:
        out = q.new_zeros(b, sq, h, v.shape[-1])
        lse = torch.full((b, h, sq), math.inf, dtype=torch.float32, device=q.device)
        return out, (lse if need_lse else None)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    plain = softcap <= 0 and not need_lse and alibi_slopes is None
    if lens is None and plain and left < 0 and right == 0 and sq == sk:
        out = _sdpa(qt, kt, vt, None, dropout_p, True, scale)
        return out.transpose(1, 2).contiguous(), None
    bias_rows: _BiasRows | None = None
    if lens is None:
        keep, empty = _band_mask(sq, sk, sk - sq, left, right, q.device)
        if alibi_slopes is not None:
            slopes = alibi_slopes.to(q.device)

            def bias_rows(r0: int, r1: int, dtype: torch.dtype) -> Tensor:
                return _alibi_bias(slopes, r0, r1, sq, sk, dtype)

    else:
        keep, empty, rel = _padded_band(lens[0], lens[1], sq, sk, left, right)
        if alibi_slopes is not None:
            slopes4 = alibi_slopes.to(q.device).reshape(-1, h, 1, 1)

            def bias_rows(r0: int, r1: int, dtype: torch.dtype) -> Tensor:
                return -slopes4.to(dtype) * rel[..., r0:r1, :].abs().to(dtype)

    out, lse = _masked_attention(
        qt,
        kt,
        vt,
        keep=keep,
        empty=empty,
        bias_rows=bias_rows,
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        need_lse=need_lse,
    )
    return out.transpose(1, 2).contiguous(), lse


def _check_alibi(alibi_slopes: Tensor | None, batch: int, nheads: int) -> None:
    if alibi_slopes is None:
        return
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
            f"got {tuple(alibi_slopes.shape)}"
        )


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> FlashResult:
    """SDPA stand-in for ``flash_attn.flash_attn_func`` (flash-attn 2.x)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("flash_attn_func expects q, k, v of shape (batch, seqlen, nheads, dim)")
    _check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    window = _normalize_window(window_size, causal, k.shape[1])
    out, lse = _flash_core(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        need_lse=return_attn_probs,
    )
    if return_attn_probs:
        assert lse is not None
        return out, lse, None
    return out


def flash_attn_qkvpacked_func(
    qkv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> FlashResult:
    """SDPA stand-in for ``flash_attn.flash_attn_qkvpacked_func`` (flash-attn 2.x)."""
    if qkv.dim() != 5 or qkv.shape[2] != 3:
        raise ValueError("qkv must have shape (batch, seqlen, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_kvpacked_func(
    q: Tensor,
    kv: Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> FlashResult:
    """SDPA stand-in for ``flash_attn.flash_attn_kvpacked_func`` (flash-attn 2.x)."""
    if kv.dim() != 5 or kv.shape[2] != 2:
        raise ValueError("kv must have shape (batch, seqlen_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


_Attend = Callable[[Tensor, Tensor, Tensor, list[int]], tuple[Tensor, Tensor | None]]


def _run_segments(
    q: Tensor,
    q_starts: Sequence[int],
    k_lens: Sequence[int],
    get_kv: Callable[[int], tuple[Tensor, Tensor]],
    attend: _Attend,
    need_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """Attention over packed (total, H, D) segments, batching segments of equal lengths.

    ``q_starts`` has one more entry than there are segments; ``get_kv(i)`` returns the
    (len_k_i, Hk, D) keys/values of segment ``i``. Tokens outside all segments get zeros (lse
    +inf). Returns (out (total_q, H, Dv), lse (H, total_q) float32 or None).
    """
    nseg = len(q_starts) - 1
    h = q.shape[1]
    groups: dict[tuple[int, int], list[int]] = {}
    for i in range(nseg):
        lq = q_starts[i + 1] - q_starts[i]
        if lq < 0:
            raise ValueError("cu_seqlens must be non-decreasing")
        groups.setdefault((lq, k_lens[i]), []).append(i)
    outs: list[Tensor | None] = [None] * nseg
    lses: list[Tensor | None] = [None] * nseg
    dv: int | None = None
    for (lq, _lk), idx in groups.items():
        kvs = [get_kv(i) for i in idx]
        if len(idx) == 1:
            qb = q[q_starts[idx[0]] : q_starts[idx[0]] + lq].unsqueeze(0)
            kb, vb = kvs[0][0].unsqueeze(0), kvs[0][1].unsqueeze(0)
        else:
            qb = torch.stack([q[q_starts[i] : q_starts[i] + lq] for i in idx])
            kb = torch.stack([kv[0] for kv in kvs])
            vb = torch.stack([kv[1] for kv in kvs])
        o, lse = attend(qb, kb, vb, idx)
        dv = o.shape[-1]
        for n, i in enumerate(idx):
            outs[i] = o[n]
            if need_lse and lse is not None:
                lses[i] = lse[n]
    if dv is None:
        dv = q.shape[-1]
    total = q.shape[0]

    def _pad_out(n: int) -> Tensor:
        return q.new_zeros(n, h, dv)

    def _pad_lse(n: int) -> Tensor:
        return torch.full((h, n), math.inf, dtype=torch.float32, device=q.device)

    start, end = (q_starts[0], q_starts[-1]) if nseg > 0 else (0, 0)
    out_parts: list[Tensor] = [_pad_out(start)] if start > 0 else []
    out_parts += [o for o in outs if o is not None]
    if end < total:
        out_parts.append(_pad_out(total - end))
    out = torch.cat(out_parts, dim=0) if out_parts else _pad_out(0)
    if not need_lse:
        return out, None
    lse_parts: list[Tensor] = [_pad_lse(start)] if start > 0 else []
    lse_parts += [x for x in lses if x is not None]
    if end < total:
        lse_parts.append(_pad_lse(total - end))
    return out, (torch.cat(lse_parts, dim=1) if lse_parts else _pad_lse(0))


def _compiling() -> bool:
    """True while torch.compile traces (a static fact within one trace)."""
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling()) if is_compiling is not None else False


def _seqlen_bound(value: int | Tensor, bound: int) -> int:
    """``max_seqlen`` as an int; under compile a tensor (a data value) becomes ``bound``.

    A bound at least the true maximum pads and masks the same; only a sliding window over a
    sequence with more queries than keys can differ, as flash-attn normalises windows against
    the exact ``max_seqlen_k``.
    """
    if isinstance(value, torch.Tensor) and _compiling():
        return bound
    return int(value)


def _varlen_padded(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor,
    cu_k: Tensor,
    max_q: int | Tensor,
    max_k: int | Tensor,
    block_table: Tensor | None,
    window_size: tuple[int, int],
    causal: bool,
    **core: Any,
) -> tuple[Tensor, Tensor | None]:
    """Varlen attention that never reads ``cu_seqlens`` on the host, for torch.compile.

    The eager path splits the packed tensors at the ``cu_seqlens`` values, which are data:
    under torch.compile each read is a graph break (an error with ``fullgraph=True``). Here
    every sequence is gathered into a (nseq, max_seqlen, ...) padded batch with index tensors,
    attended with per-sequence masks and gathered back, so only shapes decide the graph. As in
    flash-attn, ``max_seqlen_q/k`` must bound the lengths (longer sequences are cut there; a
    tensor ``max_seqlen`` is replaced by the packed length). Cost is O(nseq * max_q * max_k)
    like a padded batch, where the eager path pays only for the real lengths.
    """
    total_q, h = q.shape[0], q.shape[1]
    nseq = cu_q.shape[0] - 1
    dev = q.device
    cu_q = cu_q.to(device=dev, dtype=torch.long)
    cu_k = cu_k.to(device=dev, dtype=torch.long)
    len_q, len_k = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    mq = min(_seqlen_bound(max_q, total_q), total_q)
    if nseq <= 0 or mq <= 0:
        out = q.new_zeros(total_q, h, v.shape[-1])
        lse = torch.full((h, total_q), math.inf, dtype=torch.float32, device=dev)
        return out, (lse if core["need_lse"] else None)
    pos_q = torch.arange(mq, device=dev)
    qp = q[(cu_q[:-1, None] + pos_q).clamp(0, total_q - 1)]
    if block_table is None:
        total_k = k.shape[0]
        seqlen_k = _seqlen_bound(max_k, total_k)
        mk = min(seqlen_k, total_k)
        idx_k = (cu_k[:-1, None] + torch.arange(mk, device=dev)).clamp(0, max(total_k - 1, 0))
        kp, vp = k[idx_k], v[idx_k]
    else:
        table = block_table.to(device=k.device, dtype=torch.long)
        kp, vp = k[table].flatten(1, 2), v[table].flatten(1, 2)
        seqlen_k = _seqlen_bound(max_k, kp.shape[1])
        mk = min(seqlen_k, kp.shape[1])
        kp, vp = kp[:, :mk], vp[:, :mk]
    window = _normalize_window(window_size, causal, seqlen_k)
    out_p, lse_p = _flash_core(qp, kp, vp, window=window, lens=(len_q, len_k), **core)
    # Packed token t belongs to the last sequence starting at or before it; tokens before the
    # first or after the last sequence (or past max_seqlen_q) give zeros, lse +inf.
    t = torch.arange(total_q, device=dev)
    seg = torch.searchsorted(cu_q, t, right=True) - 1
    seg_c = seg.clamp(0, nseq - 1)
    pos = t - cu_q[seg_c]
    valid = (seg >= 0) & (seg < nseq) & (pos < mq)
    pos_c = pos.clamp(0, mq - 1)
    out = torch.where(valid[:, None, None], out_p[seg_c, pos_c], 0.0)
    if lse_p is None:
        return out, None
    return out, torch.where(valid, lse_p[seg_c, :, pos_c].transpose(0, 1), math.inf)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Tensor | None = None,
) -> FlashResult:
    """SDPA stand-in for ``flash_attn.flash_attn_varlen_func`` (flash-attn 2.x).

    Eager calls attend each sequence on its own (batching sequences of equal lengths); under
    torch.compile a padded-batch formulation keeps the graph whole (see ``_varlen_padded``).
    """
    if q.dim() != 3:
        raise ValueError("flash_attn_varlen_func expects q of shape (total_q, nheads, headdim)")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
    nseq = cu_seqlens_q.shape[0] - 1
    _check_alibi(alibi_slopes, nseq, q.shape[1])
    if block_table is None and k.dim() != 3:
        raise ValueError("k/v must have shape (total_k, nheads_k, headdim)")
    if block_table is not None and k.dim() != 4:
        raise ValueError("paged k/v must have shape (num_blocks, block_size, nheads_k, dim)")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    core: dict[str, Any] = {
        "dropout_p": dropout_p,
        "softmax_scale": scale,
        "softcap": softcap,
        "need_lse": return_attn_probs,
    }

    if _compiling():
        out, lse = _varlen_padded(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            block_table,
            window_size,
            causal,
            alibi_slopes=alibi_slopes,
            **core,
        )
    else:
        out, lse = _varlen_segments(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            block_table,
            _normalize_window(window_size, causal, int(max_seqlen_k)),
            alibi_slopes,
            core,
        )
    if return_attn_probs:
        assert lse is not None
        return out, lse, None
    return out


def _varlen_segments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    block_table: Tensor | None,
    window: tuple[int, int],
    alibi_slopes: Tensor | None,
    core: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    """Eager varlen: read ``cu_seqlens`` on the host and attend each sequence on its own."""
    cu_q = [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k.tolist()]
    k_lens = [cu_k[i + 1] - cu_k[i] for i in range(len(cu_q) - 1)]

    if block_table is None:

        def get_kv(i: int) -> tuple[Tensor, Tensor]:
            return k[cu_k[i] : cu_k[i + 1]], v[cu_k[i] : cu_k[i + 1]]

    else:
        table = block_table.to(device=k.device, dtype=torch.long)

        def get_kv(i: int) -> tuple[Tensor, Tensor]:
            kp = k[table[i]].flatten(0, 1)[: k_lens[i]]
            vp = v[table[i]].flatten(0, 1)[: k_lens[i]]
            return kp, vp

    def attend(qb: Tensor, kb: Tensor, vb: Tensor, idx: list[int]) -> tuple[Tensor, Tensor | None]:
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[torch.tensor(idx, device=slopes.device)]
        return _flash_core(qb, kb, vb, window=window, alibi_slopes=slopes, **core)

    return _run_segments(q, cu_q, k_lens, get_kv, attend, core["need_lse"])


FLASH_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "flash_attn_func": flash_attn_func,
    "flash_attn_varlen_func": flash_attn_varlen_func,
    "flash_attn_qkvpacked_func": flash_attn_qkvpacked_func,
    "flash_attn_kvpacked_func": flash_attn_kvpacked_func,
}


# --------------------------------------------------------------------------------------------
# xformers semantics
# --------------------------------------------------------------------------------------------

_BLOCK_DIAGONAL_KINDS = {
    "BlockDiagonalMask": "none",
    "BlockDiagonalCausalMask": "top_left",
    "BlockDiagonalCausalFromBottomRightMask": "bottom_right",
}


def _causal_sdpa(q: Tensor, k: Tensor, v: Tensor, offset: int, p: float, scale: float) -> Tensor:
    """Causal SDPA on (B, H, S, D), query i seeing keys j <= i + offset."""
    sq, sk = q.shape[2], k.shape[2]
    if offset == 0 and sq == sk:
        return _sdpa(q, k, v, None, p, True, scale)
    keep, empty = _band_mask(sq, sk, offset, -1, 0, q.device)
    return _sdpa_bool_masked(q, k, v, keep, None, p, scale, empty)


def _xf_block_diagonal(
    q: Tensor, k: Tensor, v: Tensor, bias: Any, kind: str, p: float, scale: float
) -> Tensor:
    """Block-diagonal xformers biases, one SDPA call per group of equal-length blocks.

    q/k/v are (1, M, H, D); returns (1, Mq, H, Dv).
    """
    if q.shape[0] != 1:
        raise ValueError("block-diagonal attn_bias expects batch size 1")
    q_starts = [int(x) for x in bias.q_seqinfo.seqstart_py]
    k_starts = [int(x) for x in bias.k_seqinfo.seqstart_py]
    k_lens = [k_starts[i + 1] - k_starts[i] for i in range(len(k_starts) - 1)]
    k0, v0 = k[0], v[0]

    def get_kv(i: int) -> tuple[Tensor, Tensor]:
        return k0[k_starts[i] : k_starts[i + 1]], v0[k_starts[i] : k_starts[i + 1]]

    def attend(qb: Tensor, kb: Tensor, vb: Tensor, idx: list[int]) -> tuple[Tensor, None]:
        qt, kt, vt = qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2)
        if qt.shape[2] == 0:
            return qb.new_zeros(qb.shape[0], 0, qb.shape[2], vb.shape[-1]), None
        if kt.shape[2] == 0:
            return qb.new_zeros(*qb.shape[:3], vb.shape[-1]), None
        if kind == "none":
            out = _sdpa(qt, kt, vt, None, p, False, scale)
        else:
            offset = 0 if kind == "top_left" else kt.shape[2] - qt.shape[2]
            out = _causal_sdpa(qt, kt, vt, offset, p, scale)
        return out.transpose(1, 2), None

    out, _ = _run_segments(q[0], q_starts, k_lens, get_kv, attend, False)
    return out.unsqueeze(0)


def _xf_tensor_bias(bias: Tensor, ndim: int, b: int, g: int, h: int, mq: int, mk: int) -> Tensor:
    """Bring an additive tensor bias given in the caller's layout to (B|1, G*H|1, Mq, Mk)."""
    if ndim == 3:
        # [B, Mq, Mk] (or broadcastable) for [B, M, K] inputs.
        return bias.unsqueeze(-3) if bias.dim() >= 3 else bias
    if ndim == 4:
        # (B*H, Mq, Mk) is accepted too; plain broadcasting would read B*H as heads.
        if bias.dim() == 3 and bias.shape[0] == b * h and b > 1:
            return bias.reshape(b, h, bias.shape[-2], bias.shape[-1])
        return bias
    # 5D: [B, G, H, Mq, Mk] (or broadcastable).
    while bias.dim() < 5:
        bias = bias.unsqueeze(0)
    return bias.expand(b, g, h, mq, mk).flatten(1, 2)


def _xf_materialize(bias: Any, ndim: int, b: int, g: int, h: int, mq: int, mk: int, q: Tensor):
    """Materialise an xformers AttentionBias to an additive (B|1, G*H|1, Mq, Mk) tensor."""
    if ndim == 3:
        shape: tuple[int, ...] = (b, mq, mk)
    elif ndim == 4:
        shape = (b, h, mq, mk)
    else:
        shape = (b, g, h, mq, mk)
    mask = bias.materialize(shape, dtype=q.dtype, device=q.device)
    if mask.shape[-1] < mk:  # e.g. paged biases cover only the used pages
        pad = mask.new_full((*mask.shape[:-1], mk - mask.shape[-1]), -math.inf)
        mask = torch.cat([mask, pad], dim=-1)
    if ndim == 3:
        mask = mask.unsqueeze(-3)
    elif ndim == 5:
        mask = mask.flatten(1, 2)
    return mask


def xformers_memory_efficient_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Any = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: Any = None,
    output_dtype: torch.dtype | None = None,
) -> Tensor:
    """SDPA stand-in for ``xformers.ops.memory_efficient_attention``."""
    ndim = query.dim()
    if ndim not in (3, 4, 5) or key.dim() != ndim or value.dim() != ndim:
        raise ValueError(
            "query/key/value must all be [B, M, K], [B, M, H, K] or [B, M, G, H, K]; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.dtype != query.dtype:
        key = key.to(query.dtype)
    if value.dtype != query.dtype:
        value = value.to(query.dtype)
    b, mq = query.shape[:2]
    mk = key.shape[1]
    g, h = 1, 1
    if ndim == 3:
        q4, k4, v4 = query.unsqueeze(2), key.unsqueeze(2), value.unsqueeze(2)
    elif ndim == 4:
        h = query.shape[2]
        q4, k4, v4 = query, key, value
        if h > 1 and key.stride(2) == 0 and value.stride(2) == 0:  # MQA via expand()
            k4, v4 = key[:, :, :1], value[:, :, :1]
    else:
        g, h = query.shape[2], query.shape[3]
        q4 = query.flatten(2, 3)
        if h > 1 and key.stride(3) == 0 and value.stride(3) == 0:  # GQA via expand()
            k4, v4 = key[:, :, :, 0], value[:, :, :, 0]
        else:
            k4, v4 = key.flatten(2, 3), value.flatten(2, 3)
    sc = query.shape[-1] ** -0.5 if scale is None else float(scale)
    qt, kt, vt = q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2)

    name = type(attn_bias).__name__
    if attn_bias is None:
        out = _sdpa(qt, kt, vt, None, p, False, sc).transpose(1, 2)
    elif isinstance(attn_bias, torch.Tensor):
        mask = _xf_tensor_bias(attn_bias, ndim, b, g, h, mq, mk)
        if mask.dtype != torch.bool:
            mask = mask.to(query.dtype)
        out = _sdpa(qt, kt, vt, mask, p, False, sc).transpose(1, 2)
    elif not hasattr(attn_bias, "materialize"):
        raise TypeError(f"unsupported attn_bias type: {type(attn_bias)!r}")
    elif name == "LowerTriangularMask":
        out = _causal_sdpa(qt, kt, vt, 0, p, sc).transpose(1, 2)
    elif name == "LowerTriangularFromBottomRightMask":
        out = _causal_sdpa(qt, kt, vt, mk - mq, p, sc).transpose(1, 2)
    elif name in _BLOCK_DIAGONAL_KINDS and hasattr(attn_bias, "q_seqinfo"):
        kind = _BLOCK_DIAGONAL_KINDS[name]
        out = _xf_block_diagonal(q4, k4, v4, attn_bias, kind, p, sc)
    else:
        mask = _xf_materialize(attn_bias, ndim, b, g, h, mq, mk, query)
        # Rows the bias masks entirely give zeros: unmask them for a finite softmax, then zero
        # their output. Done unconditionally with tensor ops (the rows depend on the bias's
        # values, and a host-side check would break torch.compile graphs).
        empty = torch.isneginf(mask).all(dim=-1, keepdim=True)
        mask = mask.masked_fill(empty, 0.0)
        out = _sdpa(qt, kt, vt, mask, p, False, sc).masked_fill(empty, 0.0)
        out = out.transpose(1, 2)

    if ndim == 3:
        out = out.squeeze(2)
    elif ndim == 5:
        out = out.unflatten(2, (g, h))
    out = out.contiguous()
    if output_dtype is not None:
        out = out.to(output_dtype)
    return out
