"""The KV-cache twin in attnguard.fallback (flash_attn_with_kvcache), eagerly, in the formulation
it compiles to, and under torch.compile (one graph, no breaks); the packed-varlen and bert_padding
twins: tests/test_varlen_packed.py.

Every attention result is checked against a float64 reference written out by hand
(tests/helpers/kvcache.py: loops over sequences, heads and query rows; the mask rules spelled
out), never against the twins' own helpers. Caches are filled with fresh random values everywhere, so a key the kernel must not
see (past ``cache_seqlens``, before ``cache_leftpad``, in another sequence's row or page) would
change the result if the twin attended to it.
"""

from __future__ import annotations

import pytest
import torch
from helpers.kvcache import cache_inputs, check, ref_kvcache, run_both
from helpers.tensors import BF16, DTYPES, F16, F32, TOL, i32, one_graph, rand

import attnguard.fallback as fallback
from attnguard.fallback import flash_attn_func, flash_attn_with_kvcache

# ------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_decode_step_appends_per_sequence(dtype, causal):
    q, kc, vc, k, v = cache_inputs(dtype=dtype, seed=10)
    seqlens = i32([3, 7, 0])
    got, want = run_both(q, kc, vc, k, v, cache_seqlens=seqlens, causal=causal)
    check(got, want, dtype)
    # the new token landed at cache_seqlens[b]; every other slot is as it was
    _, _, kc2, vc2 = got
    for b, n in enumerate([3, 7, 0]):
        assert torch.equal(kc2[b, n], k[b, 0]) and torch.equal(vc2[b, n], v[b, 0])
        others = [j for j in range(12) if j != n]
        assert torch.equal(kc2[b, others], kc[b, others])
        assert torch.equal(vc2[b, others], vc[b, others])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kvcache_chunk_of_new_tokens_causal(dtype):
    q, kc, vc, k, v = cache_inputs(sq=4, sn=4, dtype=dtype, seed=20)
    got, want = run_both(q, kc, vc, k, v, cache_seqlens=i32([2, 5, 0]), causal=True)
    check(got, want, dtype)
    # bottom-right causal: the last query sees all 4 new tokens, the first only the first one
    out = got[0]
    k2 = k.clone()
    k2[:, 1:] = rand(3, 3, 2, 16, dtype=dtype, seed=29)  # later new keys change ...
    (out2, *_), _ = run_both(q, kc, vc, k2, v, cache_seqlens=i32([2, 5, 0]), causal=True)
    assert torch.equal(out2[:, 0], out[:, 0])  # ... nothing for query 0
    assert not torch.allclose(out2[:, 3].float(), out[:, 3].float(), atol=1e-2)


