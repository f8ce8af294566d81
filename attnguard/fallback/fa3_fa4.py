"""Twins of flash-attn 3's and flash-attn 4's attention functions, on the flash-attn 2 twins.

flash-attn 3 (``hopper/flash_attn_interface.py``; the kernel hub's ``kernels-community/flash-attn3``
build) and flash-attn 4 (``flash_attn/cute/interface.py``; ``kernels-community/flash-attn4``)
compute what flash-attn 2 computes, with other keyword arguments and return values:

* the same attention: layout ``(batch, seqlen, nheads, headdim)`` (varlen ``(total, nheads,
  headdim)`` with ``cu_seqlens``), grouped k/v heads, causal masks and windows aligned to the
  bottom-right corner, ``softcap``, zeros for rows with no visible key; no dropout;
* flash-attn 3 returns ``out``, or ``(out, softmax_lse)`` where the hub build is asked
  ``return_attn_probs=True`` (the LSE float32, ``(batch, nheads, seqlen_q)``, varlen
  ``(nheads, total_q)``); ``num_splits``, ``pack_gqa``, ``sm_margin`` only tune the kernel,
  ``deterministic`` its backward pass;
* flash-attn 4 returns ``(out, lse)``, the LSE only where an input requires grad (or where a
  newer build is asked ``return_lse=True``), else ``None``; a window side of ``None`` is
  unbounded.

What these twins do not compute — flash-attn 3's ``qv``, its FP8 ``q/k/v_descale``,
``attention_chunk``, ``seqused_q/k``, a value head_dim other than the query's; flash-attn 4's
``learnable_sink`` or any other argument — raises :class:`Uncomputed` naming it: the caller
steps aside (its own error), never computes something else.
"""

from __future__ import annotations

from typing import Any

import torch

from .dense import flash_attn_func
from .varlen import flash_attn_varlen_func

Tensor = torch.Tensor


class Uncomputed(TypeError):
    """A call passed arguments the twin does not compute (named in the message)."""


def _refuse(names: list[str]) -> None:
    if names:
        raise Uncomputed(", ".join(names))


def _fa3_uncomputed(
    q: Tensor,
    v: Tensor,
    qv: Tensor | None,
    descales: tuple[Tensor | None, ...],
    attention_chunk: int,
    seqused: tuple[Tensor | None, ...] = (),
) -> list[str]:
    names = ["qv"] if qv is not None else []
    names += [f"{n}_descale" for n, d in zip("qkv", descales, strict=True) if d is not None]
    if attention_chunk:
        names.append("attention_chunk")
    names += [f"seqused_{n}" for n, t in zip("qk", seqused, strict=False) if t is not None]
    if v.shape[-1] != q.shape[-1]:
        names.append("a value head_dim other than the query's")
    return names


def flash_attn_3_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    qv: Tensor | None = None,
    q_descale: Tensor | None = None,
    k_descale: Tensor | None = None,
    v_descale: Tensor | None = None,
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
) -> Any:
    """Twin of flash-attn 3's ``flash_attn_func``."""
    _refuse(_fa3_uncomputed(q, v, qv, (q_descale, k_descale, v_descale), attention_chunk))
    res = flash_attn_func(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=tuple(window_size),
        softcap=softcap,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    return (res[0], res[1]) if return_attn_probs else res


def flash_attn_3_varlen_func(
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
    window_size: tuple[int, int] = (-1, -1),
    attention_chunk: int = 0,
    softcap: float = 0.0,
    num_splits: int = 1,
    pack_gqa: bool | None = None,
    deterministic: bool = False,
    sm_margin: int = 0,
    return_attn_probs: bool = False,
) -> Any:
    """Twin of flash-attn 3's ``flash_attn_varlen_func`` (packed sequences)."""
    descales = (q_descale, k_descale, v_descale)
    _refuse(_fa3_uncomputed(q, v, qv, descales, attention_chunk, (seqused_q, seqused_k)))
    res = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=tuple(window_size),
        softcap=softcap,
        deterministic=deterministic,
        return_attn_probs=return_attn_probs,
    )
    return (res[0], res[1]) if return_attn_probs else res


def flash_attn_4_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int | None, int | None] = (None, None),
    learnable_sink: Tensor | None = None,
    softcap: float | None = 0.0,
    pack_gqa: bool | None = None,
    num_splits: int = 1,
    deterministic: bool = False,
    return_lse: bool = False,
    **other: Any,
) -> tuple[Tensor, Tensor | None]:
    """Twin of flash-attn 4's ``flash_attn_func``: ``(out, lse)``."""
    names = [n for n, value in other.items() if value is not None]
    if learnable_sink is not None:
        names.insert(0, "learnable_sink")
    if v.shape[-1] != q.shape[-1]:
        names.append("a value head_dim other than the query's")
    _refuse(names)
    left, right = (-1 if w is None else int(w) for w in window_size)
    need_lse = return_lse or any(t.requires_grad for t in (q, k, v))
    res = flash_attn_func(
        q,
        k,
        v,
        softmax_scale=softmax_scale,
        causal=causal,
        window_size=(left, right),
        softcap=softcap or 0.0,
        deterministic=deterministic,
        return_attn_probs=need_lse,
    )
    return (res[0], res[1]) if need_lse else (res, None)
