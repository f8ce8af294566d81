"""attnguard.fallback's flash_attn_func twin and its packed variants, checked against an explicit
float64 reference (tests/helpers/tensors.py), eagerly and under torch.compile (one graph, no
breaks). The varlen twin: tests/test_fallback_varlen.py; xformers': tests/test_fallback_xformers.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers.tensors import (
    DTYPES,
    LSE_TOL,
    alibi_ref_bias,
    assert_same,
    check,
    compile_whole,
    flash_keep,
    rand,
    ref_lse,
    reference,
)

from attnguard.fallback import (
    FLASH_FUNCTIONS,
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
)

# ------------------------------------------------------------------------------------------
# flash_attn_func
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_square(dtype, causal):
    b, s, h, d = 2, 9, 4, 16
    q, k, v = (rand(b, s, h, d, dtype=dtype, seed=i) for i in range(3))
    out = flash_attn_func(q, k, v, causal=causal)
    check(out, reference(q, k, v, keep=flash_keep(s, s, causal)), dtype)
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
    check(out, reference(q, k, v, keep=keep), dtype)
    # top-left alignment would give a different answer
    top_left = torch.ones(sq, sk, dtype=torch.bool).tril()
    assert not torch.allclose(out.double(), reference(q, k, v, keep=top_left), atol=1e-2)


def test_flash_causal_sq_gt_sk_empty_rows_are_zero():
    b, sq, sk, h, d = 1, 6, 3, 2, 8
    q = rand(b, sq, h, d, seed=1)
    k = rand(b, sk, h, d, seed=2)
    v = rand(b, sk, h, d, seed=3)
    out = flash_attn_func(q, k, v, causal=True)
    keep = flash_keep(sq, sk, causal=True)
    assert not keep[:3].any()
    check(out, reference(q, k, v, keep=keep), torch.float32)
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
    check(out, reference(q, k, v, keep=flash_keep(sq, sk, causal, window)), dtype)


@pytest.mark.parametrize("hk", [2, 1])  # GQA, MQA
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_gqa_mqa(hk, causal, dtype):
    b, sq, sk, h, d = 2, 5, 7, 8, 16
    q = rand(b, sq, h, d, dtype=dtype, seed=7)
    k = rand(b, sk, hk, d, dtype=dtype, seed=8)
    v = rand(b, sk, hk, d, dtype=dtype, seed=9)
    out = flash_attn_func(q, k, v, causal=causal)
    check(out, reference(q, k, v, keep=flash_keep(sq, sk, causal)), dtype)
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
    ref = reference(q, k, v, keep=flash_keep(s, s, causal), softcap=2.0)
    check(out, ref, dtype)
    plain = reference(q, k, v, keep=flash_keep(s, s, causal))
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
    check(out, reference(q, k, v, keep=flash_keep(sq, sk, causal), bias=bias), dtype)
    # alibi with softcap goes through the explicit path: bias added after softcapping
    out = flash_attn_func(q, k, v, causal=causal, alibi_slopes=slopes, softcap=3.0)
    ref = reference(q, k, v, keep=flash_keep(sq, sk, causal), bias=bias, softcap=3.0)
    check(out, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_softmax_scale(dtype):
    b, s, h, d = 1, 6, 2, 32
    q, k, v = (rand(b, s, h, d, dtype=dtype, seed=30 + i) for i in range(3))
    out = flash_attn_func(q, k, v, softmax_scale=0.37, causal=True)
    check(out, reference(q, k, v, scale=0.37, keep=flash_keep(s, s, True)), dtype)
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
    check(out, reference(q, k, v, keep=keep, softcap=5.0), torch.float32)
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
        ref = reference(
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
    check(out, reference(q, k, v), torch.float32)


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
    check(out, reference(q, k, v, keep=keep, bias=bias, softcap=3.0), torch.float32)
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
    check(out, reference(q, k, v, keep=flash_keep(5, 5, True)), torch.float32)


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
    check(out, reference(q, k, v, keep=flash_keep(6, 6, True)), torch.bfloat16)


# ------------------------------------------------------------------------------------------
# packed variants
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_qkvpacked(dtype):
    b, s, h, d = 2, 7, 3, 16
    qkv = rand(b, s, 3, h, d, dtype=dtype, seed=70)
    out = flash_attn_qkvpacked_func(qkv, causal=True, window_size=(2, 0))
    q, k, v = qkv.unbind(2)
    check(out, reference(q, k, v, keep=flash_keep(s, s, True, (2, 0))), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_flash_kvpacked(dtype):
    b, sq, sk, h, hk, d = 2, 4, 9, 4, 2, 16
    q = rand(b, sq, h, d, dtype=dtype, seed=71)
    kv = rand(b, sk, 2, hk, d, dtype=dtype, seed=72)
    out = flash_attn_kvpacked_func(q, kv, causal=True, softmax_scale=0.2)
    k, v = kv.unbind(2)
    check(out, reference(q, k, v, scale=0.2, keep=flash_keep(sq, sk, True)), dtype)


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
# torch.compile: no graph breaks (a compiled model whose flash_attn call is carried by the twin
# must also compile with fullgraph=True, where a break is an error)
# ------------------------------------------------------------------------------------------


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
