"""Twins of flash-attn 4's functions (flash_attn/cute/interface.py, the CuTe DSL kernels; the
kernel hub's ``kernels-community/flash-attn4``), computed with the torch kernels the flash-attn 2
twins use (:mod:`attnguard.fallback.routes` picks them), under flash-attn 4's rules:

* layout ``(batch, seqlen, nheads, headdim)``, varlen ``(total, nheads, headdim)`` with
  ``cu_seqlens``; grouped k/v heads; ``softcap`` (0 or None: none); masks aligned to the
  bottom-right corner;
* windows as ``_resolve_causal_local_window`` resolves them
  (:func:`attnguard.fallback.masks.fa4_window`): a side of ``None`` is open, causal sets right = 0,
  two ints summing below 0 mean no window, other ints bound the band as given (whatever the
  sequence lengths: an open side stays open);
* no dropout (no ``dropout_p``);
* ``learnable_sink``: one logit per query head joining each row's softmax, taking probability
  mass and adding no value (flash_attn/cute/softmax.py ``finalize``) -- the attention sinks the
  other twins compute as ``s_aux`` (:mod:`.attention_sinks`), gradient included;
* both return ``(out, lse)``: the lse (float32, ``(batch, nheads, seqlen_q)``, varlen ``(nheads,
  total_q)``, -inf for a row that sees no key, the sink's logit with a sink) where an input
  requires grad or ``return_lse=True``, else ``None``; with ``return_lse=True`` it carries its
  gradient, as the kernel's does;
* ``num_splits``, ``pack_gqa`` only tune the kernel; ``max_seqlen_q/k`` size its tiles (here
  they bound the lengths, the packed totals when not given); ``deterministic`` asks for a
  reproducible backward pass.

The positional order is the hub build's (4.0.0.beta8); newer builds add keyword arguments
(``qv``, ``gather_kv_indices``, ``score_mod``, ``mask_mod``, ``aux_tensors``, block sparsity,
...) that these twins take by name. Anything they do not compute -- any of those given, a
negative window side, a value head_dim other than the query's, ``seqused_q/k``, ``page_table``,
a varlen call with only one of ``cu_seqlens_q/k`` -- raises
:class:`~attnguard.fallback.refusal.Uncomputed` naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from .dense import flash_core
from .masks import band_rule, fa4_window
from .refusal import empty_rows_neg_inf, refuse
from .varlen import varlen_attention

Tensor = torch.Tensor
_OPEN: tuple[int | None, int | None] = (None, None)


def _window(window_size: Any, causal: bool, names: list[str]) -> tuple[int, int]:
    window = fa4_window(tuple(window_size), causal)
    if window is None:
        names.append(f"window_size={tuple(window_size)} (a negative side)")
        return -1, -1
    return window


def _checked(q: Tensor, v: Tensor, window_size: Any, causal: bool, **more: Any) -> tuple[int, int]:
    names = [name for name, value in more.items() if value is not None]
    window = _window(window_size, causal, names)
    if v.shape[-1] != q.shape[-1]:
        names.append("a value head_dim other than the query's")
    refuse(names)
    return window


def _lse_wanted(return_lse: bool, *tensors: Tensor | None) -> tuple[bool, bool]:
    """(the lse is returned, it carries its gradient): returned where an input requires grad or
    ``return_lse`` (interface.py ``_flash_attn_fwd``), differentiable with ``return_lse`` only
    (its backward reads ``dlse`` then)."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    return return_lse or grad, return_lse and grad


def _result(out: Tensor, lse: Tensor | None, need: bool) -> tuple[Tensor, Tensor | None]:
    if not need or lse is None:
        return out, None
    return out, empty_rows_neg_inf(lse).float()


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = _OPEN,
    learnable_sink: Tensor | None = None,
    softcap: float | None = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    mask_mod: Any = None,
    full_block_cnt: Tensor | None = None,
    full_block_idx: Tensor | None = None,
    mask_block_cnt: Tensor | None = None,
    mask_block_idx: Tensor | None = None,
    block_size: tuple[int, int] | None = None,
    return_lse: bool = False,
    **other: Any,
) -> tuple[Tensor, Tensor | None]:
    """Twin of flash-attn 4's ``flash_attn_func``: ``(out, lse)``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("flash_attn_func expects q, k, v of shape (batch, seqlen, nheads, dim)")
    window = _checked(
        q,
        v,
        window_size,
        causal,
        mask_mod=mask_mod,
        full_block_cnt=full_block_cnt,
        full_block_idx=full_block_idx,
        mask_block_cnt=mask_block_cnt,
        mask_block_idx=mask_block_idx,
        block_size=block_size,
        **other,
    )
    need, lse_grad = _lse_wanted(return_lse, q, k, v, learnable_sink)
    out, lse = flash_core(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        window=window,
        softcap=softcap or 0.0,
        alibi_slopes=None,
        need_lse=need,
        deterministic=deterministic,
        sinks=learnable_sink,
        sinks_lse=lse_grad,
        flash_allowed=not lse_grad,
    )
    return _result(out, lse, need)


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    page_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = _OPEN,
    learnable_sink: Tensor | None = None,
    softcap: float | None = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    score_mod: Any = None,
    aux_tensors: list[Tensor] | None = None,
    return_lse: bool = False,
    **other: Any,
) -> tuple[Tensor, Tensor | None]:
    """Twin of flash-attn 4's ``flash_attn_varlen_func``: ``(out, lse)``; packed sequences with
    both ``cu_seqlens``, or without either a dense (batch, seqlen, ...) call."""
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        one = "cu_seqlens_q" if cu_seqlens_k is None else "cu_seqlens_k"
        other[f"{one} without the other"] = True
    window = _checked(
        q,
        v,
        window_size,
        causal,
        seqused_q=seqused_q,
        seqused_k=seqused_k,
        page_table=page_table,
        score_mod=score_mod,
        aux_tensors=aux_tensors,
        **other,
    )
    if cu_seqlens_q is None or cu_seqlens_k is None:
        return flash_attn_func(
            q,
            k,
            v,
            softmax_scale=softmax_scale,
            window_size=_band_as_window(window),
            learnable_sink=learnable_sink,
            softcap=softcap,
            deterministic=deterministic,
            return_lse=return_lse,
        )
    need, lse_grad = _lse_wanted(return_lse, q, k, v, learnable_sink)
    out, lse = varlen_attention(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        q.shape[0] if max_seqlen_q is None else max_seqlen_q,
        k.shape[0] if max_seqlen_k is None else max_seqlen_k,
        rule=band_rule,
        window_size=window,
        causal=False,
        softmax_scale=softmax_scale,
        softcap=softcap or 0.0,
        deterministic=deterministic,
        need_lse=need,
        s_aux=learnable_sink,
        lse_grad=lse_grad,
    )
    return _result(out, lse, need)


def _band_as_window(band: tuple[int, int]) -> tuple[int | None, int | None]:
    """A resolved band back in flash-attn 4's spelling (None: open), which resolves to it again
    (non-negative sides never sum below 0)."""
    return (None if band[0] < 0 else band[0], None if band[1] < 0 else band[1])
