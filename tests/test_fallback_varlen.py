"""attnguard.fallback's flash_attn_varlen_func twin (packed sequences, different query and key
lengths, paged caches) checked against an explicit float64 reference (tests/helpers/tensors.py),
eagerly, in the formulation it compiles to, and under torch.compile (one graph, no breaks).
"""

from __future__ import annotations

import pytest
import torch
from helpers.tensors import (
    DTYPES,
    LSE_TOL,
    alibi_ref_bias,
    check,
    compile_whole,
    cu_seqlens,
    flash_keep,
    rand,
    ref_lse,
    reference,
)

from attnguard.fallback import flash_attn_varlen_func

# ------------------------------------------------------------------------------------------
# varlen
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_flash_varlen_three_sequences(dtype, causal):
    lens = [5, 9, 3]
    h, hk, d = 4, 2, 16
    total = sum(lens)
    q = rand(total, h, d, dtype=dtype, seed=80)
    k = rand(total, hk, d, dtype=dtype, seed=81)
    v = rand(total, hk, d, dtype=dtype, seed=82)
    cu = cu_seqlens(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=causal)
    assert out.shape == (total, h, d)
    starts = cu.tolist()
    for i, n in enumerate(lens):
        sl = slice(starts[i], starts[i + 1])
        ref = reference(
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
    cu_q, cu_k = cu_seqlens(lens_q), cu_seqlens(lens_k)
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
            ref = reference(*args, v[ks].unsqueeze(0), keep=keep, bias=bias, softcap=cap)
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
    cu = cu_seqlens(lens)
    block_table = torch.tensor(tables, dtype=torch.int32)
    out = flash_attn_varlen_func(
        q, k_cache, v_cache, cu, cu, 5, 5, causal=True, block_table=block_table
    )
    ref = flash_attn_varlen_func(q, k_flat, v_flat, cu, cu, 5, 5, causal=True)
    torch.testing.assert_close(out, ref)


# ------------------------------------------------------------------------------------------
# torch.compile: no graph breaks
# ------------------------------------------------------------------------------------------


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
    args = (q, k, v, cu_seqlens(lens_q), cu_seqlens(lens_k), max(lens_q), max(lens_k))
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
    cu = cu_seqlens(lens)
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
