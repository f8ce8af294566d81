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
  ``flash_attn_with_kvcache`` keeps its lengths as tensors (appends with ``index_put_``, masks
  per sequence) and traces whole too; ``unpad_input`` reads lengths on the host as flash-attn's
  does and does not.
* ``flash_attn_with_kvcache`` updates ``k_cache``/``v_cache`` in place like the kernel, rotary
  embedding included (rounded to the cache dtype as the kernel rounds it).
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
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "index_first_axis",
    "pad_input",
    "unpad_input",
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


def flash_attn_varlen_qkvpacked_func(
    qkv: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
) -> FlashResult:
    """SDPA stand-in for ``flash_attn.flash_attn_varlen_qkvpacked_func`` (flash-attn 2.x).

    ``qkv`` is (total, 3, nheads, headdim); queries and keys share ``cu_seqlens``.
    """
    if qkv.dim() != 4 or qkv.shape[1] != 3:
        raise ValueError("qkv must have shape (total, 3, nheads, headdim)")
    q, k, v = qkv.unbind(dim=1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_kvpacked_func(
    q: Tensor,
    kv: Tensor,
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
) -> FlashResult:
    """SDPA stand-in for ``flash_attn.flash_attn_varlen_kvpacked_func`` (flash-attn 2.x).

    ``kv`` is (total_k, 2, nheads_k, headdim).
    """
    if kv.dim() != 4 or kv.shape[1] != 2:
        raise ValueError("kv must have shape (total_k, 2, nheads_k, headdim)")
    k, v = kv.unbind(dim=1)
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def _apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding on the first ``2 * cos.shape[-1]`` channels of x (B, S, H, D).

    ``cos``/``sin`` are (B, S, rotary_dim / 2), already gathered at each token's position.
    Interleaved rotates channel pairs (0, 1), (2, 3), ...; otherwise (GPT-NeoX style) channel
    ``c`` with ``c + rotary_dim / 2``. As in flash-attn's kernel the rotation is computed in
    float32 (float64 stays float64) and rounded back to x's dtype; channels past rotary_dim are
    left untouched.
    """
    rd = 2 * cos.shape[-1]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos.to(cdt).unsqueeze(2), sin.to(cdt).unsqueeze(2)
    xr = x[..., :rd].to(cdt)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def _check_kvcache_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    rotary_cos: Tensor | None,
    rotary_sin: Tensor | None,
    cache_seqlens: int | Tensor | None,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    block_table: Tensor | None,
) -> int:
    """flash-attn's argument checks for ``flash_attn_with_kvcache`` (shapes only, so they hold
    under torch.compile). Kernel limits (dtype, head_dim <= 256, page size a multiple of 256,
    rotary_dim a multiple of 16) are not enforced: lifting them is what the twin is for.
    Returns the cache capacity per sequence (flash-attn's ``seqlen_k``).
    """
    if q.dim() != 4:
        raise ValueError("q must have shape (batch_size, seqlen, nheads, headdim)")
    b = q.shape[0]
    if k_cache.dim() != 4 or v_cache.dim() != 4 or k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(
            "k_cache/v_cache must have shape (batch_size_cache, seqlen_cache, nheads_k, headdim) "
            "or (num_blocks, page_block_size, nheads_k, headdim); got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("Paged KVcache does not support cache_batch_idx")
        if cache_leftpad is not None:
            raise ValueError("We don't support Paged KV and leftpad_k running at the same time yet")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(
                f"block_table must have shape ({b}, max_num_blocks_per_seq), "
                f"got {tuple(block_table.shape)}"
            )
        capacity = block_table.shape[1] * k_cache.shape[1]
    else:
        capacity = k_cache.shape[1]
        if cache_batch_idx is None and k_cache.shape[0] < b:
            raise ValueError(
                f"k_cache holds {k_cache.shape[0]} sequences for a batch of {b} "
                "(pass cache_batch_idx to pick cache rows)"
            )
    for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
        if t is not None and tuple(t.shape) != (b,):
            raise ValueError(f"{name} must have shape ({b},), got {tuple(t.shape)}")
    seqlens_shape = tuple(cache_seqlens.shape) if isinstance(cache_seqlens, Tensor) else ()
    if seqlens_shape not in ((), (b,)):
        raise ValueError(f"cache_seqlens must be an int or have shape ({b},), got {seqlens_shape}")
    if (k is None) != (v is None):
        raise ValueError("If key is supplied, value must also be passed in")
    if k is not None:
        assert v is not None
        if cache_seqlens is None:
            raise ValueError("If key is supplied, seqlens_k must also be passed in")
        hk = k_cache.shape[2]
        if (
            k.dim() != 4
            or v.dim() != 4
            or tuple(k.shape[:3]) != (b, k.shape[1], hk)
            or tuple(v.shape[:3]) != tuple(k.shape[:3])
            or k.shape[3] != k_cache.shape[3]
            or v.shape[3] != v_cache.shape[3]
        ):
            raise ValueError(
                f"k/v must have shape ({b}, seqlen_new, {hk}, headdim) matching the cache; got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise ValueError(
                "If rotary cos/sin are provided, new key / value to be appended to KV cache "
                "must also be provided"
            )
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("If rotary cos is provided, rotary sin must also be provided")
        if rotary_cos.dim() != 2 or rotary_sin.shape != rotary_cos.shape:
            raise ValueError("rotary_cos/rotary_sin must both have shape (seqlen_ro, rotary_dim/2)")
        if 2 * rotary_cos.shape[1] > q.shape[3]:
            raise ValueError("rotary_dim must be <= headdim")
        if rotary_cos.shape[0] < capacity:
            raise ValueError("cos/sin seqlen must be at least the seqlen of KV cache")
    return capacity


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """SDPA stand-in for ``flash_attn.flash_attn_with_kvcache`` (flash-attn 2.x).

    As the kernel does: new ``k``/``v`` (rotated first when ``rotary_cos/sin`` are given, at
    positions ``cache_seqlens + t``) are written *in place* into the cache at ``cache_seqlens``
    (cache rows picked by ``cache_batch_idx``, or pages by ``block_table``); ``q`` is rotated at
    ``cache_seqlens + i`` when causal or local, else at ``cache_seqlens`` for every row. Then
    sequence ``b`` attends to its cache keys ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)``
    (the whole cache when ``cache_seqlens`` is None), with the causal mask / window aligned to
    that end, windows normalised against the cache capacity. Returns ``out``, or
    ``(out, softmax_lse)`` with ``return_softmax_lse`` (float32 (batch, nheads, seqlen_q), +inf
    for rows that see no key). ``num_splits`` only tunes the kernel and is ignored.

    Lengths stay tensors throughout (nothing is read on the host), so this traces under
    ``torch.compile(fullgraph=True)``; an int ``cache_seqlens`` is a constant of the graph.
    """
    capacity = _check_kvcache_args(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
    )
    b, sq, h, d = q.shape
    _check_alibi(alibi_slopes, b, h)
    dev, cdev = q.device, k_cache.device
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    window = _normalize_window(window_size, causal, capacity)
    # The kernel rotates q per position exactly when it runs causal or local (window set).
    q_per_position = window[0] >= 0 or window[1] >= 0

    if cache_seqlens is None:
        seqlens = torch.full((b,), capacity, dtype=torch.long, device=dev)
    elif isinstance(cache_seqlens, Tensor):
        seqlens = cache_seqlens.to(device=dev, dtype=torch.long).expand(b)
    else:
        seqlens = torch.full((b,), int(cache_seqlens), dtype=torch.long, device=dev)
    leftpad = None if cache_leftpad is None else cache_leftpad.to(device=dev, dtype=torch.long)
    table = None if block_table is None else block_table.to(device=cdev, dtype=torch.long)
    page = k_cache.shape[1]
    rows: Tensor | None = None
    if table is None:
        if cache_batch_idx is None:
            rows = torch.arange(b, device=cdev)
        else:
            rows = cache_batch_idx.to(device=cdev, dtype=torch.long)

    def cache_index(pos: Tensor) -> tuple[Tensor, Tensor]:
        """(B, N) logical positions -> index tensors into the cache's first two dims."""
        pos = pos.to(cdev)
        if table is None:
            assert rows is not None
            return rows[:, None].expand_as(pos), pos
        return table.gather(1, torch.div(pos, page, rounding_mode="floor")), pos % page

    rotary = rotary_cos is not None and rotary_sin is not None
    last_ro = rotary_cos.shape[0] - 1 if rotary_cos is not None else 0

    def rotate(x: Tensor, pos: Tensor) -> Tensor:
        assert rotary_cos is not None and rotary_sin is not None
        pos = pos.clamp(0, last_ro).to(rotary_cos.device)
        cos, sin = rotary_cos[pos].to(x.device), rotary_sin[pos].to(x.device)
        return _apply_rotary(x, cos, sin, rotary_interleaved)

    seqlen_new = 0
    if k is not None and v is not None:
        seqlen_new = k.shape[1]
        pos_new = seqlens[:, None] + torch.arange(seqlen_new, device=dev)
        if rotary:
            k = rotate(k, pos_new)
        idx = cache_index(pos_new)
        k_cache.index_put_(idx, k.to(device=cdev, dtype=k_cache.dtype))
        v_cache.index_put_(idx, v.to(device=cdev, dtype=v_cache.dtype))
    if rotary:
        # Causal/local: query i sits at cache_seqlens + i; otherwise all at cache_seqlens.
        steps = torch.arange(sq, device=dev) * int(q_per_position)
        q = rotate(q, seqlens[:, None] + steps)

    # Each sequence's keys from its leftpad on, as the kernel reads them: key j of the gathered
    # batch is cache position leftpad + j, and len_k = end - leftpad keys are real. The masks of
    # _flash_core's padded-batch path then align causal/window/ALiBi to that end.
    end = seqlens + seqlen_new
    len_k = end if leftpad is None else end - leftpad
    # Keys past the longest sequence are masked anyway. Eager calls gather only up to it (one
    # host read, as the eager varlen path makes): a decode step on a large, mostly empty cache
    # then costs what its lengths cost. Under compile shapes must not depend on data, so the
    # graph keeps the full capacity.
    span = capacity
    if not _compiling() and b > 0:
        span = max(0, min(capacity, int(len_k.max())))
    if leftpad is None and table is None and cache_batch_idx is None:
        kb, vb = k_cache[:b, :span], v_cache[:b, :span]
    else:
        src = torch.arange(span, device=dev).expand(b, span)
        if leftpad is not None:
            src = (leftpad[:, None] + src).clamp(max=capacity - 1)
        idx = cache_index(src)
        kb, vb = k_cache[idx], v_cache[idx]
    len_q = torch.full((b,), sq, dtype=torch.long, device=dev)
    out, lse = _flash_core(
        q,
        kb.to(dev),
        vb.to(dev),
        dropout_p=0.0,
        softmax_scale=scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        need_lse=return_softmax_lse,
        lens=(len_q, len_k),
    )
    if return_softmax_lse:
        assert lse is not None
        return out, lse
    return out


