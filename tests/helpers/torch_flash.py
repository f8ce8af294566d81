"""torch's flash kernel (aten's _flash_attention_forward contract: dense and packed layouts,
cu_seqlens, seqused_k, causal/window, GQA, LSE) emulated in float64 on CPU, so the plumbing
around it in the twins' torch_flash routes is checked without a GPU; and the same twin call
with the kernel unavailable.
"""

from __future__ import annotations

import math

import torch

from attnguard.fallback import torch_flash
from helpers.tensors import band_keep

F64 = torch.float64


def attend(q, k, v, scale, left, right):
    """One sequence: q (Sq, H, D), k/v (Sk, Hk, D), flash-attn's bottom-right band."""
    sq, h, _ = q.shape
    sk, hk = k.shape[0], k.shape[1]
    if sk == 0:
        return q.new_zeros(sq, h, v.shape[-1]), torch.full((h, sq), math.inf, dtype=F64)
    kk = k.repeat_interleave(h // hk, dim=1)
    vv = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(F64), kk.to(F64)) * scale
    s = s.masked_fill(~band_keep(sq, sk, left, right), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, vv.to(F64))
    return out, lse.masked_fill(torch.isneginf(lse), math.inf)


def fake_flash_op(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
):
    assert dropout_p == 0.0 and alibi_slopes is None and not return_debug_mask
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    left = -1 if window_size_left is None else window_size_left
    right = 0 if is_causal else (-1 if window_size_right is None else window_size_right)
    if cu_q is None:  # dense (B, S, H, D)
        outs, lses = zip(
            *(attend(q[b], k[b], v[b], scale, left, right) for b in range(q.shape[0])),
            strict=True,
        )
        return torch.stack(outs).to(q.dtype), torch.stack(lses).float(), None, None, None
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    outs, lses = [], []
    for i in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        if seqused_k is not None:
            assert seqused_k.dtype == torch.int32
            k1 = k0 + int(seqused_k[i])
        o, lse = attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, left, right)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1).float(), None, None, None


def without_flash(fn, *args, **kwargs):
    """The same twin call with torch's flash kernel unavailable (its other routes)."""
    saved = torch_flash.can_run
    torch_flash.can_run = lambda *a, **k: False
    try:
        return fn(*args, **kwargs)
    finally:
        torch_flash.can_run = saved


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
