"""Tests for attnguard.fallback: SDPA stand-ins checked against an explicit float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from attnguard.fallback import (
    FLASH_FUNCTIONS,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    xformers_memory_efficient_attention,
)

TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 3e-3, "rtol": 3e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
LSE_TOL = {"atol": 1e-5, "rtol": 1e-5}  # softmax_lse is float32


# ------------------------------------------------------------------------------------------
# float64 reference, written out by hand
# ------------------------------------------------------------------------------------------


def ref_attention(q, k, v, *, scale=None, keep=None, bias=None, softcap=0.0):
    """softmax(QK^T * scale [softcapped] + bias, masked by keep) V in float64.

    q: (B, Sq, H, D); k, v: (B, Sk, Hk, D) with H % Hk == 0 (query head h uses kv head
    h // (H // Hk)). keep: bool, broadcastable to (B, H, Sq, Sk), True = attend.
    bias: float, broadcastable to (B, H, Sq, Sk). Rows with nothing kept give zeros.
    """
    q, k, v = q.double(), k.double(), v.double()
    h, hk = q.shape[2], k.shape[2]
    k = k.repeat_interleave(h // hk, dim=2)
    v = v.repeat_interleave(h // hk, dim=2)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def ref_lse(q, k, *, scale=None, keep=None, bias=None, softcap=0.0):
    """Row logsumexp of the masked/scaled scores, float64, (B, H, Sq)."""
    q, k = q.double(), k.double()
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return torch.logsumexp(s, dim=-1)


def flash_keep(sq, sk, causal=False, window=(-1, -1)):
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


def alibi_ref_bias(slopes, sq, sk):
    """-slope * |i + Sk - Sq - j| by loops; slopes (H,) or (B, H) -> (B|1, H, Sq, Sk)."""
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0)
    b, h = slopes.shape
    bias = torch.zeros(b, h, sq, sk, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(sq):
                for j in range(sk):
                    bias[bi, hi, i, j] = -float(slopes[bi, hi]) * abs(i + sk - sq - j)
    return bias


def rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def check(out, ref, dtype):
    assert out.dtype == dtype
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])


# ------------------------------------------------------------------------------------------
# flash_attn_func
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_square(dtype, causal):
    b, s, h, d = 2, 9, 4, 16
    q, k, v = (rand(b, s, h, d, dtype=dtype, seed=i) for i in range(3))
    out = flash_attn_func(q, k, v, causal=causal)
    check(out, ref_attention(q, k, v, keep=flash_keep(s, s, causal)), dtype)
    assert out.shape == (b, s, h, d)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_causal_bottom_right_sq_lt_sk(dtype):
    b, sq, sk, h, d = 2, 3, 8, 2, 16
    q = rand(b, sq, h, d, dtype=dtype, seed=1)
    k = rand(b, sk, h, d, dtype=dtype, seed=2)
    v = rand(b, sk, h, d, dtype=dtype, seed=3)
    out = flash_attn_func(q, k, v, causal=True)
    keep = flash_keep(sq, sk, causal=True)
    assert keep[0].tolist() == [True] * 6 + [False] * 2  # bottom-right, not top-left
    check(out, ref_attention(q, k, v, keep=keep), dtype)
    # top-left alignment would give a different answer
    top_left = torch.ones(sq, sk, dtype=torch.bool).tril()
    assert not torch.allclose(out.double(), ref_attention(q, k, v, keep=top_left), atol=1e-2)


def test_flash_causal_sq_gt_sk_empty_rows_are_zero():
    b, sq, sk, h, d = 1, 6, 3, 2, 8
    q = rand(b, sq, h, d, seed=1)
    k = rand(b, sk, h, d, seed=2)
    v = rand(b, sk, h, d, seed=3)
    out = flash_attn_func(q, k, v, causal=True)
    keep = flash_keep(sq, sk, causal=True)
    assert not keep[:3].any()
    check(out, ref_attention(q, k, v, keep=keep), torch.float32)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3]))
    out2, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)
    assert torch.isinf(lse[:, :, :3]).all() and (lse[:, :, :3] > 0).all()


@pytest.mark.parametrize(
    ("sq", "sk", "causal", "window"),
    [
        (10, 10, False, (2, 1)),
        (10, 10, True, (3, -1)),
        (10, 10, False, (-1, 2)),
        (10, 10, False, (0, 0)),
        (4, 11, False, (2, 3)),
        (4, 11, True, (5, -1)),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_sliding_window(sq, sk, causal, window, dtype):
    b, h, d = 2, 3, 16
    q = rand(b, sq, h, d, dtype=dtype, seed=4)
    k = rand(b, sk, h, d, dtype=dtype, seed=5)
    v = rand(b, sk, h, d, dtype=dtype, seed=6)
    out = flash_attn_func(q, k, v, causal=causal, window_size=window)
    check(out, ref_attention(q, k, v, keep=flash_keep(sq, sk, causal, window)), dtype)


@pytest.mark.parametrize("hk", [2, 1])  # GQA, MQA
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_gqa_mqa(hk, causal, dtype):
    b, sq, sk, h, d = 2, 5, 7, 8, 16
    q = rand(b, sq, h, d, dtype=dtype, seed=7)
    k = rand(b, sk, hk, d, dtype=dtype, seed=8)
    v = rand(b, sk, hk, d, dtype=dtype, seed=9)
    out = flash_attn_func(q, k, v, causal=causal)
    check(out, ref_attention(q, k, v, keep=flash_keep(sq, sk, causal)), dtype)
    # query heads 0..3 share kv head 0 (not round-robin)
    if hk == 2:
        k2 = k.clone()
        k2[:, :, 1] += 1.0
        out2 = flash_attn_func(q, k2, v, causal=causal)
        assert torch.equal(out2[:, :, :4], out[:, :, :4])
        assert not torch.equal(out2[:, :, 4:], out[:, :, 4:])


def test_flash_gqa_bad_heads():
    q = rand(1, 4, 6, 8)
    k = rand(1, 4, 4, 8)
    with pytest.raises(ValueError):
        flash_attn_func(q, k, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_softcap(dtype, causal):
    b, s, h, d = 2, 8, 2, 16
    q, k, v = (rand(b, s, h, d, dtype=dtype, seed=10 + i) * 3 for i in range(3))
    out = flash_attn_func(q, k, v, causal=causal, softcap=2.0)
    ref = ref_attention(q, k, v, keep=flash_keep(s, s, causal), softcap=2.0)
    check(out, ref, dtype)
    plain = ref_attention(q, k, v, keep=flash_keep(s, s, causal))
    assert not torch.allclose(out.double(), plain, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("batched_slopes", [False, True])
def test_flash_alibi(dtype, causal, batched_slopes):
    b, sq, sk, h, d = 2, 5, 9, 4, 16
    q = rand(b, sq, h, d, dtype=dtype, seed=20)
    k = rand(b, sk, h, d, dtype=dtype, seed=21)
    v = rand(b, sk, h, d, dtype=dtype, seed=22)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    if batched_slopes:
        slopes = torch.stack([slopes, slopes * 2])
    out = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes)
    bias = alibi_ref_bias(slopes, sq, sk)
    check(out, ref_attention(q, k, v, keep=flash_keep(sq, sk, causal), bias=bias), dtype)
    # alibi with softcap goes through the explicit path: bias added after softcapping
    out = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, softcap=3.0)
    ref = ref_attention(q, k, v, keep=flash_keep(sq, sk, causal), bias=bias, softcap=3.0)
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_softmax_scale(dtype):
    b, s, h, d = 1, 6, 2, 32
    q, k, v = (rand(b, s, h, d, dtype=dtype, seed=30 + i) for i in range(3))
    out = flash_attn_func(q, k, v, softmax_scale=0.37, causal=True)
    check(out, ref_attention(q, k, v, scale=0.37, keep=flash_keep(s, s, True)), dtype)
    default = flash_attn_func(q, k, v, causal=True)
    assert not torch.allclose(out.float(), default.float(), atol=1e-3)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_return_attn_probs(causal):
    b, sq, sk, h, d = 2, 5, 7, 4, 16
    q = rand(b, sq, h, d, seed=40)
    k = rand(b, sk, 2, d, seed=41)
    v = rand(b, sk, 2, d, seed=42)
    res = flash_attn_func(q, k, v, causal=causal, softcap=5.0, return_attn_probs=True)
    assert isinstance(res, tuple) and len(res) == 3
    out, lse, s_dmask = res
    assert s_dmask is None
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    keep = flash_keep(sq, sk, causal)
    check(out, ref_attention(q, k, v, keep=keep, softcap=5.0), torch.float32)
    torch.testing.assert_close(lse.double(), ref_lse(q, k, keep=keep, softcap=5.0), **LSE_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_dropout(dtype):
    b, s, h, d = 2, 16, 2, 16
    q, k, v = (rand(b, s, h, d, dtype=dtype, seed=50 + i) for i in range(3))
    a = flash_attn_func(q, k, v, dropout_p=0.0, causal=True)
    c = flash_attn_func(q, k, v, dropout_p=0.0, causal=True)
    assert torch.equal(a, c)
    torch.manual_seed(0)
    d1 = flash_attn_func(q, k, v, dropout_p=0.5, causal=True)
    d2 = flash_attn_func(q, k, v, dropout_p=0.5, causal=True)
    assert d1.dtype == dtype and not torch.isnan(d1).any()
    assert not torch.allclose(d1.float(), a.float(), atol=1e-3)
    assert not torch.equal(d1, d2)
    # the explicit path (softcap) applies dropout too
    e = flash_attn_func(q, k, v, dropout_p=0.5, softcap=4.0)
    f = flash_attn_func(q, k, v, dropout_p=0.0, softcap=4.0)
    assert not torch.allclose(e.float(), f.float(), atol=1e-3)


def test_flash_backward_matches_reference_and_has_no_nan():
    b, sq, sk, h, d = 1, 6, 4, 4, 8
    q = rand(b, sq, h, d, seed=60).requires_grad_()
    k = rand(b, sk, 2, d, seed=61).requires_grad_()
    v = rand(b, sk, 2, d, seed=62).requires_grad_()
    for kwargs in ({"causal": True}, {"causal": True, "softcap": 3.0}):
        out = flash_attn_func(q, k, v, **kwargs)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = ref_attention(
            q64, k64, v64, keep=flash_keep(sq, sk, True), softcap=kwargs.get("softcap", 0.0)
        )
        ref_grads = torch.autograd.grad(ref.sum(), (q64, k64, v64))
        for g, rg in zip(grads, ref_grads, strict=True):
            assert not torch.isnan(g).any()
            torch.testing.assert_close(g.double(), rg, atol=1e-5, rtol=1e-5)


def test_flash_window_normalised_like_flash_attn():
    # flash-attn's C++ entry point turns window values >= seqlen_k into -1 (infinite) before
    # masking, so with Sq > Sk a right window of 3 over 2 keys masks nothing.
    q = rand(1, 6, 2, 8, seed=63)
    k = rand(1, 2, 2, 8, seed=64)
    v = rand(1, 2, 2, 8, seed=65)
    out = flash_attn_func(q, k, v, window_size=(-1, 3))
    check(out, ref_attention(q, k, v), torch.float32)


def test_flash_explicit_path_chunked(monkeypatch):
    import attnguard.fallback as fb

    monkeypatch.setattr(fb.sdpa, "_MANUAL_CHUNK_ELEMS", 40)
    b, sq, sk, h, d = 2, 7, 9, 2, 8
    q = rand(b, sq, h, d, seed=66)
    k = rand(b, sk, 1, d, seed=67)
    v = rand(b, sk, 1, d, seed=68)
    slopes = torch.tensor([0.2, 0.7])
    out, lse, _ = flash_attn_func(
        q, k, v, causal=True, softcap=3.0, alibi_slopes=slopes, return_attn_probs=True
    )
    keep, bias = flash_keep(sq, sk, True), alibi_ref_bias(slopes, sq, sk)
    check(out, ref_attention(q, k, v, keep=keep, bias=bias, softcap=3.0), torch.float32)
    ref_l = ref_lse(q, k, keep=keep, bias=bias, softcap=3.0)
    torch.testing.assert_close(lse.double(), ref_l, **LSE_TOL)


def test_flash_gqa_without_enable_gqa(monkeypatch):
    import attnguard.fallback as fb

    real = fb.sdpa.F.scaled_dot_product_attention

    def old_torch_sdpa(*args, **kwargs):
        if "enable_gqa" in kwargs:
            raise TypeError("unexpected keyword argument 'enable_gqa'")
        return real(*args, **kwargs)

    monkeypatch.setattr(fb.sdpa.F, "scaled_dot_product_attention", old_torch_sdpa)
    monkeypatch.setattr(fb.sdpa, "SDPA_TAKES_GQA", False)  # as read from torch 2.4's schema
    q = rand(2, 5, 6, 8, seed=69)
    k = rand(2, 5, 2, 8, seed=70)
    v = rand(2, 5, 2, 8, seed=71)
    out = flash_attn_func(q, k, v, causal=True)
    check(out, ref_attention(q, k, v, keep=flash_keep(5, 5, True)), torch.float32)


def test_flash_half_upcast_when_sdpa_rejects_dtype(monkeypatch):
    import attnguard.fallback as fb

    real = fb.sdpa.F.scaled_dot_product_attention

    def no_half_sdpa(q, k, v, **kwargs):
        if q.dtype in (torch.float16, torch.bfloat16):
            raise RuntimeError("no kernel for half on this device")
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(fb.sdpa.F, "scaled_dot_product_attention", no_half_sdpa)
    q, k, v = (rand(1, 6, 2, 16, dtype=torch.bfloat16, seed=72 + i) for i in range(3))
    out = flash_attn_func(q, k, v, causal=True)
    check(out, ref_attention(q, k, v, keep=flash_keep(6, 6, True)), torch.bfloat16)


# ------------------------------------------------------------------------------------------
# packed variants
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_qkvpacked(dtype):
    b, s, h, d = 2, 7, 3, 16
    qkv = rand(b, s, 3, h, d, dtype=dtype, seed=70)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(2, 0))
    q, k, v = qkv.unbind(2)
    check(out, ref_attention(q, k, v, keep=flash_keep(s, s, True, (2, 0))), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_kvpacked(dtype):
    b, sq, sk, h, hk, d = 2, 4, 9, 4, 2, 16
    q = rand(b, sq, h, d, dtype=dtype, seed=71)
    kv = rand(b, sk, 2, hk, d, dtype=dtype, seed=72)
    out = flash_attn_kvpacked_func(q, kv, causal=True, softmax_scale=0.2)
    k, v = kv.unbind(2)
    check(out, ref_attention(q, k, v, scale=0.2, keep=flash_keep(sq, sk, True)), dtype)


def test_flash_functions_table():
    expected = {
        "flash_attn_func": flash_attn_func,
        "flash_attn_varlen_func": flash_attn_varlen_func,
        "flash_attn_qkvpacked_func": flash_attn_qkvpacked_func,
        "flash_attn_kvpacked_func": flash_attn_kvpacked_func,
    }
    assert expected.items() <= FLASH_FUNCTIONS.items()  # and the twins added since
    assert {
        "flash_attn_varlen_qkvpacked_func",
        "flash_attn_varlen_kvpacked_func",
        "flash_attn_with_kvcache",
    } <= set(FLASH_FUNCTIONS)


# ------------------------------------------------------------------------------------------
# varlen
# ------------------------------------------------------------------------------------------


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_varlen_three_sequences(dtype, causal):
    lens = [5, 9, 3]
    h, hk, d = 4, 2, 16
    total = sum(lens)
    q = rand(total, h, d, dtype=dtype, seed=80)
    k = rand(total, hk, d, dtype=dtype, seed=81)
    v = rand(total, hk, d, dtype=dtype, seed=82)
    cu = _cu(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    assert out.shape == (total, h, d)
    starts = cu.tolist()
    for i, n in enumerate(lens):
        sl = slice(starts[i], starts[i + 1])
        ref = ref_attention(
            q[sl].unsqueeze(0),
            k[sl].unsqueeze(0),
            v[sl].unsqueeze(0),
            keep=flash_keep(n, n, causal),
        )
        check(out[sl], ref[0], dtype)

    # no leakage: changing sequence 2 leaves sequences 1 and 3 untouched
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    sl2 = slice(starts[1], starts[2])
    q2[sl2] = rand(lens[1], h, d, dtype=dtype, seed=90)
    k2[sl2] = rand(lens[1], hk, d, dtype=dtype, seed=91)
    v2[sl2] = rand(lens[1], hk, d, dtype=dtype, seed=92) * 10
    out2 = flash_attn_varlen_func(q2, k2, v2, cu, cu, max(lens), max(lens), causal=causal)
    assert torch.equal(out2[: starts[1]], out[: starts[1]])
    assert torch.equal(out2[starts[2] :], out[starts[2] :])
    assert not torch.allclose(out2[sl2].float(), out[sl2].float(), atol=1e-2)


def test_flash_varlen_different_q_k_lengths_alibi_window_lse():
    lens_q, lens_k = [2, 4, 1], [6, 4, 5]
    h, d = 2, 8
    q = rand(sum(lens_q), h, d, seed=100)
    k = rand(sum(lens_k), h, d, seed=101)
    v = rand(sum(lens_k), h, d, seed=102)
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
    slopes = torch.tensor([[0.3, 0.1], [0.2, 0.4], [0.5, 0.05]])
    for kwargs in (
        {"causal": True},
        {"causal": True, "alibi_slopes": slopes},
        {"window_size": (1, 1)},
        {"causal": True, "alibi_slopes": slopes[0], "softcap": 2.0},
    ):
        out, lse, _ = flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), return_attn_probs=True, **kwargs
        )
        plain = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kwargs)
        assert lse.shape == (h, sum(lens_q))
        torch.testing.assert_close(plain, out, atol=1e-5, rtol=1e-5)
        sq_, sk_ = cu_q.tolist(), cu_k.tolist()
        for i, (nq, nk) in enumerate(zip(lens_q, lens_k, strict=True)):
            qs, ks = slice(sq_[i], sq_[i + 1]), slice(sk_[i], sk_[i + 1])
            keep = flash_keep(
                nq, nk, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1))
            )
            bias = None
            if "alibi_slopes" in kwargs:
                s = kwargs["alibi_slopes"]
                bias = alibi_ref_bias(s[i] if s.dim() == 2 else s, nq, nk)
            args = (q[qs].unsqueeze(0), k[ks].unsqueeze(0))
            cap = kwargs.get("softcap", 0.0)
            ref = ref_attention(*args, v[ks].unsqueeze(0), keep=keep, bias=bias, softcap=cap)
            check(out[qs], ref[0], torch.float32)
            ref_l = ref_lse(*args, keep=keep, bias=bias, softcap=cap)[0]
            torch.testing.assert_close(lse[:, qs].double(), ref_l, **LSE_TOL)


def test_flash_varlen_paged_block_table():
    lens = [5, 3]
    h, d, page = 2, 8, 4
    q = rand(sum(lens), h, d, seed=110)
    k_flat = rand(sum(lens), h, d, seed=111)
    v_flat = rand(sum(lens), h, d, seed=112)
    # scatter each sequence's keys into pages 3,0 (seq 0) and 2 (seq 1) of a 4-page cache
    tables = [[3, 0], [2, 1]]
    k_cache = torch.zeros(4, page, h, d)
    v_cache = torch.zeros(4, page, h, d)
    starts = [0, 5]
    for i, n in enumerate(lens):
        for t in range(n):
            blk, off = tables[i][t // page], t % page
            k_cache[blk, off] = k_flat[starts[i] + t]
            v_cache[blk, off] = v_flat[starts[i] + t]
    cu = _cu(lens)
    block_table = torch.tensor(tables, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q, k_cache, v_cache, cu, cu, 5, 5, causal=True, block_table=block_table
    )
    ref = flash_attn_varlen_func(q, k_flat, v_flat, cu, cu, 5, 5, causal=True)
    torch.testing.assert_close(out, ref)


# ------------------------------------------------------------------------------------------
# xformers memory_efficient_attention
# ------------------------------------------------------------------------------------------


def xf_ref(q, k, v, *, scale=None, keep=None, bias=None):
    """Reference for [B, M, H, K] inputs."""
    return ref_attention(q, k, v, scale=scale, keep=keep, bias=bias)


@pytest.mark.parametrize("dtype", DTYPES)
def test_xformers_no_bias(dtype):
    b, mq, mk, h, kd = 2, 5, 7, 3, 16
    q = rand(b, mq, h, kd, dtype=dtype, seed=120)
    k = rand(b, mk, h, kd, dtype=dtype, seed=121)
    v = rand(b, mk, h, 24, dtype=dtype, seed=122)
    out = xformers_memory_efficient_attention(q, k, v)
    assert out.shape == (b, mq, h, 24)
    check(out, xf_ref(q, k, v), dtype)
    out = xformers_memory_efficient_attention(q, k, v, scale=0.3)
    check(out, xf_ref(q, k, v, scale=0.3), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_xformers_tensor_bias(dtype):
    b, mq, mk, h, kd = 2, 5, 7, 3, 16
    q = rand(b, mq, h, kd, dtype=dtype, seed=130)
    k = rand(b, mk, h, kd, dtype=dtype, seed=131)
    v = rand(b, mk, h, kd, dtype=dtype, seed=132)
    full = rand(b, h, mq, mk, seed=133).to(dtype)
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=full)
    check(out, xf_ref(q, k, v, bias=full), dtype)
    # broadcastable and stride-0 expanded biases
    small = rand(1, 1, mq, mk, seed=134).to(dtype)
    for bias in (small, small.expand(b, h, mq, mk)):
        out = xformers_memory_efficient_attention(q, k, v, attn_bias=bias)
        check(out, xf_ref(q, k, v, bias=small), dtype)
    # (B*H, Mq, Mk) layout
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=full.reshape(b * h, mq, mk))
    check(out, xf_ref(q, k, v, bias=full), dtype)
    # additive -inf mask
    neg = torch.zeros(b, h, mq, mk, dtype=dtype)
    neg[..., 3:] = float("-inf")
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=neg)
    keep = torch.zeros(mq, mk, dtype=torch.bool)
    keep[:, :3] = True
    check(out, xf_ref(q, k, v, keep=keep), dtype)


def test_xformers_output_dtype_and_dropout():
    q, k, v = (rand(2, 8, 2, 16, seed=140 + i) for i in range(3))
    out = xformers_memory_efficient_attention(q, k, v, output_dtype=torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, xf_ref(q, k, v), atol=2e-5, rtol=2e-5)
    a = xformers_memory_efficient_attention(q, k, v)
    assert torch.equal(a, xformers_memory_efficient_attention(q, k, v, p=0.0))
    dropped = xformers_memory_efficient_attention(q, k, v, p=0.5)
    assert not torch.isnan(dropped).any()
    assert not torch.allclose(dropped, a, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_xformers_3d_layout(dtype):
    b, mq, mk, kd = 3, 4, 6, 8
    q = rand(b, mq, kd, dtype=dtype, seed=150)
    k = rand(b, mk, kd, dtype=dtype, seed=151)
    v = rand(b, mk, kd, dtype=dtype, seed=152)
    out = xformers_memory_efficient_attention(q, k, v)
    assert out.shape == (b, mq, kd)
    ref = xf_ref(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2))[:, :, 0]
    check(out, ref, dtype)
    bias = rand(b, mq, mk, seed=153).to(dtype)
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=bias)
    ref = xf_ref(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), bias=bias.unsqueeze(1))
    check(out, ref[:, :, 0], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("expanded", [True, False])
def test_xformers_5d_grouped(dtype, expanded):
    b, mq, mk, g, h, kd = 2, 5, 6, 2, 3, 16
    q = rand(b, mq, g, h, kd, dtype=dtype, seed=160)
    if expanded:  # xformers' documented GQA form
        k = rand(b, mk, g, 1, kd, dtype=dtype, seed=161).expand(b, mk, g, h, kd)
        v = rand(b, mk, g, 1, kd, dtype=dtype, seed=162).expand(b, mk, g, h, kd)
    else:
        k = rand(b, mk, g, h, kd, dtype=dtype, seed=161)
        v = rand(b, mk, g, h, kd, dtype=dtype, seed=162)
    bias = rand(b, g, h, mq, mk, seed=163).to(dtype)
    for attn_bias in (None, bias):
        out = xformers_memory_efficient_attention(q, k, v, attn_bias=attn_bias)
        assert out.shape == (b, mq, g, h, kd)
        for gi in range(g):
            ref = xf_ref(
                q[:, :, gi],
                k[:, :, gi],
                v[:, :, gi],
                bias=None if attn_bias is None else bias[:, gi],
            )
            check(out[:, :, gi], ref, dtype)


def _xf_bias_mod():
    return pytest.importorskip("xformers.ops.fmha.attn_bias")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("mq", "mk"), [(6, 6), (3, 7)])
def test_xformers_lower_triangular(dtype, mq, mk):
    ab = _xf_bias_mod()
    b, h, kd = 2, 2, 16
    q = rand(b, mq, h, kd, dtype=dtype, seed=170)
    k = rand(b, mk, h, kd, dtype=dtype, seed=171)
    v = rand(b, mk, h, kd, dtype=dtype, seed=172)
    # xformers' LowerTriangularMask is top-left aligned: query i sees keys j <= i
    top_left = torch.tensor([[j <= i for j in range(mk)] for i in range(mq)])
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=ab.LowerTriangularMask())
    check(out, xf_ref(q, k, v, keep=top_left), dtype)
    bottom_right = torch.tensor([[j <= i + mk - mq for j in range(mk)] for i in range(mq)])
    out = xformers_memory_efficient_attention(
        q, k, v, attn_bias=ab.LowerTriangularFromBottomRightMask()
    )
    check(out, xf_ref(q, k, v, keep=bottom_right), dtype)
    # with an extra tensor bias (general materialize() path)
    extra = rand(b, h, mq, mk, seed=173).to(dtype)
    out = xformers_memory_efficient_attention(
        q, k, v, attn_bias=ab.LowerTriangularMaskWithTensorBias(extra)
    )
    check(out, xf_ref(q, k, v, keep=top_left, bias=extra), dtype)


def _block_keep(q_lens, k_lens, mode):
    """Block-diagonal keep mask by loops; mode: none | top_left | bottom_right."""
    tq, tk = sum(q_lens), sum(k_lens)
    keep = torch.zeros(tq, tk, dtype=torch.bool)
    qs = ks = 0
    for nq, nk in zip(q_lens, k_lens, strict=True):
        for i in range(nq):
            for j in range(nk):
                if mode == "none":
                    ok = True
                elif mode == "top_left":
                    ok = j <= i
                else:
                    ok = j <= i + nk - nq
                keep[qs + i, ks + j] = ok
        qs += nq
        ks += nk
    return keep


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("cls_name", "mode", "k_lens"),
    [
        ("BlockDiagonalMask", "none", None),
        ("BlockDiagonalMask", "none", [4, 2, 6]),
        ("BlockDiagonalCausalMask", "top_left", None),
        ("BlockDiagonalCausalMask", "top_left", [4, 6, 3]),
        ("BlockDiagonalCausalFromBottomRightMask", "bottom_right", [5, 6, 3]),
    ],
)
def test_xformers_block_diagonal(dtype, cls_name, mode, k_lens):
    ab = _xf_bias_mod()
    q_lens = [3, 5, 2]
    k_lens = k_lens or q_lens
    h, kd = 2, 16
    cls = getattr(ab, cls_name)
    bias = cls.from_seqlens(q_lens, k_lens if k_lens != q_lens else None)
    q = rand(1, sum(q_lens), h, kd, dtype=dtype, seed=180)
    k = rand(1, sum(k_lens), h, kd, dtype=dtype, seed=181)
    v = rand(1, sum(k_lens), h, kd, dtype=dtype, seed=182)
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=bias)
    keep = _block_keep(q_lens, k_lens, mode)
    check(out, xf_ref(q, k, v, keep=keep), dtype)
    # no leakage across blocks: perturb block 1 only
    k2, v2 = k.clone(), v.clone()
    k2[:, sum(k_lens[:1]) : sum(k_lens[:2])] += 3.0
    v2[:, sum(k_lens[:1]) : sum(k_lens[:2])] *= -2.0
    out2 = xformers_memory_efficient_attention(q, k2, v2, attn_bias=bias)
    assert torch.equal(out2[:, : q_lens[0]], out[:, : q_lens[0]])
    assert torch.equal(out2[:, sum(q_lens[:2]) :], out[:, sum(q_lens[:2]) :])


def test_xformers_padded_keys_general_path():
    ab = _xf_bias_mod()
    q_lens, pad, k_lens = [2, 3, 1], 5, [4, 3, 5]
    h, kd = 2, 8
    bias = ab.BlockDiagonalCausalWithOffsetPaddedKeysMask.from_seqlens(
        q_seqlen=q_lens, kv_padding=pad, kv_seqlen=k_lens
    )
    q = rand(1, sum(q_lens), h, kd, seed=190)
    k = rand(1, pad * len(k_lens), h, kd, seed=191)
    v = rand(1, pad * len(k_lens), h, kd, seed=192)
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=bias)
    keep = torch.zeros(sum(q_lens), pad * len(k_lens), dtype=torch.bool)
    qs = 0
    for bi, (nq, nk) in enumerate(zip(q_lens, k_lens, strict=True)):
        for i in range(nq):
            for j in range(nk):
                keep[qs + i, bi * pad + j] = j <= i + nk - nq
        qs += nq
    check(out, xf_ref(q, k, v, keep=keep), torch.float32)


def test_xformers_block_diagonal_5d_gqa():
    ab = _xf_bias_mod()
    lens = [4, 3]
    g, h, kd = 2, 2, 8
    bias = ab.BlockDiagonalCausalMask.from_seqlens(lens)
    m = sum(lens)
    q = rand(1, m, g, h, kd, seed=200)
    k = rand(1, m, g, 1, kd, seed=201).expand(1, m, g, h, kd)
    v = rand(1, m, g, 1, kd, seed=202).expand(1, m, g, h, kd)
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=bias)
    keep = _block_keep(lens, lens, "top_left")
    for gi in range(g):
        ref = xf_ref(q[:, :, gi], k[:, :, gi], v[:, :, gi], keep=keep)
        check(out[:, :, gi], ref, torch.float32)


# ------------------------------------------------------------------------------------------
# torch.compile: no graph breaks (a compiled model whose flash_attn / xformers call is carried
# by these stand-ins must also compile with fullgraph=True, where a break is an error)
# ------------------------------------------------------------------------------------------


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_whole(fn, *args):
    """Assert ``fn(*args)`` traces as one graph; return (compiled result, eager result).

    ``explain`` counts the breaks; ``fullgraph=True`` also catches data-dependent guards that
    explain may not count. The "eager" backend keeps it fast: Dynamo still captures the whole
    graph, only code generation is skipped, so compiled and eager run the same kernels.
    """
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    reasons = [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    assert explanation.graph_count == 1
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    return compiled(*args), fn(*args)


def assert_same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert not torch.isnan(g).any()
        assert torch.equal(g, w)


def _flash_call(**kwargs):
    def fn(q, k, v):
        return flash_attn_func(q, k, v, **kwargs)

    return fn


@pytest.mark.parametrize(
    ("sq", "sk", "hk", "kwargs"),
    [
        (3, 8, 4, {"causal": True}),  # decode with a KV cache: bottom-right causal mask
        (1, 8, 4, {"causal": True}),  # single-token decode: nothing masked
        (8, 8, 4, {"causal": True, "window_size": (3, -1)}),  # sliding window
        (3, 8, 4, {"window_size": (2, 1)}),
        (3, 8, 2, {"causal": True}),  # GQA
        (3, 8, 1, {"causal": True, "window_size": (4, 0)}),  # MQA + window
        (6, 3, 4, {"causal": True}),  # Sq > Sk: fully masked rows give zeros
        (6, 3, 2, {"causal": True, "return_attn_probs": True}),  # ... and lse +inf
        (3, 8, 4, {"causal": True, "alibi_slopes": torch.tensor([0.3, 0.1, 0.2, 0.05])}),
        (3, 8, 2, {"causal": True, "softcap": 5.0, "window_size": (2, 0)}),
    ],
)
def test_compile_flash_func_no_graph_break(dynamo_reset, sq, sk, hk, kwargs):
    q = rand(2, sq, 4, 16, seed=300)
    k = rand(2, sk, hk, 16, seed=301)
    v = rand(2, sk, hk, 16, seed=302)
    got, want = compile_whole(_flash_call(**kwargs), q, k, v)
    assert_same(got, want)
    out = want[0] if isinstance(want, tuple) else want
    keep = flash_keep(sq, sk, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)))
    empty = ~keep.any(dim=-1)
    assert torch.equal(out[:, empty], torch.zeros_like(out[:, empty]))
    if kwargs.get("return_attn_probs"):
        assert torch.isposinf(want[1][:, :, empty]).all()


def test_compile_flash_empty_rows_backward_has_no_nan(dynamo_reset):
    q = rand(1, 6, 4, 8, seed=310).requires_grad_()
    k = rand(1, 3, 2, 8, seed=311).requires_grad_()
    v = rand(1, 3, 2, 8, seed=312).requires_grad_()
    compiled = torch.compile(_flash_call(causal=True), backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v).square().sum(), (q, k, v))
    want = torch.autograd.grad(flash_attn_func(q, k, v, causal=True).square().sum(), (q, k, v))
    for g, w in zip(grads, want, strict=True):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w)


def _varlen_call(**kwargs):
    def fn(q, k, v, cu_q, cu_k, max_q, max_k):
        return flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)

    return fn


# Eager varlen splits the packed tensors at the cu_seqlens values: those are data, and reading
# them on the host is a graph break under torch.compile. The compiled trace instead gathers the
# sequences into a padded batch with index tensors (shapes from max_seqlen) and masks it per
# sequence, so it is one graph; it groups the arithmetic differently from the eager segments,
# hence assert_close rather than equality.
@pytest.mark.parametrize(
    ("lens_q", "lens_k", "kwargs"),
    [
        ([5, 9, 3], None, {"causal": True}),
        ([2, 4, 1], [6, 4, 5], {"causal": True, "window_size": (2, -1)}),
        ([4, 0, 3], [2, 3, 0], {"causal": True, "return_attn_probs": True}),  # empty rows/seqs
        ([2, 4, 1], [6, 4, 5], {"alibi_slopes": torch.rand(3, 4), "return_attn_probs": True}),
    ],
)
def test_compile_flash_varlen_no_graph_break(dynamo_reset, lens_q, lens_k, kwargs):
    lens_k = lens_k or lens_q
    q = rand(sum(lens_q), 4, 8, seed=320)
    k = rand(sum(lens_k), 2, 8, seed=321)
    v = rand(sum(lens_k), 2, 8, seed=322)
    args = (q, k, v, _cu(lens_q), _cu(lens_k), max(lens_q), max(lens_k))
    got, want = compile_whole(_varlen_call(**kwargs), *args)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got[:2], want[:2], strict=False):
        assert not torch.isnan(g).any()
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_compile_flash_varlen_paged_and_tensor_max_seqlen(dynamo_reset):
    lens, page, h, d = [5, 3], 4, 2, 8
    q = rand(sum(lens), h, d, seed=330)
    k_cache, v_cache = rand(4, page, h, d, seed=331), rand(4, page, h, d, seed=332)
    table = torch.tensor([[3, 0], [2, 1]], dtype=torch.int32)
    cu = _cu(lens)
    got, want = compile_whole(
        _varlen_call(causal=True, block_table=table), q, k_cache, v_cache, cu, cu, 5, 5
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # max_seqlen given as a tensor (as some transformers versions pass it): not readable in the
    # graph, so the packed length bounds the padding; same result.
    k, v = rand(sum(lens), h, d, seed=333), rand(sum(lens), h, d, seed=334)
    mx = torch.tensor(max(lens))
    fn = _varlen_call(causal=True, window_size=(2, -1))
    got, want = compile_whole(fn, q, k, v, cu, cu, mx, mx)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_flash_varlen_padded_path_matches_reference(monkeypatch):
    """The compile-time varlen formulation, run eagerly, against the float64 reference."""
    import attnguard.fallback as fb

    monkeypatch.setattr(fb.varlen, "compiling", lambda: True)
    test_flash_varlen_different_q_k_lengths_alibi_window_lse()
    test_flash_varlen_paged_block_table()
    # tokens before the first and after the last sequence give zeros and lse +inf
    q, k, v = rand(12, 2, 8, seed=340), rand(12, 2, 8, seed=341), rand(12, 2, 8, seed=342)
    cu = torch.tensor([2, 5, 9], dtype=torch.int32)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True, return_attn_probs=True)
    outside = torch.tensor([t < 2 or t >= 9 for t in range(12)])
    assert torch.equal(out[outside], torch.zeros_like(out[outside]))
    assert torch.isposinf(lse[:, outside]).all()
    monkeypatch.setattr(fb.varlen, "compiling", lambda: False)
    eager_out, eager_lse, _ = flash_attn_varlen_func(
        q, k, v, cu, cu, 4, 4, causal=True, return_attn_probs=True
    )
    torch.testing.assert_close(out, eager_out)
    torch.testing.assert_close(lse, eager_lse)


def _xf_call(bias):
    def fn(q, k, v):
        return xformers_memory_efficient_attention(q, k, v, attn_bias=bias)

    return fn


def test_compile_xformers_tensor_bias_no_graph_break(dynamo_reset):
    q, k, v = rand(2, 5, 3, 16, seed=350), rand(2, 7, 3, 16, seed=351), rand(2, 7, 3, 16, seed=352)
    bias = rand(2, 3, 5, 7, seed=353)

    def fn(q, k, v, bias):
        return xformers_memory_efficient_attention(q, k, v, attn_bias=bias)

    assert_same(*compile_whole(fn, q, k, v, bias))


@pytest.mark.parametrize(
    ("cls_name", "mq", "mk"),
    [
        ("LowerTriangularMask", 3, 7),
        ("LowerTriangularMask", 7, 7),
        ("LowerTriangularFromBottomRightMask", 3, 7),
        ("LowerTriangularFromBottomRightMask", 7, 3),  # rows with no key give zeros
    ],
)
def test_compile_xformers_lower_triangular_no_graph_break(dynamo_reset, cls_name, mq, mk):
    ab = _xf_bias_mod()
    q, k, v = (
        rand(2, mq, 3, 16, seed=360),
        rand(2, mk, 3, 16, seed=361),
        rand(2, mk, 3, 16, seed=362),
    )
    assert_same(*compile_whole(_xf_call(getattr(ab, cls_name)()), q, k, v))


@pytest.mark.parametrize(
    ("cls_name", "k_lens"),
    [
        ("BlockDiagonalMask", None),
        ("BlockDiagonalCausalMask", None),
        ("BlockDiagonalCausalFromBottomRightMask", [5, 6, 3]),
    ],
)
def test_compile_xformers_block_diagonal_no_graph_break(dynamo_reset, cls_name, k_lens):
    ab = _xf_bias_mod()
    q_lens = [3, 5, 2]
    bias = getattr(ab, cls_name).from_seqlens(q_lens, k_lens)
    mk = sum(k_lens or q_lens)
    q, k, v = (
        rand(1, 10, 2, 16, seed=370),
        rand(1, mk, 2, 16, seed=371),
        rand(1, mk, 2, 16, seed=372),
    )

    def fn(q, k, v, bias):  # the bias as an argument, as a model would pass it
        return xformers_memory_efficient_attention(q, k, v, attn_bias=bias)

    assert_same(*compile_whole(fn, q, k, v, bias))


def test_compile_xformers_materialized_bias_no_graph_break(dynamo_reset):
    ab = _xf_bias_mod()
    b, mq, mk, h = 1, 6, 4, 2
    extra = rand(b, h, mq, mk, seed=380)
    extra[:, :, 1] = float("-inf")  # a row the bias masks entirely: zeros, no NaN
    bias = ab.LowerTriangularMaskWithTensorBias(extra)
    q, k, v = rand(b, mq, h, 8, seed=381), rand(b, mk, h, 8, seed=382), rand(b, mk, h, 8, seed=383)
    try:  # the bias object itself, read in a compiled function, whatever function takes it
        torch.compile(lambda t: t + len(type(bias).__name__), backend="eager", fullgraph=True)(q)
    except Exception as exc:  # xformers 0.0.27's tensor-subclass biases under torch 2.4
        pytest.skip(
            f"this torch.compile cannot take xformers' {type(bias).__name__}: {exc!r}"[:300]
        )
    torch._dynamo.reset()
    got, want = compile_whole(_xf_call(bias), q, k, v)
    assert_same(got, want)
    assert torch.equal(want[:, 1], torch.zeros_like(want[:, 1]))


def test_band_mask_decisions_are_static_and_exact():
    """keep/empty are decided from ints; check them against masks built element by element."""
    import attnguard.fallback as fb

    for sq, sk in [(1, 1), (1, 4), (3, 5), (5, 3), (4, 4)]:
        for offset in range(-6, 7):
            for left in (-1, 0, 1, 3, 7):
                for right in (-1, 0, 1, 3, 7):
                    keep, empty = fb.masks.band_mask(
                        sq, sk, offset, left, right, torch.device("cpu")
                    )
                    want = torch.tensor(
                        [
                            [
                                (left < 0 or j >= i + offset - left)
                                and (right < 0 or j <= i + offset + right)
                                for j in range(sk)
                            ]
                            for i in range(sq)
                        ]
                    )
                    case = (sq, sk, offset, left, right)
                    if keep is None:
                        assert want.all(), case
                    else:
                        assert torch.equal(keep, want), case
                    if empty is None:
                        assert want.any(dim=-1).all(), case
                    else:
                        assert torch.equal(empty, ~want.any(dim=-1)), case