# --------------------------------------------------------------------------------------------
# flash_attn.bert_padding equivalents (pure torch; flash-attn's own need einops and its package)
# --------------------------------------------------------------------------------------------


def index_first_axis(x: Tensor, indices: Tensor) -> Tensor:
    """``flash_attn.bert_padding.index_first_axis``: rows ``indices`` of x, shape (n, ...).

    Plain indexing: autograd scatters the gradient back as flash-attn's custom Function does.
    """
    if x.dim() < 2:
        raise ValueError(f"index_first_axis expects a tensor of at least 2 dims, got {x.dim()}")
    return x[indices]


def unpad_input(
    hidden_states: Tensor, attention_mask: Tensor, unused_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """``flash_attn.bert_padding.unpad_input`` of flash-attn 2.8.3 (five return values).

    hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) bool/int, 1 = valid;
    unused_mask (batch, seqlen), 1 = allocated but unused (selected too, not counted as used).
    Returns (hidden_states (total_nnz, ...), indices (total_nnz,) into the flattened batch,
    cu_seqlens int32 (batch + 1,), max_seqlen_in_batch int, seqused int32 (batch,): tokens
    selected by attention_mask alone). Reads the lengths on the host (``nonzero`` and ``.item()``),
    as flash-attn does, so it is not traceable in one graph by torch.compile.
    """
    all_masks = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (
        index_first_axis(hidden_states.flatten(0, 1), indices),
        indices,
        cu_seqlens,
        max_seqlen_in_batch,
        used_seqlens_in_batch,
    )


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """``flash_attn.bert_padding.pad_input``: scatter (total_nnz, ...) rows back to
    (batch, seqlen, ...) at ``indices`` of the flattened batch; other positions are zeros.
    """
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.unflatten(0, (batch, seqlen))


FLASH_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "flash_attn_func": flash_attn_func,
    "flash_attn_varlen_func": flash_attn_varlen_func,
    "flash_attn_qkvpacked_func": flash_attn_qkvpacked_func,
    "flash_attn_kvpacked_func": flash_attn_kvpacked_func,
    "flash_attn_varlen_qkvpacked_func": flash_attn_varlen_qkvpacked_func,
    "flash_attn_varlen_kvpacked_func": flash_attn_varlen_kvpacked_func,
    "flash_attn_with_kvcache": flash_attn_with_kvcache,
    # flash_attn.bert_padding
    "index_first_axis": index_first_axis,
    "unpad_input": unpad_input,
    "pad_input": pad_input,
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
