"""Twins of flash-attn's dense functions: ``flash_attn_func`` and its qkv/kv-packed variants, and
:func:`flash_core`, the (B, S, H, D) attention every twin ends in.

Which torch kernel computes a call is decided in :mod:`attnguard.fallback.routes`.
"""

from __future__ import annotations

import math

import torch

from . import attention_sinks, routes, torch_flash
from .masks import (
    alibi_bias,
    band_mask,
    check_alibi,
    kernel_band,
    normalize_window,
    padded_band,
)
from .sdpa import BiasRows, masked_attention, sdpa

Tensor = torch.Tensor
FlashResult = Tensor | tuple[Tensor, Tensor, None]


def check_dtypes(q: Tensor, k: Tensor, v: Tensor) -> None:
    """flash-attn's dtype refusals, with its messages, for what no twin computes: complex,
    integer and bool tensors (a cast would turn the caller's type error into numbers). Float
    dtypes the kernel itself refuses (float32) the twins compute: lifting that is their job."""
    if not q.is_floating_point():
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if not k.is_floating_point():
        raise RuntimeError("query and key must have the same dtype")
    if not v.is_floating_point():
        raise RuntimeError("query and value must have the same dtype")


def flash_core(
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
    deterministic: bool = False,
    sinks: Tensor | None = None,
    sinks_lse: bool = False,
    flash_allowed: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """flash-attn forward on (B, Sq, H, D) / (B, Sk, Hk, D) with an already normalised window:
    the band (left, right) around the bottom-right diagonal, -1 an open side (each family's
    rule makes it: :func:`.masks.normalize_window`, :func:`.masks.fa3_window`, ...).

    ``lens`` = (len_q, len_k), int64 (B,) tensors, marks a padded batch: sequence ``b`` holds
    only its first len_q[b] queries and len_k[b] keys, its mask is aligned to its own lengths
    and the output rows past len_q[b] are meaningless. ``deterministic``: flash-attn's promise
    of a bitwise-reproducible backward pass (:mod:`attnguard.fallback.routes` says how).
    ``sinks``: attention sinks, one logit per query head (:mod:`.attention_sinks`), computed
    from the lse (``sinks_lse``: kept in the compute dtype, with its gradient where a backward
    needs one; torch's flash kernel, whose lse carries none, is then not used:
    ``flash_allowed``).
    """
    if sinks is not None:
        attention_sinks.check(sinks, q.shape[2])
        grad = attention_sinks.needs_grad(sinks, q, k, v)
        out, lse = flash_core(
            q,
            k,
            v,
            dropout_p=dropout_p,
            softmax_scale=softmax_scale,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            need_lse=True,
            lens=lens,
            deterministic=deterministic,
            sinks_lse=True,
            flash_allowed=not grad,
        )
        assert lse is not None
        out, lse = attention_sinks.apply(out, lse, sinks, packed=False)
        return out, (lse if need_lse else None)
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    if k.shape[2] != v.shape[2] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if hk == 0 or h % hk != 0:
        raise ValueError(f"number of heads in key/value ({hk}) must divide query heads ({h})")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        check_dtypes(q, k, v)
        k, v = k.to(q.dtype), v.to(q.dtype)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    left, right = window
    if sq == 0 or sk == 0:
        out = q.new_zeros(b, sq, h, v.shape[-1])
        lse = torch.full((b, h, sq), math.inf, dtype=torch.float32, device=q.device)
        return out, (lse if need_lse else None)
    # read only where it matters (under torch.compile the read is a guard of the graph)
    torch_deterministic = deterministic and torch.are_deterministic_algorithms_enabled()
    explicit = False
    if lens is None:
        route = routes.dense(
            flash_ok=flash_allowed
            and torch_flash.can_run(
                q, k, v, window=torch_flash.windowed(window), deterministic=deterministic
            )
            and kernel_band(window, sq, sk),
            window=window,
            sq=sq,
            sk=sk,
            softcap=softcap,
            alibi=alibi_slopes is not None,
            need_lse=need_lse,
            deterministic=deterministic,
            torch_deterministic=torch_deterministic,
            gpu=q.is_cuda,
        )
        kernel = routes.ROUTES[route].kernel
        if kernel == "torch_flash":
            out, lse = torch_flash.attention(
                q,
                k,
                v,
                None,
                None,
                sq,
                sk,
                dropout_p=dropout_p,
                scale=scale,
                window=window,
                deterministic=deterministic,
            )
            return out, (lse if need_lse else None)
        explicit = kernel == "explicit"
        if route == "dense-plain" and right == 0:  # causal with Sq == Sk: SDPA's own mask
            qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            out = sdpa(qt, kt, vt, None, dropout_p, True, scale)
            return out.transpose(1, 2).contiguous(), None
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    bias_rows: BiasRows | None = None
    if lens is None:
        keep, empty = band_mask(sq, sk, sk - sq, left, right, q.device)
        if alibi_slopes is not None:
            slopes = alibi_slopes.to(q.device)

            def bias_rows(r0: int, r1: int, dtype: torch.dtype) -> Tensor:
                return alibi_bias(slopes, r0, r1, sq, sk, dtype)

    else:
        explicit = not routes.sdpa_reproducible(
            deterministic=deterministic, torch_deterministic=torch_deterministic, gpu=q.is_cuda
        )
        keep, empty, rel = padded_band(lens[0], lens[1], sq, sk, left, right)
        if alibi_slopes is not None:
            slopes4 = alibi_slopes.to(q.device).reshape(-1, h, 1, 1)

            def bias_rows(r0: int, r1: int, dtype: torch.dtype) -> Tensor:
                return -slopes4.to(dtype) * rel[..., r0:r1, :].abs().to(dtype)

    out, lse = masked_attention(
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
        explicit=explicit,
        sinks_lse=sinks_lse,
    )
    return out.transpose(1, 2).contiguous(), lse


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
    s_aux: Tensor | None = None,
) -> FlashResult:
    """SDPA stand-in for ``flash_attn.flash_attn_func`` (flash-attn 2.x). ``s_aux``: attention
    sinks, one logit per query head (flash-attn 3 builds' name; :mod:`.attention_sinks`)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("flash_attn_func expects q, k, v of shape (batch, seqlen, nheads, dim)")
    check_dtypes(q, k, v)
    check_alibi(alibi_slopes, q.shape[0], q.shape[2])
    window = normalize_window(window_size, causal, k.shape[1])
    out, lse = flash_core(
        q,
        k,
        v,
        dropout_p=dropout_p,
        softmax_scale=softmax_scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        need_lse=return_attn_probs,
        deterministic=deterministic,
        sinks=s_aux,
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
