"""The packed-varlen and bert_padding twins in attnguard.fallback: flash_attn_varlen_qkvpacked_func
and flash_attn_varlen_kvpacked_func equal the unpacked varlen twin (itself checked against a
float64 reference written out here), unpad_input / pad_input / index_first_axis round trips,
their place in the twins' table, and each of them under torch.compile (one graph, no breaks).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tensors import BF16, F32, TOL, cu_seqlens, one_graph, rand

import attnguard.fallback as fallback
from attnguard.fallback import (
    FLASH_FUNCTIONS,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    index_first_axis,
    pad_input,
    unpad_input,
)

# ------------------------------------------------------------------------------------------
# packed varlen
# ------------------------------------------------------------------------------------------


VARLEN_KWARGS = [
    {},
    {"causal": True},
    {"causal": True, "window_size": (2, 0), "return_attn_probs": True},
    {"softcap": 2.0, "softmax_scale": 0.3, "return_attn_probs": True},
    {"alibi_slopes": torch.tensor([0.3, 0.1, 0.2, 0.05]), "causal": True},
]


@pytest.mark.parametrize("kwargs", VARLEN_KWARGS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_varlen_qkvpacked_equals_unpacked(kwargs, dtype):
    lens = [5, 1, 7, 3]
    qkv = rand(sum(lens), 3, 4, 16, dtype=dtype, seed=200)
    cu = cu_seqlens(lens)
    got = flash_attn_varlen_qkvpacked_func(qkv, cu, max(lens), **kwargs)
    q, k, v = qkv.unbind(1)
    want = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), **kwargs)
    if kwargs.get("return_attn_probs"):
        assert len(got) == 3 and got[2] is None
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    else:
        assert torch.equal(got, want)
        # and the unpacked twin is right: sequence 2 (7 tokens) on its own, float64 reference
        s = slice(6, 13)
        ref = ref_dense(q[s], k[s], v[s], kwargs)
        torch.testing.assert_close(got[s].double(), ref, **TOL[dtype])


def ref_dense(q, k, v, kwargs):
    """float64 attention of one sequence (S, H, D), causal/ALiBi bottom-right as flash-attn."""
    q, k, v = q.double(), k.double(), v.double()
    s_, h, d = q.shape
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    scale = kwargs.get("softmax_scale", 1 / math.sqrt(d))
    out = torch.zeros_like(q)
    for hh in range(h):
        for i in range(s_):
            s = k[:, hh] @ q[i, hh] * scale
            j = torch.arange(s_)
            if "alibi_slopes" in kwargs:
                s = s - float(kwargs["alibi_slopes"][hh]) * (i - j).abs().double()
            if kwargs.get("causal"):
                s = s.masked_fill(j > i, -math.inf)
            out[i, hh] = torch.softmax(s, -1) @ v[:, hh]
    return out


@pytest.mark.parametrize("kwargs", VARLEN_KWARGS)
def test_varlen_kvpacked_equals_unpacked(kwargs):
    lens_q, lens_k = [2, 4, 1], [6, 4, 5]
    q = rand(sum(lens_q), 4, 16, seed=210)
    kv = rand(sum(lens_k), 2, 2, 16, seed=211)  # GQA: 2 kv heads
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
    got = flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lens_q), max(lens_k), **kwargs)
    k, v = kv.unbind(1)
    want = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), **kwargs)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert (g is None and w is None) or torch.equal(g, w)


def test_varlen_packed_shape_errors():
    with pytest.raises(ValueError, match=r"\(total, 3, nheads, headdim\)"):
        flash_attn_varlen_qkvpacked_func(rand(6, 2, 4, 8), cu_seqlens([6]), 6)
    with pytest.raises(ValueError, match=r"\(total_k, 2, nheads_k, headdim\)"):
        flash_attn_varlen_kvpacked_func(
            rand(6, 4, 8), rand(6, 4, 8), cu_seqlens([6]), cu_seqlens([6]), 6, 6
        )


# ------------------------------------------------------------------------------------------
# bert_padding
# ------------------------------------------------------------------------------------------


def test_unpad_pad_round_trip():
    x = rand(3, 5, 4, 2, seed=300)  # (batch, seqlen, ...) with trailing dims kept
    mask = torch.tensor(
        [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.int64
    )  # seq 2 is left-padded
    got = unpad_input(x, mask)
    assert len(got) == 5
    hs, indices, cu, max_len, used = got
    want_idx = [0, 1, 2, 5, 6, 7, 8, 9, 11, 12]
    assert indices.tolist() == want_idx
    assert torch.equal(hs, x.reshape(15, 4, 2)[want_idx])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 8, 10]
    assert isinstance(max_len, int) and max_len == 5
    assert used.dtype == torch.int32 and used.tolist() == [3, 5, 2]
    back = pad_input(hs, indices, 3, 5)
    assert back.shape == x.shape
    assert torch.equal(back, x * mask[:, :, None, None])


def test_unpad_input_unused_mask():
    x = rand(2, 4, 3, seed=310)
    mask = torch.tensor([[True, True, False, False], [True, False, False, False]])
    unused = torch.tensor([[False, False, True, False], [False, True, True, False]])
    hs, indices, cu, max_len, used = unpad_input(x, mask, unused)
    assert indices.tolist() == [0, 1, 2, 4, 5, 6]  # allocated-but-unused slots are selected
    assert torch.equal(hs, x.reshape(8, 3)[[0, 1, 2, 4, 5, 6]])
    assert cu.tolist() == [0, 3, 6] and max_len == 3
    assert used.tolist() == [2, 1]  # ... but not counted as used


def test_index_first_axis_and_pad_input_backward():
    x = rand(6, 3, seed=320).requires_grad_()
    idx = torch.tensor([4, 0, 5])
    y = index_first_axis(x, idx)
    assert torch.equal(y, x.detach()[[4, 0, 5]])
    (y * torch.tensor([1.0, 2.0, 3.0])[:, None]).sum().backward()
    want = torch.zeros(6, 3)
    want[4], want[0], want[5] = 1.0, 2.0, 3.0
    assert torch.equal(x.grad, want)
    h = rand(3, 2, seed=321).requires_grad_()
    padded = pad_input(h, idx, 2, 3)
    assert torch.equal(padded.reshape(6, 2)[[4, 0, 5]], h.detach())
    assert torch.equal(padded.reshape(6, 2)[[1, 2, 3]], torch.zeros(3, 2))
    padded.sum().backward()
    assert torch.equal(h.grad, torch.ones(3, 2))
    with pytest.raises(ValueError, match="at least 2 dims"):
        index_first_axis(torch.arange(4.0), idx[:1])


def test_unpad_varlen_pad_equals_padded_attention():
    """The transformers flash path on the twins: unpad, varlen, pad == masked dense attention."""
    b, s, h, d = 3, 6, 2, 8
    lens = [6, 3, 1]
    mask = torch.tensor([[1] * n + [0] * (s - n) for n in lens])
    q, k, v = (rand(b, s, h, d, seed=330 + i) for i in range(3))
    qu, idx, cu, mx, _ = unpad_input(q, mask)
    ku, _, _, _, _ = unpad_input(k, mask)
    vu, _, _, _, _ = unpad_input(v, mask)
    out = pad_input(flash_attn_varlen_func(qu, ku, vu, cu, cu, mx, mx, causal=True), idx, b, s)
    for bi, n in enumerate(lens):
        ref = ref_dense(q[bi, :n], k[bi, :n], v[bi, :n], {"causal": True})
        torch.testing.assert_close(out[bi, :n].double(), ref, **TOL[F32])
        assert torch.equal(out[bi, n:], torch.zeros(s - n, h, d))


# ------------------------------------------------------------------------------------------
# registry and torch.compile
# ------------------------------------------------------------------------------------------


def test_new_functions_in_table_and_all():
    new = {
        "flash_attn_varlen_qkvpacked_func": flash_attn_varlen_qkvpacked_func,
        "flash_attn_varlen_kvpacked_func": flash_attn_varlen_kvpacked_func,
        "flash_attn_with_kvcache": flash_attn_with_kvcache,
        "index_first_axis": index_first_axis,
        "unpad_input": unpad_input,
        "pad_input": pad_input,
    }
    for name, fn in new.items():
        assert FLASH_FUNCTIONS[name] is fn
        assert name in fallback.__all__


@pytest.mark.parametrize(
    "kwargs", [{"causal": True}, {"causal": True, "window_size": (2, 0), "return_attn_probs": True}]
)
def test_compile_varlen_packed_no_graph_break(dynamo_reset, kwargs):
    lens = [5, 1, 7]
    qkv = rand(sum(lens), 3, 4, 8, seed=400)
    cu = cu_seqlens(lens)

    def packed(qkv, cu):
        return flash_attn_varlen_qkvpacked_func(qkv, cu, 7, **kwargs)

    got = one_graph(packed, qkv, cu)(qkv, cu)
    want = packed(qkv, cu)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got[:2], want[:2], strict=False):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)

    q, kv = qkv[:, 0], qkv[:, 1:]

    def kvpacked(q, kv, cu):
        return flash_attn_varlen_kvpacked_func(q, kv, cu, cu, 7, 7, **kwargs)

    got = one_graph(kvpacked, q, kv, cu)(q, kv, cu)
    got = got if isinstance(got, tuple) else (got,)
    for g, w in zip(got[:2], want[:2], strict=False):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_compile_pad_and_index_first_axis_no_graph_break(dynamo_reset):
    x = rand(4, 5, 3, seed=430)
    idx = torch.tensor([0, 1, 2, 5, 6, 11])

    def fn(x, idx):
        rows = index_first_axis(x.flatten(0, 1), idx)
        return pad_input(rows * 2, idx, 4, 5)

    got = one_graph(fn, x, idx)(x, idx)
    assert torch.equal(got, fn(x, idx))
