"""Seeded tensors and attention written out by hand in float64: the references the twins, the
guarded calls and the kernels are checked against.

Layouts: flash-attn's (B, S, H, D) unless said; key/value may have fewer heads than the query
(query head h reads key/value head h // (H // Hk)).
"""

from __future__ import annotations

import math
from typing import Any

import torch

F32, F16, BF16, F64 = torch.float32, torch.float16, torch.bfloat16, torch.float64

# twin vs float64 reference, by the dtype computed in
TOL = {
    F32: {"atol": 2e-5, "rtol": 2e-5},
    F16: {"atol": 3e-3, "rtol": 3e-3},
    BF16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = [F32, BF16, F16]
LSE_TOL = {"atol": 1e-5, "rtol": 1e-5}  # softmax_lse is float32


def rand(
    *shape: int,
    dtype: torch.dtype = F32,
    seed: int = 0,
    device: Any = None,
    requires_grad: bool = False,
    draw: torch.dtype | None = F32,
) -> torch.Tensor:
    """Seeded normal values drawn in ``draw`` (float32: the same numbers in every dtype; None:
    drawn in ``dtype`` itself), then cast to ``dtype``."""
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=draw or dtype, device=device).to(dtype)
    return t.requires_grad_(requires_grad)


def qkv(
    b: int = 2,
    sq: int = 12,
    sk: int | None = None,
    h: int = 4,
    hk: int = 4,
    d: int = 16,
    *,
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype] = (F32, F32, F32),
    seed: int = 0,
    device: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (b, sq, h, d), k and v (b, sk, hk, d) from one seeded generator, drawn in float32 and
    cast to ``dtypes`` (sk: sq unless given)."""
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    sk = sq if sk is None else sk
    q = torch.randn(b, sq, h, d, generator=g, device=device).to(dtypes[0])
    k = torch.randn(b, sk, hk, d, generator=g, device=device).to(dtypes[1])
    v = torch.randn(b, sk, hk, d, generator=g, device=device).to(dtypes[2])
    return q, k, v


def i32(values: Any, device: Any = None) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def cu_seqlens(lens: list[int], device: Any = None) -> torch.Tensor:
    """flash-attn's cumulative sequence starts (int32): [0, l0, l0 + l1, ...]."""
    return i32([0, *torch.tensor(lens).cumsum(0).tolist()], device)


def flash_keep(sq: int, sk: int, causal: bool = False, window: tuple[int, int] = (-1, -1)) -> Any:
    """flash-attn's documented mask: bottom-right aligned causal / sliding window, by loops."""
    keep = torch.zeros(sq, sk, dtype=torch.bool)
    left, right = window
    for i in range(sq):
        d = i + sk - sq
        for j in range(sk):
            ok = True
            if causal and j > d:
                ok = False
            if left >= 0 and j < d - left:
                ok = False
            if right >= 0 and j > d + right:
                ok = False
            keep[i, j] = ok
    return keep


def band_keep(sq: int, sk: int, left: int = -1, right: int = -1, device: Any = None) -> Any:
    """The same band as flash_keep, built at once (for references run at scale, on any device):
    query i sits on the diagonal i + sk - sq and keeps key j iff j >= diagonal - left and
    j <= diagonal + right (a negative side is open; causal is right = 0)."""
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    return keep


def alibi_ref_bias(slopes: torch.Tensor, sq: int, sk: int) -> torch.Tensor:
    """-slope * |i + Sk - Sq - j| by loops; slopes (H,) or (B, H) -> (B|1, H, Sq, Sk)."""
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0)
    b, h = slopes.shape
    bias = torch.zeros(b, h, sq, sk, dtype=F64)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                for j in range(sk):
                    bias[bi, hi, i, j] = -float(slopes[bi, hi]) * abs(i + sk - sq - j)
    return bias


def _scores(q, k, scale, softcap, bias, keep, heads_first):
    if heads_first:  # (B, H, S, D) in
        q, k = q.transpose(1, 2), k.transpose(1, 2)
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * (
        1 / math.sqrt(q.shape[-1]) if scale is None else scale
    )
    if softcap:  # (0 or None: none)
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double().to(s.device)
    if keep is not None:
        s = s.masked_fill(~keep.to(s.device), float("-inf"))
    return s


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: Any = None,
    *,
    bias: Any = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: Any = None,
    heads_first: bool = False,
) -> torch.Tensor:
    """softmax(QK^T * scale [softcapped] + bias, masked by keep [, a sink logit per head]) V in
    float64, (B, Sq, H, D) out (``heads_first``: q, k, v given as (B, H, S, D)).

    keep: bool, broadcastable to (B, H, Sq, Sk), True = attend; bias: float, the same shape.
    Rows with nothing kept give zeros (with sinks: the sink takes all of the row's weight).
    """
    s = _scores(q, k, scale, softcap, bias, keep, heads_first)
    v = (v.transpose(1, 2) if heads_first else v).double()
    v = v.repeat_interleave(s.shape[1] // v.shape[2], dim=2)
    if sinks is None:
        p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    else:
        sink = sinks.double().reshape(1, -1, 1, 1).expand(s.shape[0], -1, s.shape[2], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def ref_lse(
    q: torch.Tensor, k: torch.Tensor, *, scale=None, keep=None, bias=None, softcap=0.0
) -> torch.Tensor:
    """Row logsumexp of the masked/scaled scores, float64, (B, H, Sq)."""
    return torch.logsumexp(_scores(q, k, scale, softcap, bias, keep, False), dim=-1)


def sinks_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    causal: bool = True,
    window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """flash-attn's semantics with attention sinks (gpt-oss' s_aux), float64."""
    left, right = window
    keep = band_keep(q.shape[1], k.shape[1], left, 0 if causal else right, q.device)
    return reference(q, k, v, keep, softcap=softcap, sinks=sinks)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    """A twin's output: in the dtype asked for, no NaN, close to the float64 reference."""
    assert out.dtype == dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


def one_graph(fn: Any, *args: Any) -> Any:
    """Assert ``fn(*args)`` traces as one graph with no break; return it compiled.

    ``explain`` counts the breaks; ``fullgraph=True`` also catches data-dependent guards that
    explain may not count. The "eager" backend keeps it fast: Dynamo still captures the whole
    graph, only code generation is skipped, so compiled and eager run the same kernels.
    """
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    reasons = [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    assert explanation.graph_count == 1
    return torch.compile(fn, backend="eager", fullgraph=True)


def compile_whole(fn: Any, *args: Any) -> tuple[Any, Any]:
    """Assert ``fn(*args)`` traces as one graph (one_graph); return (compiled result, eager
    result)."""
    return one_graph(fn, *args)(*args), fn(*args)


def assert_same(got: Any, want: Any) -> None:
    """Compiled and eager results: equal to the bit, no NaN (None where eager gave None)."""
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert not torch.isnan(g).any()
        assert torch.equal(g, w)
