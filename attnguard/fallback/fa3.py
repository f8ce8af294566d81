"""Twins of flash-attn 3's functions (hopper/flash_attn_interface.py; the kernel hub's
``kernels-community/flash-attn3``) and of vLLM's build of them (``kernels-community/
vllm-flash-attn3``, from vllm-project/flash-attention), computed with the torch kernels the
flash-attn 2 twins use (:mod:`attnguard.fallback.routes` picks them), under flash-attn 3's rules:

* layout ``(batch, seqlen, nheads, headdim)``, varlen ``(total, nheads, headdim)`` with
  ``cu_seqlens``, grouped k/v heads, ``softcap``; causal masks and windows aligned to the
  bottom-right corner, query ``i`` seeing keys ``[i + Sk - Sq - left, i + Sk - Sq + right]``;
* windows as hopper/flash_api.cpp normalises them (``mha_fwd`` then ``set_params_fprop``;
  :func:`attnguard.fallback.masks.fa3_window`): a side that reaches past the last key / query
  is open, causal sets right = 0, and an open side stays open -- where flash-attn 2 closes it
  at seqlen_k, so a one-sided window with seqlen_q > seqlen_k + 1 sees more keys here;
* no dropout: the functions take no ``dropout_p`` (so transformers passes none);
* a row that sees no key gives zeros and an lse of -inf (hopper/softmax.h ``finalize``);
* ``flash_attn_func`` / ``flash_attn_varlen_func`` return ``out``, or ``(out, softmax_lse)``
  with ``return_attn_probs=True`` (float32, ``(batch, nheads, seqlen_q)``, varlen ``(nheads,
  total_q)``; no gradient through it, as the kernel's backward takes none);
  ``flash_attn_with_kvcache`` returns ``out``, or ``(out, softmax_lse)`` with
  ``return_softmax_lse=True`` (the kernel adds its split accumulators after them, internal
  scratch the twins have none of);
* vLLM's build: attention sinks ``s_aux`` (one logit per query head joining each row's softmax:
  hopper/softmax.h ``finalize_aux``; :mod:`.attention_sinks`), no ``attention_chunk``, no
  ``return_attn_probs``: ``flash_attn_func`` / ``flash_attn_varlen_func`` always return
  ``(out, softmax_lse)``;
* ``num_splits``, ``pack_gqa``, ``sm_margin``, ``scheduler_metadata`` only tune the kernel;
  ``deterministic`` asks for a reproducible backward pass (as the flash-attn 2 twins keep it).

What these twins do not compute -- ``qv``, the FP8 ``q/k/v_descale``, ``attention_chunk``,
``seqused_q/k``, a value head_dim other than the query's, and in ``flash_attn_with_kvcache``
``cu_seqlens_q``, ``cu_seqlens_k_new``, ``rotary_seqlens`` -- raises
:class:`~attnguard.fallback.refusal.Uncomputed` naming it.
"""

from __future__ import annotations

from typing import Any

import torch

from .dense import flash_core
from .kvcache import kvcache_attention
from .masks import fa3_window
from .refusal import empty_rows_neg_inf, refuse
from .varlen import varlen_attention

Tensor = torch.Tensor
_NO_WINDOW = (-1, -1)


def _uncomputed(
    q: Tensor,
    v: Tensor,
    qv: Tensor | None,
    descales: tuple[Tensor | None, ...],
    attention_chunk: int = 0,
    **more: Any,
) -> list[str]:
    names = ["qv"] if qv is not None else []
    names += [f"{n}_descale" for n, d in zip("qkv", descales, strict=True) if d is not None]
    if attention_chunk:
        names.append("attention_chunk")
    names += [name for name, value in more.items() if value is not None]
    if v.shape[-1] != q.shape[-1]:
        names.append("a value head_dim other than the query's")
    return names


def _lse(lse: Tensor | None) -> Tensor | None:
    return None if lse is None else empty_rows_neg_inf(lse)


def _dense(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    softmax_scale: float | None,
    causal: bool,
    window_size: Any,
    softcap: float,
    deterministic: bool,
    need_lse: bool,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("flash_attn_func expects q, k, v of shape (batch, seqlen, nheads, dim)")
    out, lse = flash_core(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=softmax_scale,
        window=fa3_window(window_size, causal, q.shape[1], k.shape[1]),
        softcap=softcap or 0.0,
        alibi_slopes=None,
        need_lse=need_lse,
        deterministic=deterministic,
        sinks=sinks,
    )
    return out, _lse(lse)


def _varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    **kw: Any,
) -> tuple[Tensor, Tensor | None]:
    out, lse = varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, rule=fa3_window, **kw
    )
    return out, _lse(lse)


def flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    window_size: tuple[int, int] = _NO_WINDOW,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Twin of flash-attn 3's ``flash_attn_func``."""
    refuse(_uncomputed(q, v, qv, (q_descale, k_descale, v_descale), attention_chunk))
    out, lse = _dense(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        need_lse=return_attn_probs,
    )
    if return_attn_probs:
        assert lse is not None
        return out, lse
    return out


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    window_size: tuple[int, int] = _NO_WINDOW,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Twin of flash-attn 3's ``flash_attn_varlen_func`` (packed sequences; windows normalised
    against max_seqlen_q / max_seqlen_k, as the kernel does)."""
    descales = (q_descale, k_descale, v_descale)
    refuse(
        _uncomputed(q, v, qv, descales, attention_chunk, seqused_q=seqused_q, seqused_k=seqused_k)
    )
    out, lse = _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        window_size=window_size,
        causal=causal,
        softmax_scale=softmax_scale,
        softcap=softcap or 0.0,
        deterministic=deterministic,
        need_lse=return_attn_probs,
    )
    if return_attn_probs:
        assert lse is not None
        return out, lse
    return out


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    qv: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    page_table: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k_new: Tensor | None = None,
    max_seqlen_q: int | None = None,
    rotary_seqlens: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = _NO_WINDOW,
    attention_chunk: int = 0,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Tensor | None = None,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Twin of flash-attn 3's ``flash_attn_with_kvcache``: the cache updated in place as the
    flash-attn 2 twin does it (``page_table`` is its ``block_table``), windows normalised
    against (seqlen_q, the cache's capacity) as the kernel does; ``max_seqlen_q`` is read only
    with ``cu_seqlens_q``, which the twin does not compute."""
    descales = (q_descale, k_descale, v_descale)
    names = _uncomputed(
        q,
        v_cache,
        qv,
        descales,
        attention_chunk,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k_new=cu_seqlens_k_new,
        rotary_seqlens=rotary_seqlens,
    )
    refuse(names)
    out, lse = _kvcache(
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
        page_table,
        softmax_scale=softmax_scale,
        window_size=window_size,
        causal=causal,
        softcap=softcap,
        rotary_interleaved=rotary_interleaved,
        need_lse=return_softmax_lse,
    )
    if return_softmax_lse:
        assert lse is not None
        return out, lse
    return out


def _kvcache(*args: Any, s_aux: Tensor | None = None, **kw: Any) -> tuple[Tensor, Tensor | None]:
    out, lse = kvcache_attention(
        *args,
        rule=fa3_window,
        alibi_slopes=None,
        s_aux=s_aux,
        **{**kw, "softcap": kw["softcap"] or 0.0},
    )
    return out, _lse(lse)


# --- vLLM's build (kernels-community/vllm-flash-attn3): s_aux, always (out, softmax_lse) ---------


def vllm_flash_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    window_size: tuple[int, int] = _NO_WINDOW,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    s_aux: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Twin of vLLM's flash-attn 3 ``flash_attn_func``: ``(out, softmax_lse)``."""
    refuse(_uncomputed(q, v, qv, (q_descale, k_descale, v_descale)))
    out, lse = _dense(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=window_size,
        softcap=softcap,
        deterministic=deterministic,
        need_lse=True,
        sinks=s_aux,
    )
    assert lse is not None
    return out, lse


def vllm_flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    seqused_q: Tensor | None = None,
    seqused_k: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    window_size: tuple[int, int] = _NO_WINDOW,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    s_aux: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Twin of vLLM's flash-attn 3 ``flash_attn_varlen_func``: ``(out, softmax_lse)``."""
    descales = (q_descale, k_descale, v_descale)
    refuse(_uncomputed(q, v, qv, descales, seqused_q=seqused_q, seqused_k=seqused_k))
    out, lse = _varlen(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        window_size=window_size,
        causal=causal,
        softmax_scale=softmax_scale,
        softcap=softcap or 0.0,
        deterministic=deterministic,
        need_lse=True,
        s_aux=s_aux,
    )
    assert lse is not None
    return out, lse


def vllm_flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    qv: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    page_table: Tensor | None = None,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k_new: Tensor | None = None,
    max_seqlen_q: int | None = None,
    rotary_seqlens: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = _NO_WINDOW,
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    scheduler_metadata: Tensor | None = None,
    num_splits: int = 0,
    pack_gqa: bool | None = None,
    sm_margin: int = 0,
    return_softmax_lse: bool = False,
    s_aux: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Twin of vLLM's flash-attn 3 ``flash_attn_with_kvcache`` (as :func:`flash_attn_with_kvcache`,
    with ``s_aux``)."""
    descales = (q_descale, k_descale, v_descale)
    names = _uncomputed(
        q,
        v_cache,
        qv,
        descales,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k_new=cu_seqlens_k_new,
        rotary_seqlens=rotary_seqlens,
    )
    refuse(names)
    out, lse = _kvcache(
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
        page_table,
        softmax_scale=softmax_scale,
        window_size=window_size,
        causal=causal,
        softcap=softcap,
        rotary_interleaved=rotary_interleaved,
        need_lse=return_softmax_lse,
        s_aux=s_aux,
    )
    if return_softmax_lse:
        assert lse is not None
        return out, lse
    return out
