"""Twins of flash-attn's varlen functions (packed rows: ``(total, H, D)`` with ``cu_seqlens``):
``flash_attn_varlen_func`` and its qkv/kv-packed variants.

Which torch kernel computes a call is decided in :mod:`attnguard.fallback.routes`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import attention_sinks, routes, torch_flash
from .dense import FlashResult, check_dtypes, flash_core
from .masks import WindowRule, check_alibi, fa2_rule, kernel_band
from .sdpa import compiling

Tensor = torch.Tensor

_Attend = Callable[[Tensor, Tensor, Tensor, list[int]], tuple[Tensor, Tensor | None]]


def run_segments(
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
        key = (lq, k_lens[i])
        if key not in groups:  # not dict.setdefault: torch 2.4 cannot trace it (a graph break)
            groups[key] = []
        groups[key].append(i)
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


def _seqlen_bound(value: int | Tensor, bound: int) -> int:
    """``max_seqlen`` as an int; under compile a tensor (a data value) becomes ``bound``.

    A bound at least the true maximum pads and masks the same; only a sliding window over a
    sequence with more queries than keys can differ, as flash-attn normalises windows against
    the exact ``max_seqlen_k``.
    """
    if isinstance(value, torch.Tensor) and compiling():
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
    rule: WindowRule,
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
    window = rule(window_size, causal, _seqlen_bound(max_q, total_q), seqlen_k)
    out_p, lse_p = flash_core(qp, kp, vp, window=window, lens=(len_q, len_k), **core)
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
    s_aux: Tensor | None = None,
) -> FlashResult:
    """SDPA stand-in for ``flash_attn.flash_attn_varlen_func`` (flash-attn 2.x).

    Where torch's flash kernel can run, one call of it computes the packed rows (nothing read
    on the host). Elsewhere eager calls attend each sequence on its own (batching sequences of
    equal lengths) and under torch.compile a padded-batch formulation keeps the graph whole
    (see ``_varlen_padded``). :mod:`attnguard.fallback.routes` says which, and why. ``s_aux``:
    attention sinks, one logit per query head (:mod:`.attention_sinks`).
    """
    out, lse = varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        rule=fa2_rule,
        window_size=window_size,
        causal=causal,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        deterministic=deterministic,
        need_lse=return_attn_probs,
        block_table=block_table,
        s_aux=s_aux,
    )
    if return_attn_probs:
        assert lse is not None
        return out, lse, None
    return out


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | Tensor,
    max_seqlen_k: int | Tensor,
    *,
    rule: WindowRule,
    window_size: Sequence[int],
    causal: bool,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    softcap: float = 0.0,
    alibi_slopes: Tensor | None = None,
    deterministic: bool = False,
    need_lse: bool = False,
    block_table: Tensor | None = None,
    s_aux: Tensor | None = None,
    lse_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Packed-row attention with the window ``rule`` of the family whose twin calls it (applied
    to (max_seqlen_q, max_seqlen_k), as the kernels do). Returns (out (total_q, H, Dv), lse
    (H, total_q) float32 with +inf for rows that see no key, or None). ``lse_grad``: the lse
    carries its gradient (then torch's flash kernel, whose lse has none, is not used)."""
    if q.dim() != 3:
        raise ValueError("flash_attn_varlen_func expects q of shape (total_q, nheads, headdim)")
    check_dtypes(q, k, v)
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
    nseq = cu_seqlens_q.shape[0] - 1
    check_alibi(alibi_slopes, nseq, q.shape[1])
    if block_table is None and k.dim() != 3:
        raise ValueError("k/v must have shape (total_k, nheads_k, headdim)")
    if block_table is not None and k.dim() != 4:
        raise ValueError("paged k/v must have shape (num_blocks, block_size, nheads_k, dim)")
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    core: dict[str, Any] = {
        "dropout_p": dropout_p,
        "softmax_scale": scale,
        "softcap": softcap,
        "need_lse": need_lse,
        "deterministic": deterministic,
        "sinks": s_aux,
    }
    if lse_grad:
        core.update(sinks_lse=True, flash_allowed=False)
    attention_sinks.check(s_aux, q.shape[1])

    in_graph = compiling()
    max_q = _seqlen_bound(max_seqlen_q, q.shape[0])
    max_k = _seqlen_bound(max_seqlen_k, k.shape[0])
    window = rule(window_size, causal, max_q, max_k)
    route = routes.varlen(
        flash_ok=not lse_grad
        and not attention_sinks.needs_grad(s_aux, q, k, v)
        and torch_flash.can_run(
            q,
            k,
            v,
            window=torch_flash.windowed(window),
            deterministic=deterministic,
        )
        and kernel_band(window, max_q, max_k),
        softcap=softcap,
        alibi=alibi_slopes is not None,
        paged=block_table is not None,
        compiling=in_graph,
    )
    if route == "varlen-flash":
        out, lse = torch_flash.attention(
            q,
            k,
            v,
            cu_seqlens_q.to(device=q.device, dtype=torch.int32),
            cu_seqlens_k.to(device=q.device, dtype=torch.int32),
            max_q,
            max_k,
            dropout_p=dropout_p,
            scale=scale,
            window=window,
            deterministic=deterministic,
        )
        if s_aux is not None:
            out, lse = attention_sinks.apply(out, lse, s_aux, packed=True)
        return out, (lse if need_lse else None)
    if route == "varlen-compile":
        return _varlen_padded(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            block_table,
            tuple(window_size),
            causal,
            rule,
            alibi_slopes=alibi_slopes,
            **core,
        )
    return _varlen_segments(
        q, k, v, cu_seqlens_q, cu_seqlens_k, block_table, window, alibi_slopes, core
    )


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
    # flash-attn reads past the tensors here (undefined output): say so instead
    if cu_q and cu_q[-1] > q.shape[0]:
        raise ValueError(f"cu_seqlens_q ends at {cu_q[-1]} but q holds {q.shape[0]} tokens")
    if cu_k and block_table is None and cu_k[-1] > k.shape[0]:
        raise ValueError(f"cu_seqlens_k ends at {cu_k[-1]} but k holds {k.shape[0]} tokens")

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
        return flash_core(qb, kb, vb, window=window, alibi_slopes=slopes, **core)

    return run_segments(q, cu_q, k_lens, get_kv, attend, core["need_lse"])


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
