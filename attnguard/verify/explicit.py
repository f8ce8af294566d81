"""An explicit float64 softmax attention: the independent reference of the numbers check.

Written from each family's documented rules, sharing no code with attnguard's twins (which it
checks when they compute a call): scores ``q . k * scale`` (then ``softcap * tanh(s / softcap)``,
then an additive bias: ALiBi's ``-slope * |i + Sk - Sq - j|`` or a float mask), keys outside the
visible set dropped, a softmax (with one extra logit per head for attention sinks, which takes
probability mass and gives no value), times ``v``. Rows that see no key give zeros under flash-attn's
rules and are undefined (NaN, left out of the comparison) under SDPA's and xformers'.

Layout (batch, seq, heads, head_dim), grouped heads without repeating k/v (query head ``h`` reads
kv head ``h // (H / Hk)``). Computed per batch row, per kv head and per chunk of query rows, so
the scores it holds stay under :data:`CHUNK_ELEMENTS` elements whatever the call's length.

Besides the output it returns an *allowance* per element: how far a kernel that rounds the scores
to the call's dtype before its softmax (SDPA's math path in half precision does) may legitimately
differ, ``u * (sum_j p_j |s_j| |v_j| + sum_j p_j |s_j| * |o|)`` for the dtype's unit roundoff
``u`` (a score off by ``u|s|`` changes ``p_j`` by about ``u|s_j|`` relative).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Tensor = torch.Tensor
_F64 = torch.float64
CHUNK_ELEMENTS = 1 << 24  # scores held at once (128 MiB in float64)


@dataclass(frozen=True)
class Rules:
    """What one call computes, beyond q, k and v.

    ``causal``: "" (none), "top_left" (SDPA's, xformers' LowerTriangularMask: key ``j <= i``) or
    "bottom_right" (flash-attn's: ``j <= i + Sk - Sq``); ``window``: (left, right) in keys from the
    bottom-right aligned diagonal, -1 for an open side (already normalised by the family's rule);
    ``alibi``: slopes (H,) or (B, H); ``mask``: bool (True: visible) or float (added), broadcastable
    to (B, H, Sq, Sk); ``sinks``: one logit per query head; ``empty``: "zero" or "nan" for rows
    that see no key."""

    scale: float
    causal: str = ""
    window: tuple[int, int] | None = None
    softcap: float = 0.0
    alibi: Tensor | None = None
    mask: Tensor | None = None
    sinks: Tensor | None = None
    empty: str = "zero"


def attend(q: Tensor, k: Tensor, v: Tensor, rules: Rules, u: float) -> tuple[Tensor, Tensor]:
    """(out, allowance), both float64 (B, Sq, H, Dv), for q (B, Sq, H, D), k/v (B, Sk, Hk, D)."""
    b, sq, h, _ = q.shape
    sk, hk, dv = k.shape[1], k.shape[2], v.shape[-1]
    if hk == 0 or h % hk or k.shape[:3] != v.shape[:3] or k.shape[0] != b:
        raise ValueError(f"shapes do not attend: q {tuple(q.shape)}, k {tuple(k.shape)}")
    group = h // hk
    out = torch.zeros(b, sq, h, dv, dtype=_F64, device=q.device)
    allow = torch.zeros_like(out)
    if sq == 0:
        return out, allow
    rows = max(1, min(sq, CHUNK_ELEMENTS // max(1, group * max(sk, 1))))
    mask = rules.mask
    if mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    for bi in range(b):
        for kv in range(hk):
            heads = slice(kv * group, (kv + 1) * group)
            qh = q[bi, :, heads].to(_F64).transpose(0, 1)  # (G, Sq, D)
            kh = k[bi, :, kv].to(_F64)  # (Sk, D)
            vh = v[bi, :, kv].to(_F64)
            for r0 in range(0, sq, rows):
                r1 = min(sq, r0 + rows)
                o, a = _chunk(qh[:, r0:r1], kh, vh, rules, mask, bi, heads, r0, r1, sq, u)
                out[bi, r0:r1, heads] = o.transpose(0, 1)
                allow[bi, r0:r1, heads] = a.transpose(0, 1)
    return out, allow


def _chunk(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    rules: Rules,
    mask: Tensor | None,
    bi: int,
    heads: slice,
    r0: int,
    r1: int,
    sq: int,
    u: float,
) -> tuple[Tensor, Tensor]:
    sk = k.shape[0]
    s = torch.matmul(q, k.transpose(0, 1)) * rules.scale  # (G, R, Sk)
    if rules.softcap:
        s = rules.softcap * torch.tanh(s / rules.softcap)
    dev = q.device
    i = torch.arange(r0, r1, device=dev).unsqueeze(1)  # query rows
    j = torch.arange(sk, device=dev).unsqueeze(0)
    diag = i + (sk - sq)  # the bottom-right aligned diagonal
    keep = torch.ones(r1 - r0, sk, dtype=torch.bool, device=dev)
    if rules.causal == "top_left":
        keep &= j <= i
    elif rules.causal == "bottom_right":
        keep &= j <= diag
    if rules.window is not None:
        left, right = rules.window
        if left >= 0:
            keep &= j >= diag - left
        if right >= 0:
            keep &= j <= diag + right
    keep = keep.expand_as(s)
    if rules.alibi is not None:
        slopes = rules.alibi if rules.alibi.dim() == 1 else rules.alibi[bi]
        slope = slopes[heads].to(_F64).view(-1, 1, 1)
        s = s - slope * (diag - j).abs().to(_F64)
    if mask is not None:
        m = mask[min(bi, mask.shape[0] - 1)]
        m = m[heads] if m.shape[0] > 1 else m
        m = m[:, r0:r1] if m.shape[1] > 1 else m
        if m.dtype == torch.bool:
            keep = keep & m
        else:
            s = s + m.to(_F64)
            keep = keep & ~torch.isneginf(m)
    s = s.masked_fill(~keep, float("-inf"))
    if rules.sinks is not None:
        sink = rules.sinks[heads].to(_F64).view(-1, 1, 1).expand(-1, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    empty = ~keep.any(dim=-1, keepdim=True)  # (G, R, 1)
    p = torch.where(empty, 0.0, p)
    o = torch.matmul(p, v)
    weight = p * torch.where(keep, s, 0.0).abs()  # how much each score's rounding moves p
    a = u * (torch.matmul(weight, v.abs()) + weight.sum(-1, keepdim=True) * o.abs())
    if rules.empty == "nan":
        o = o.masked_fill(empty, float("nan"))
    return o, a


# --- each family's window rule ---------------------------------------------------------------------


def fa2_window(
    window: tuple[int, int], causal: bool, seqlen_k: int
) -> tuple[bool, tuple[int, int] | None]:
    """flash-attn 2 (csrc/flash_attn/flash_api.cpp, mha_fwd and set_params_fprop): a side at or
    past ``seqlen_k`` is open; causal closes the right side at 0; then an open side facing a
    closed one becomes ``seqlen_k`` (the right one stays closed there: rows far above the
    diagonal of a long query see fewer keys). Returns (causal, window or None)."""
    left, right = int(window[0]), int(window[1])
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    if left < 0 and right < 0:
        return causal, None
    if left < 0:
        left = seqlen_k
    if right < 0:
        right = seqlen_k
    return False, (left, right)


def fa3_window(
    window: tuple[int | None, int | None], causal: bool, seqlen_q: int, seqlen_k: int
) -> tuple[bool, tuple[int, int] | None]:
    """flash-attn 3 (hopper/flash_api.cpp) and 4 (None for an open side): a left side at or past
    ``seqlen_k - 1`` and a right side at or past ``seqlen_q - 1`` are open; causal closes the right
    side at 0; an open side stays open."""
    left = -1 if window[0] is None else int(window[0])
    right = -1 if window[1] is None else int(window[1])
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    if causal:
        right = 0
    if left < 0 and right < 0:
        return causal, None
    return False, (left, right)