def test_kvcache_scalar_int_cache_seqlens():
    q, kc, vc, k, v = cache_inputs(sq=2, sn=2, seed=30)
    got, want = run_both(q, kc, vc, k, v, cache_seqlens=5, causal=True)
    check(got, want, F32)
    got_t, _ = run_both(q, kc, vc, k, v, cache_seqlens=i32([5, 5, 5]), causal=True)
    for a, b in zip(got, got_t, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kvcache_batch_idx_permutes_cache_rows(dtype):
    # 5 cache rows, a batch of 3 using rows 3, 0, 4: rows 1 and 2 are never read or written
    q, kc, vc, k, v = cache_inputs(sq=2, sn=2, dtype=dtype, seed=40, bc=5)
    idx = i32([3, 0, 4])
    got, want = run_both(
        q, kc, vc, k, v, cache_seqlens=i32([4, 1, 6]), cache_batch_idx=idx, causal=True
    )
    check(got, want, dtype)
    assert torch.equal(got[2][1:3], kc[1:3]) and torch.equal(got[3][1:3], vc[1:3])
    # the same call without the permutation reads other rows: a different result
    plain = flash_attn_with_kvcache(
        q, kc.clone(), vc.clone(), k, v, cache_seqlens=i32([4, 1, 6]), causal=True
    )
    assert not torch.allclose(plain.float(), got[0].float(), atol=1e-2)


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_leftpad_hides_keys_before_it(dtype, causal):
    q, kc, vc, k, v = cache_inputs(sq=2, sn=2, dtype=dtype, seed=50)
    kw = {"cache_seqlens": i32([6, 4, 9]), "cache_leftpad": i32([2, 0, 5]), "causal": causal}
    got, want = run_both(q, kc, vc, k, v, **kw)
    check(got, want, dtype)
    # rewriting the hidden slots (before leftpad) changes nothing
    kc2, vc2 = kc.clone(), vc.clone()
    kc2[0, :2], vc2[0, :2] = 7.0, -7.0
    kc2[2, :5], vc2[2, :5] = 7.0, -7.0
    (out2, *_), _ = run_both(q, kc2, vc2, k, v, **kw)
    assert torch.equal(out2, got[0])


def test_kvcache_leftpad_with_window_and_lse_of_empty_rows():
    # leftpad 6 with cache_seqlens 6 and one new token: a single visible key (position 6); a
    # window of 0 to the left leaves the earlier queries of a causal chunk with nothing to see
    q, kc, vc, k, v = cache_inputs(b=2, sq=3, sn=1, seed=55)
    kw = {
        "cache_seqlens": i32([6, 3]),
        "cache_leftpad": i32([6, 1]),
        "causal": True,
        "window_size": (0, 0),
    }
    got, want = run_both(q, kc, vc, k, v, **kw)
    assert torch.isinf(want[1]).any()
    check(got, want, F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kvcache_paged_shuffled_block_table(dtype):
    page, nblocks = 4, 9
    q, _, _, k, v = cache_inputs(sq=3, sn=3, dtype=dtype, seed=60)
    kc = rand(nblocks, page, 2, 16, dtype=dtype, seed=61)
    vc = rand(nblocks, page, 2, 16, dtype=dtype, seed=62)
    table = i32([[7, 2, 5], [0, 8, 3], [6, 1, 4]])  # 12 logical slots per sequence
    seqlens = i32([6, 0, 8])  # seq 0 appends across a page boundary: slots 6, 7 | 8
    got, want = run_both(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=table, causal=True)
    check(got, want, dtype)
    # written exactly where the table points: seq 0 slots 6, 7 are block 2 rows 2, 3 and
    # slot 8 is block 5 row 0
    assert torch.equal(got[2][2, 2:4], k[0, :2]) and torch.equal(got[2][5, 0], k[0, 2])
    # the paged result equals the contiguous-cache result on the same logical contents
    contig_k = torch.stack([kc[table[b].long()].flatten(0, 1) for b in range(3)])
    contig_v = torch.stack([vc[table[b].long()].flatten(0, 1) for b in range(3)])
    (out_c, lse_c, ck, _), _ = run_both(
        q, contig_k, contig_v, k, v, cache_seqlens=seqlens, causal=True
    )
    torch.testing.assert_close(got[0], out_c)
    torch.testing.assert_close(got[1], lse_c)
    assert torch.equal(torch.stack([got[2][table[b].long()].flatten(0, 1) for b in range(3)]), ck)


def test_kvcache_paged_append_into_a_new_page_and_window():
    page = 4
    q, _, _, k, v = cache_inputs(b=2, sq=2, sn=2, seed=65)
    kc, vc = rand(6, page, 2, 16, seed=66), rand(6, page, 2, 16, seed=67)
    table = i32([[4, 0], [2, 5]])
    got, want = run_both(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=i32([3, 6]),
        block_table=table,
        causal=True,
        window_size=(2, 0),
    )
    check(got, want, F32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_rotary(dtype, interleaved, causal):
    sc, d, rd = 12, 16, 8  # rotary on the first 8 of 16 channels
    q, kc, vc, k, v = cache_inputs(sq=3, sn=3, sc=sc, d=d, dtype=dtype, seed=70)
    angle = torch.arange(sc).double()[:, None] * (0.5 ** torch.arange(rd // 2).double())
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    kw = {
        "rotary_cos": cos,
        "rotary_sin": sin,
        "rotary_interleaved": interleaved,
        "cache_seqlens": i32([2, 5, 0]),
        "causal": causal,
    }
    got, want = run_both(q, kc, vc, k, v, **kw)
    check(got, want, dtype, exact_cache=False)
    # the rotation is real: channels past rotary_dim are stored as given, the first are not
    kc2 = got[2]
    assert torch.equal(kc2[1, 5:8, :, rd:], k[1, :, :, rd:])
    assert not torch.allclose(kc2[1, 6:8, :, :rd].float(), k[1, 1:, :, :rd].float(), atol=1e-2)


def test_kvcache_rotary_q_position_noncausal_vs_window():
    # Not causal, no window: every query rotated at cache_seqlens. A window makes the call
    # "local": queries at cache_seqlens + i. The reference spells out both; they differ.
    q, kc, vc, k, v = cache_inputs(sq=3, sn=3, seed=75)
    angle = torch.arange(12).double()[:, None] * (0.7 ** torch.arange(8).double())
    cos, sin = angle.cos().float(), angle.sin().float()
    base = {"rotary_cos": cos, "rotary_sin": sin, "cache_seqlens": i32([1, 4, 2])}
    got_a, want_a = run_both(q, kc, vc, k, v, **base)
    check(got_a, want_a, F32, exact_cache=False)
    got_b, want_b = run_both(q, kc, vc, k, v, window_size=(8, 8), **base)
    check(got_b, want_b, F32, exact_cache=False)
    assert not torch.allclose(got_a[0], got_b[0], atol=1e-3)


@pytest.mark.parametrize(
    ("causal", "window"), [(True, (2, -1)), (False, (2, 1)), (False, (-1, 0)), (True, (0, 0))]
)
def test_kvcache_window(causal, window):
    q, kc, vc, k, v = cache_inputs(sq=3, sn=3, seed=80)
    got, want = run_both(
        q, kc, vc, k, v, cache_seqlens=i32([4, 0, 8]), causal=causal, window_size=window
    )
    check(got, want, F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_softcap_and_scale(dtype, causal):
    q, kc, vc, k, v = cache_inputs(sq=2, sn=2, dtype=dtype, seed=90)
    q = q * 4  # large scores so the cap matters
    got, want = run_both(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=i32([4, 2, 7]),
        causal=causal,
        softcap=1.5,
        softmax_scale=0.4,
    )
    check(got, want, dtype)


@pytest.mark.parametrize("batched_slopes", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_kvcache_alibi(batched_slopes, causal):
    q, kc, vc, k, v = cache_inputs(sq=3, sn=3, seed=100)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    if batched_slopes:
        slopes = torch.stack([slopes, slopes * 2, slopes / 3])
    got, want = run_both(
        q,
        kc,
        vc,
        k,
        v,
        cache_seqlens=i32([2, 6, 0]),
        cache_leftpad=i32([1, 0, 0]),
        causal=causal,
        alibi_slopes=slopes,
    )
    check(got, want, F32)


@pytest.mark.parametrize("hk", [4, 2, 1])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_kvcache_gqa_mqa(hk, dtype):
    q, kc, vc, k, v = cache_inputs(h=4, hk=hk, sq=2, sn=2, dtype=dtype, seed=110)
    got, want = run_both(q, kc, vc, k, v, cache_seqlens=i32([3, 9, 1]), causal=True)
    check(got, want, dtype)


def test_kvcache_without_new_keys_and_without_seqlens():
    q, kc, vc, _, _ = cache_inputs(sq=2, seed=120)
    # attend to the first cache_seqlens[b] entries; the cache is left untouched
    got, want = run_both(q, kc, vc, cache_seqlens=i32([3, 12, 1]), causal=True)
    check(got, want, F32)
    assert torch.equal(got[2], kc) and torch.equal(got[3], vc)
    # no cache_seqlens: the whole cache is the key sequence (== flash_attn_func on it)
    got, want = run_both(q, kc, vc, causal=True)
    check(got, want, F32)
    torch.testing.assert_close(got[0], flash_attn_func(q, kc, vc, causal=True))
    # cache_seqlens 0 and nothing appended: every row empty -> zeros, lse +inf
    got, want = run_both(q, kc, vc, cache_seqlens=0)
    assert torch.isposinf(got[1]).all() and torch.equal(got[0], torch.zeros_like(got[0]))


def test_kvcache_causal_rows_before_the_cache_are_empty():
    # 4 queries, 1 key in sequence 0 and 3 in sequence 1: bottom-right causal leaves queries
    # 0..2 of sequence 0 and query 0 of sequence 1 with nothing to see
    q, kc, vc, k, v = cache_inputs(b=2, sq=4, sn=1, seed=130)
    got, want = run_both(q, kc, vc, k, v, cache_seqlens=i32([0, 2]), causal=True)
    empty = torch.tensor([[True, True, True, False], [True, False, False, False]])
    assert torch.equal(torch.isinf(want[1]), empty[:, None, :].expand(2, 4, 4))
    check(got, want, F32)


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_kvcache_all_options_together(dtype):
    # MQA, cache_batch_idx, leftpad, rotary, causal + window, softcap, ALiBi per sequence
    q, kc, vc, k, v = cache_inputs(h=4, hk=1, sq=3, sn=3, sc=16, dtype=dtype, seed=135, bc=4)
    angle = torch.arange(16).double()[:, None] * (0.6 ** torch.arange(8).double())
    kw = {
        "rotary_cos": angle.cos().to(dtype),
        "rotary_sin": angle.sin().to(dtype),
        "rotary_interleaved": False,
        "cache_seqlens": i32([5, 0, 12]),
        "cache_batch_idx": i32([2, 3, 0]),
        "cache_leftpad": i32([2, 0, 4]),
        "causal": True,
        "window_size": (6, 0),
        "softcap": 3.0,
        "alibi_slopes": torch.rand(3, 4),
    }
    got, want = run_both(q, kc, vc, k, v, **kw)
    check(got, want, dtype, exact_cache=False)


def _compile_case(case):
    """Inputs whose caches have room past the longest sequence: there the eager formulation
    (keys gathered up to the longest sequence) and the compiled one (the whole capacity)
    differ in shape."""
    if case == "all options":
        q, kc, vc, k, v = cache_inputs(h=4, hk=1, sq=3, sn=3, sc=16, seed=135, bc=4)
        angle = torch.arange(16).double()[:, None] * (0.6 ** torch.arange(8).double())
        kw = {
            "rotary_cos": angle.cos().float(),
            "rotary_sin": angle.sin().float(),
            "rotary_interleaved": False,
            "cache_seqlens": i32([5, 0, 9]),
            "cache_batch_idx": i32([2, 3, 0]),
            "cache_leftpad": i32([2, 0, 4]),
            "causal": True,
            "window_size": (6, 0),
            "softcap": 3.0,
            "alibi_slopes": torch.rand(3, 4, generator=torch.Generator().manual_seed(136)),
        }
        return (q, kc, vc, k, v), kw
    if case == "paged":
        q, _, _, k, v = cache_inputs(sq=3, sn=3, seed=60)
        kc, vc = rand(9, 4, 2, 16, seed=61), rand(9, 4, 2, 16, seed=62)
        table = i32([[7, 2, 5], [0, 8, 3], [6, 1, 4]])
        return (q, kc, vc, k, v), {"cache_seqlens": i32([6, 0, 5]), "block_table": table}
    if case == "leftpad and window":
        q, kc, vc, k, v = cache_inputs(b=2, sq=3, sn=1, seed=55)
        kw = {"cache_seqlens": i32([6, 3]), "cache_leftpad": i32([6, 1]), "window_size": (0, 0)}
        return (q, kc, vc, k, v), {**kw, "causal": True}
    q, kc, vc, _, _ = cache_inputs(sq=2, seed=120)  # no new keys
    return (q, kc, vc), {"cache_seqlens": i32([3, 9, 1]), "causal": True}


@pytest.mark.parametrize("case", ["all options", "paged", "leftpad and window", "no new keys"])
def test_kvcache_compile_formulation_matches_reference(monkeypatch, case):
    """Under compile the keys keep the full cache capacity (no host read of the lengths): that
    formulation, run eagerly, equals the float64 reference and the eager formulation."""
    args, kw = _compile_case(case)
    eager, want = run_both(*args, **kw)
    monkeypatch.setattr(fallback.kvcache, "compiling", lambda: True)
    compiled, again = run_both(*args, **kw)
    check(compiled, want, F32, exact_cache="rotary_cos" not in kw)
    for got, eager_got in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, eager_got, atol=1e-6, rtol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(want, again, strict=True))


def test_kvcache_argument_errors():
    q, kc, vc, k, v = cache_inputs(seed=140)
    seqlens = i32([1, 1, 1])
    with pytest.raises(ValueError, match="value must also be passed"):
        flash_attn_with_kvcache(q, kc, vc, k, None, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="seqlens_k must also be passed"):
        flash_attn_with_kvcache(q, kc, vc, k, v)
    cos = torch.ones(12, 4)
    with pytest.raises(ValueError, match="new key / value"):
        flash_attn_with_kvcache(q, kc, vc, rotary_cos=cos, rotary_sin=cos, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="at least the seqlen of KV cache"):
        flash_attn_with_kvcache(
            q, kc, vc, k, v, rotary_cos=cos[:5], rotary_sin=cos[:5], cache_seqlens=seqlens
        )
    table = i32([[0], [1], [2]])
    with pytest.raises(ValueError, match="does not support cache_batch_idx"):
        flash_attn_with_kvcache(q, kc, vc, block_table=table, cache_batch_idx=i32([0, 1, 2]))
    with pytest.raises(ValueError, match="leftpad_k"):
        flash_attn_with_kvcache(q, kc, vc, block_table=table, cache_leftpad=i32([0, 0, 0]))
    with pytest.raises(ValueError, match="must divide query heads"):
        flash_attn_with_kvcache(rand(3, 1, 3, 16), kc, vc, cache_seqlens=seqlens)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, alibi_slopes=torch.ones(3))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"causal": True},
        {"causal": True, "window_size": (3, 0), "softcap": 2.0, "return_softmax_lse": True},
        {"cache_leftpad": i32([1, 0, 2]), "alibi_slopes": torch.rand(4)},
        {"rotary": True, "causal": True, "return_softmax_lse": True},
    ],
)
def test_compile_kvcache_no_graph_break(dynamo_reset, kwargs):
    kwargs = dict(kwargs)
    q, kc, vc, k, v = cache_inputs(sq=2, sn=2, seed=410)
    if kwargs.pop("rotary", False):
        angle = torch.arange(12).double()[:, None] * (0.5 ** torch.arange(8).double())
        kwargs.update(rotary_cos=angle.cos().float(), rotary_sin=angle.sin().float())
    seqlens = i32([3, 0, 7])

    def fn(q, kc, vc, k, v, seqlens):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens, **kwargs)

    compiled = one_graph(fn, q, kc.clone(), vc.clone(), k, v, seqlens)
    kc_c, vc_c, kc_e, vc_e = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = compiled(q, kc_c, vc_c, k, v, seqlens)
    want = fn(q, kc_e, vc_e, k, v, seqlens)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
    # the in-place append happens in the compiled call too
    assert torch.equal(kc_c, kc_e) and torch.equal(vc_c, vc_e)
    assert not torch.equal(kc_c, kc)


def test_compile_kvcache_paged_scalar_seqlens(dynamo_reset):
    q, _, _, k, v = cache_inputs(sq=1, sn=1, seed=420)
    kc, vc = rand(9, 4, 2, 16, seed=421), rand(9, 4, 2, 16, seed=422)
    table = i32([[7, 2, 5], [0, 8, 3], [6, 1, 4]])

    def fn(q, kc, vc, k, v, table):
        return flash_attn_with_kvcache(q, kc, vc, k, v, cache_seqlens=6, block_table=table)

    compiled = one_graph(fn, q, kc.clone(), vc.clone(), k, v, table)
    kc_c, vc_c = kc.clone(), vc.clone()
    got = compiled(q, kc_c, vc_c, k, v, table)
    want = ref_kvcache(q, kc, vc, k, v, cache_seqlens=6, block_table=table)
    torch.testing.assert_close(got.double(), want[0], **TOL[F32])
    assert torch.equal(kc_c, want[2]) and torch.equal(vc_c, want[3])
