"""float64 models of each flash-attn family's rules, written from that family's sources (never
calling attnguard's twins): the window each kernel's C++/Python entry leaves for its mask, the
mask, and softmax attention over the kept keys (with attention sinks). Shared by
tests/test_family_twins.py and tests/gpu/test_family_twins_gpu.py.

* flash-attn 2: csrc/flash_attn/flash_api.cpp ``mha_fwd`` + ``set_params_fprop``;
* flash-attn 3 (vLLM's build alike): hopper/flash_api.cpp ``mha_fwd`` + ``set_params_fprop``;
* flash-attn 4: flash_attn/cute/interface.py ``_resolve_causal_local_window`` and mask.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def fa2_bounds(ws: Any, causal: bool, sq: int, sk: int) -> tuple[int | None, int | None]:
    """flash-attn 2's (left, right) as its mask reads them (None: no bound)."""
    left, right = ws
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    if sq == 1:
        causal = False  # "causal=true is the same as causal=false in this case"
    if causal:
        right = 0
    if left < 0 <= right:
        left = sk
    if left >= 0 > right:
        right = sk
    return (left if left >= 0 else None, right if right >= 0 else None)


def fa3_bounds(ws: Any, causal: bool, sq: int, sk: int) -> tuple[int | None, int | None]:
    """flash-attn 3's (left, right) as ``set_params_fprop`` leaves them."""
    left, right = ws
    if left >= sk - 1:
        left = -1
    if right >= sq - 1:
        right = -1
    if causal:
        right = 0
    if left < 0:
        left = sk - 1
    if right < 0:
        right = sq - 1
    return left, right


def fa4_bounds(ws: Any, causal: bool, sq: int = 0, sk: int = 0) -> tuple[int | None, int | None]:
    """flash-attn 4's (left, right): None no bound, ints as given."""
    left, right = ws
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None  # local off; the causal flag stands
        right = 0 if causal else None
    return left, right


def keep_of(bounds: tuple[int | None, int | None], sq: int, sk: int) -> torch.Tensor:
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if bounds[0] is not None:
        keep &= j >= i - bounds[0]
    if bounds[1] is not None:
        keep &= j <= i + bounds[1]
    return keep


def attend64(q, k, v, keep, *, empty_lse, scale=None, softcap=0.0, sink=None):  # type: ignore[no-untyped-def]
    """(B, Sq, H, D) softmax attention in float64 over the kept keys (and a sink logit per head
    that takes mass and adds no value); zeros for a row that sees nothing. (out, lse (B, H, Sq))."""
    h, hk = q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(h // hk, dim=2).double().transpose(1, 2) for x in (k, v))
    qd = q.double().transpose(1, 2)
    s = qd @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~keep, -math.inf)
    if sink is not None:
        col = sink.double().reshape(1, h, 1, 1).expand(*s.shape[:3], 1)
        s = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    p = p[..., : v.shape[2]]
    if sink is None:
        lse = lse.masked_fill(torch.isneginf(lse), empty_lse)
    return (p @ v).transpose(1, 2), lse
