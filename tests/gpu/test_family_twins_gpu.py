"""The flash-attn 3 / vLLM flash-attn 3 / flash-attn 4 twins on a CUDA GPU (bf16), against float64
models of each family's own rules (tests/helpers/family_rules.py): the GPU routes (torch's flash
kernel where it computes the family's window, masked SDPA where it does not: a one-sided window
with seqlen_q > seqlen_k + 1; the LSE; sinks) give the family's numbers within bf16 rounding.

Needs no flash-attn. Run: pytest -m gpu tests/gpu/test_family_twins_gpu.py
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from helpers.family_rules import attend64, fa3_bounds, fa4_bounds, keep_of

from attnguard.fallback import families

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = torch.bfloat16
OUT_TOL = 2e-2  # relative to max |out| of the reference
LSE_ATOL = 5e-3
FA3, VLLM, FA4 = families.FA3, families.FA3_VLLM, families.FA4
FUNC, VARLEN, KVCACHE = families.FUNC, families.VARLEN, families.KVCACHE
SHAPES = [(128, 128), (256, 64), (64, 256), (1, 200)]  # (256, 64): seqlen_q > seqlen_k + 1
WINDOWS = [
    ((-1, -1), False),
    ((32, -1), False),
    ((-1, 16), False),
    ((32, 0), True),
    ((16, 8), False),
]


def _qkv(b: int, sq: int, sk: int, h: int = 8, hk: int = 2, d: int = 64, seed: int = 0) -> Any:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(b, n, heads, d, generator=g).to("cuda", BF16)
        for n, heads in ((sq, h), (sk, hk), (sk, hk))
    ]


def _close(got: torch.Tensor, want: torch.Tensor, lse: bool = False) -> None:
    want = want.to(got.device)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin)
    diff = (got.double() - want.double())[fin].abs().max().item() if fin.any() else 0.0
    tol = LSE_ATOL if lse else OUT_TOL * want[fin].abs().max().item()
    assert diff <= tol, (diff, tol)


@pytest.mark.parametrize("family", [FA3, VLLM, FA4], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dense(family: families.Family, shape: tuple[int, int]) -> None:
    sq, sk = shape
    q, k, v = _qkv(2, sq, sk)
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0, 1.0, -2.0, 0.3, 0.0], device="cuda", dtype=BF16)
    fn = families.twins_for(family)[FUNC]
    for ws, causal in WINDOWS:
        if family is FA4:
            w4 = (None if ws[0] < 0 else ws[0], None if ws[1] < 0 else ws[1])
            out, lse = fn(
                q, k, v, causal=causal, window_size=w4, learnable_sink=sink, return_lse=True
            )
            bounds = fa4_bounds(w4, causal)
        elif family is VLLM:
            out, lse = fn(q, k, v, causal=causal, window_size=ws, s_aux=sink)
            bounds = fa3_bounds(ws, causal, sq, sk)
        else:
            out, lse = fn(q, k, v, causal=causal, window_size=ws, return_attn_probs=True)
            bounds = fa3_bounds(ws, causal, sq, sk)
        keep = keep_of(bounds, sq, sk).cuda()
        with_sink = None if family is FA3 else sink
        want, want_lse = attend64(q, k, v, keep, empty_lse=-math.inf, sink=with_sink)
        _close(out, want)
        _close(lse, want_lse, lse=True)


@pytest.mark.parametrize("family", [FA3, VLLM, FA4], ids=str)
def test_varlen(family: families.Family) -> None:
    cu_q, cu_k = [0, 100, 100, 360, 380], [0, 40, 40, 300, 512]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(cu_q[-1], 8, 64, generator=g).to("cuda", BF16)
    k, v = (torch.randn(cu_k[-1], 2, 64, generator=g).to("cuda", BF16) for _ in range(2))
    cq, ck = (torch.tensor(c, dtype=torch.int32, device="cuda") for c in (cu_q, cu_k))
    max_q, max_k = 260, 260
    fn = families.twins_for(family)[VARLEN]
    for ws, causal in WINDOWS:
        w = (None if ws[0] < 0 else ws[0], None if ws[1] < 0 else ws[1]) if family is FA4 else ws
        extra = {"return_lse": True} if family is FA4 else {}
        if family is FA3:
            extra = {"return_attn_probs": True}
        out, lse = fn(q, k, v, cq, ck, max_q, max_k, causal=causal, window_size=w, **extra)
        bounds = fa4_bounds(w, causal) if family is FA4 else fa3_bounds(ws, causal, max_q, max_k)
        for n in range(len(cu_q) - 1):
            a, b, c, e = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
            if a == b:
                continue
            keep = keep_of(bounds, b - a, e - c).cuda()
            want, want_lse = attend64(
                q[None, a:b], k[None, c:e], v[None, c:e], keep, empty_lse=-math.inf
            )
            _close(out[a:b], want[0])
            _close(lse[:, a:b], want_lse[0], lse=True)


def test_kvcache() -> None:
    """flash-attn 3's flash_attn_with_kvcache on the GPU routes (decode, chunked prefill)."""
    g = torch.Generator().manual_seed(2)
    b, cap = 3, 512
    fn = families.twins_for(FA3)[KVCACHE]
    for new in (1, 16):
        q = torch.randn(b, new, 8, 64, generator=g).to("cuda", BF16)
        kn, vn = (torch.randn(b, new, 2, 64, generator=g).to("cuda", BF16) for _ in range(2))
        cache = [torch.randn(b, cap, 2, 64, generator=g).to("cuda", BF16) for _ in range(2)]
        seqlens = torch.tensor([10, 200, 400], dtype=torch.int32, device="cuda")
        for ws, causal in (((-1, -1), True), ((64, -1), False), ((32, 0), True)):
            kc, vc = (c.clone() for c in cache)
            out, lse = fn(
                q, kc, vc, kn, vn, cache_seqlens=seqlens, causal=causal, window_size=ws,
                return_softmax_lse=True,
            )  # fmt: skip
            bounds = fa3_bounds(ws, causal, new, cap)
            for n in range(b):
                end = int(seqlens[n]) + new
                keep = keep_of(bounds, new, end).cuda()
                want, want_lse = attend64(
                    q[n : n + 1],
                    kc[n : n + 1, :end],
                    vc[n : n + 1, :end],
                    keep,
                    empty_lse=-math.inf,
                )
                _close(out[n : n + 1], want)
                _close(lse[n : n + 1], want_lse, lse=True)
