"""attnguard.fallback's xformers memory_efficient_attention twin (every bias xformers has, its
3D, 4D and grouped 5D layouts) checked against an explicit float64 reference
(tests/helpers/tensors.py), eagerly and under torch.compile (one graph, no breaks).
"""

from __future__ import annotations

import pytest
import torch
from helpers.tensors import DTYPES, assert_same, check, compile_whole, rand, reference

from attnguard.fallback import xformers_memory_efficient_attention

# ------------------------------------------------------------------------------------------
# xformers memory_efficient_attention
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_xformers_no_bias(dtype):
    b, mq, mk, h, kd = 2, 5, 7, 3, 16
    q = rand(b, mq, h, kd, dtype=dtype, seed=120)
    k = rand(b, mk, h, kd, dtype=dtype, seed=121)
    v = rand(b, mk, h, 24, dtype=dtype, seed=122)
    out = xformers_memory_efficient_attention(q, k, v)
    assert out.shape == (b, mq, h, 24)
    check(out, reference(q, k, v), dtype)
    out = xformers_memory_efficient_attention(q, k, v, scale=0.3)
    check(out, reference(q, k, v, scale=0.3), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_xformers_tensor_bias(dtype):
    b, mq, mk, h, kd = 2, 5, 7, 3, 16
    q = rand(b, mq, h, kd, dtype=dtype, seed=130)
    k = rand(b, mk, h, kd, dtype=dtype, seed=131)
    v = rand(b, mk, h, kd, dtype=dtype, seed=132)
    full = rand(b, h, mq, mk, seed=133).to(dtype)
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=full)
    check(out, reference(q, k, v, bias=full), dtype)
    # broadcastable and stride-0 expanded biases
    small = rand(1, 1, mq, mk, seed=134).to(dtype)
    for bias in (small, small.expand(b, h, mq, mk)):
        out = xformers_memory_efficient_attention(q, k, v, attn_bias=bias)
        check(out, reference(q, k, v, bias=small), dtype)
    # (B*H, Mq, Mk) layout
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=full.reshape(b * h, mq, mk))
    check(out, reference(q, k, v, bias=full), dtype)
    # additive -inf mask
    neg = torch.zeros(b, h, mq, mk, dtype=dtype)
    neg[..., 3:] = float("-inf")
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=neg)
    keep = torch.zeros(mq, mk, dtype=torch.bool)
    keep[:, :3] = True
    check(out, reference(q, k, v, keep=keep), dtype)


def test_xformers_output_dtype_and_dropout():
    q, k, v = (rand(2, 8, 2, 16, seed=140 + i) for i in range(3))
    out = xformers_memory_efficient_attention(q, k, v, output_dtype=torch.float64)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, reference(q, k, v), atol=2e-5, rtol=2e-5)
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
    ref = reference(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2))[:, :, 0]
    check(out, ref, dtype)
    bias = rand(b, mq, mk, seed=153).to(dtype)
    out = xformers_memory_efficient_attention(q, k, v, attn_bias=bias)
    ref = reference(q.unsqueeze(2), k.unsqueeze(2), v.unsqueeze(2), bias=bias.unsqueeze(1))
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
            ref = reference(
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
    check(out, reference(q, k, v, keep=top_left), dtype)
    bottom_right = torch.tensor([[j <= i + mk - mq for j in range(mk)] for i in range(mq)])
    out = xformers_memory_efficient_attention(
        q, k, v, attn_bias=ab.LowerTriangularFromBottomRightMask()
    )
    check(out, reference(q, k, v, keep=bottom_right), dtype)
    # with an extra tensor bias (general materialize() path)
    extra = rand(b, h, mq, mk, seed=173).to(dtype)
    out = xformers_memory_efficient_attention(
        q, k, v, attn_bias=ab.LowerTriangularMaskWithTensorBias(extra)
    )
    check(out, reference(q, k, v, keep=top_left, bias=extra), dtype)


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
    check(out, reference(q, k, v, keep=keep), dtype)
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
    check(out, reference(q, k, v, keep=keep), torch.float32)


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
        ref = reference(q[:, :, gi], k[:, :, gi], v[:, :, gi], keep=keep)
        check(out[:, :, gi], ref, torch.float32)


# ------------------------------------------------------------------------------------------
# torch.compile: no graph breaks
# ------------------------------------------------------------------------------------------


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
