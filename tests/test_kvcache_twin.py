"""Tests for the KV-cache, packed-varlen and bert_padding twins in attnguard.fallback.

Every attention result is checked against a float64 reference written out here by hand (loops
over sequences, heads and query rows; the mask rules spelled out), never against the twins'
own helpers. Caches are filled with fresh random values everywhere, so a key the kernel must not
see (past ``cache_seqlens``, before ``cache_leftpad``, in another sequence's row or page) would
change the result if the twin attended to it.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnguard.fallback as fallback
from attnguard.fallback import (
    FLASH_FUNCTIONS,
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    index_first_axis,
    pad_input,
    unpad_input,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TOL = {
    F32: {"atol": 2e-5, "rtol": 2e-5},
    F16: {"atol": 3e-3, "rtol": 3e-3},
    BF16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = [F32, BF16, F16]
LSE_TOL = {"atol": 1e-5, "rtol": 1e-5}  # softmax_lse is float32


def rand(*shape, dtype=F32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# ------------------------------------------------------------------------------------------
# float64 reference for flash_attn_with_kvcache, written out by hand
# ------------------------------------------------------------------------------------------


def rope_ref(x, pos, cos, sin, interleaved):
    """Rotate one (D,) vector by row ``pos`` of cos/sin (seqlen_ro, rotary_dim / 2), float64.

    Interleaved pairs channels (2m, 2m + 1); otherwise (m, m + rotary_dim / 2). Channels past
    rotary_dim are copied unchanged.
    """
    x = x.double()
    out = x.clone()
    c, s = cos[pos].double(), sin[pos].double()
    half = c.shape[0]
    for m in range(half):
        a, b = (2 * m, 2 * m + 1) if interleaved else (m, m + half)
        out[a] = x[a] * c[m] - x[b] * s[m]
        out[b] = x[a] * s[m] + x[b] * c[m]
    return out


def ref_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    *,
    cos=None,
    sin=None,
    interleaved=True,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    scale=None,
    causal=False,
    window=(-1, -1),
    softcap=0.0,
    alibi=None,
):
    """What flash_attn_with_kvcache documents, step by step.

    1. Sequence b's new token t goes to logical cache position cache_seqlens[b] + t (rotated
       at that position first when cos/sin are given). Logical position p of sequence b lives
       at cache row cache_batch_idx[b] (default b), slot p; or, paged, in block
       block_table[b][p // page], slot p % page.
    2. Sequence b then has keys at logical positions [leftpad, end), end = cache_seqlens[b] +
       seqlen_new (the whole cache when cache_seqlens is None). Query i sits on the diagonal
       d = i + end - seqlen_q (bottom-right alignment) and sees key j iff leftpad <= j < end,
       and j <= d when causal, and d - left <= j <= d + right for a window (a negative side
       is open). q is rotated at cache_seqlens[b] + i when causal or windowed, else at
       cache_seqlens[b]. Scores: q.k * scale, softcapped as softcap * tanh(s / softcap), plus
       ALiBi -slope * |d - j|. Rows that see no key give zeros and lse +inf.

    Returns (out float64 (B, Sq, H, Dv), lse float64 (B, H, Sq), expected k_cache, v_cache).
    """
    kc, vc = k_cache.clone(), v_cache.clone()
    b_, sq, h, d = q.shape
    hk = kc.shape[2]
    page = kc.shape[1]
    cap = block_table.shape[1] * page if block_table is not None else kc.shape[1]

    def where(b, p):
        if block_table is not None:
            return int(block_table[b, p // page]), p % page
        return (b if cache_batch_idx is None else int(cache_batch_idx[b])), p

    if cache_seqlens is None:
        seqlens = [cap] * b_
    elif isinstance(cache_seqlens, int):
        seqlens = [cache_seqlens] * b_
    else:
        seqlens = [int(x) for x in cache_seqlens]
    sn = 0 if k is None else k.shape[1]
    rotary = cos is not None
    per_position = causal or tuple(window) != (-1, -1)
    scale = 1 / math.sqrt(d) if scale is None else scale
    left, right = window

    for b in range(b_):
        for t in range(sn):
            r, p = where(b, seqlens[b] + t)
            for hh in range(hk):
                kk = k[b, t, hh]
                if rotary:
                    kk = rope_ref(kk, seqlens[b] + t, cos, sin, interleaved)
                kc[r, p, hh] = kk.to(kc.dtype)
                vc[r, p, hh] = v[b, t, hh]

    out = torch.zeros(b_, sq, h, vc.shape[-1], dtype=torch.float64)
    lse = torch.full((b_, h, sq), math.inf, dtype=torch.float64)
    for b in range(b_):
        end = seqlens[b] + sn
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        keys = torch.stack([kc[where(b, j)] for j in range(cap)]).double()  # (cap, Hk, D)
        vals = torch.stack([vc[where(b, j)] for j in range(cap)]).double()
        for hh in range(h):
            kvh = hh // (h // hk)
            for i in range(sq):
                qi = q[b, i, hh].double()
                if rotary:
                    qi = rope_ref(
                        qi, seqlens[b] + (i if per_position else 0), cos, sin, interleaved
                    )
                diag = i + end - sq
                visible = [
                    start <= j < end
                    and (not causal or j <= diag)
                    and (left < 0 or j >= diag - left)
                    and (right < 0 or j <= diag + right)
                    for j in range(cap)
                ]
                if not any(visible):
                    continue
                s = keys[:, kvh] @ qi * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                if alibi is not None:
                    slope = float(alibi[hh] if alibi.dim() == 1 else alibi[b, hh])
                    s = s - slope * (diag - torch.arange(cap, dtype=torch.float64)).abs()
                s = s[torch.tensor(visible)]
                out[b, i, hh] = torch.softmax(s, -1) @ vals[torch.tensor(visible), kvh]
                lse[b, hh, i] = torch.logsumexp(s, -1)
    return out, lse, kc, vc


def run_both(q, k_cache, v_cache, k=None, v=None, **kw):
    """Call the twin on clones of the caches and the reference on the originals.

    Returns (out, lse, k_cache after, v_cache after) for both; also checks that the twin
    changed the caches it was given in place (same storage) rather than copies.
    """
    ref_kw = {
        "cos": kw.get("rotary_cos"),
        "sin": kw.get("rotary_sin"),
        "interleaved": kw.get("rotary_interleaved", True),
        "cache_seqlens": kw.get("cache_seqlens"),
        "cache_batch_idx": kw.get("cache_batch_idx"),
        "cache_leftpad": kw.get("cache_leftpad"),
        "block_table": kw.get("block_table"),
        "scale": kw.get("softmax_scale"),
        "causal": kw.get("causal", False),
        "window": kw.get("window_size", (-1, -1)),
        "softcap": kw.get("softcap", 0.0),
        "alibi": kw.get("alibi_slopes"),
    }
    want = ref_kvcache(q, k_cache, v_cache, k, v, **ref_kw)
    kc, vc = k_cache.clone(), v_cache.clone()
    ptr = kc.data_ptr()
    out, lse = flash_attn_with_kvcache(q, kc, vc, k, v, return_softmax_lse=True, **kw)
    assert kc.data_ptr() == ptr
    plain = flash_attn_with_kvcache(q, kc.clone(), vc.clone(), k, v, **kw)
    assert isinstance(plain, torch.Tensor)  # SDPA path; the lse call takes the explicit one
    torch.testing.assert_close(plain.double(), out.double(), **TOL[q.dtype])
    return (out, lse, kc, vc), want


def check(got, want, dtype, *, exact_cache=True):
    out, lse, kc, vc = got
    w_out, w_lse, w_kc, w_vc = want
    assert out.dtype == dtype and out.shape == w_out.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), w_out, **TOL[dtype])
    assert lse.dtype == F32 and lse.shape == w_lse.shape
    empty = torch.isinf(w_lse)
    assert torch.isposinf(lse[empty]).all()
    assert torch.equal(out.transpose(1, 2)[empty], torch.zeros_like(out.transpose(1, 2)[empty]))
    lse_tol = LSE_TOL if dtype == F32 else TOL[dtype]
    torch.testing.assert_close(lse[~empty].double(), w_lse[~empty], **lse_tol)
    if exact_cache:
        assert torch.equal(kc, w_kc)
        assert torch.equal(vc, w_vc)
    else:  # rotary rounds through float32 in the twin, float64 in the reference
        torch.testing.assert_close(kc.double(), w_kc.double(), **TOL[dtype])
        assert torch.equal(vc, w_vc)


def cache_inputs(b=3, sc=12, h=4, hk=2, d=16, sq=1, sn=1, dtype=F32, seed=0, bc=None):
    q = rand(b, sq, h, d, dtype=dtype, seed=seed)
    kc = rand(bc or b, sc, hk, d, dtype=dtype, seed=seed + 1)
    vc = rand(bc or b, sc, hk, d, dtype=dtype, seed=seed + 2)
    k = rand(b, sn, hk, d, dtype=dtype, seed=seed + 3)
    v = rand(b, sn, hk, d, dtype=dtype, seed=seed + 4)
    return q, kc, vc, k, v


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


# ------------------------------------------------------------------------------------------
# packed varlen
# ------------------------------------------------------------------------------------------


def _cu(lens):
    return i32([0, *torch.tensor(lens).cumsum(0).tolist()])


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
    cu = _cu(lens)
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
    cu_q, cu_k = _cu(lens_q), _cu(lens_k)
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
        flash_attn_varlen_qkvpacked_func(rand(6, 2, 4, 8), _cu([6]), 6)
    with pytest.raises(ValueError, match=r"\(total_k, 2, nheads_k, headdim\)"):
        flash_attn_varlen_kvpacked_func(rand(6, 4, 8), rand(6, 4, 8), _cu([6]), _cu([6]), 6, 6)


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


@pytest.fixture
def dynamo_reset():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def one_graph(fn, *args):
    """Assert fn(*args) traces as a single graph with no break; return the compiled fn."""
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    reasons = [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons
    assert explanation.graph_count == 1
    return torch.compile(fn, backend="eager", fullgraph=True)


@pytest.mark.parametrize(
    "kwargs", [{"causal": True}, {"causal": True, "window_size": (2, 0), "return_attn_probs": True}]
)
def test_compile_varlen_packed_no_graph_break(dynamo_reset, kwargs):
    lens = [5, 1, 7]
    qkv = rand(sum(lens), 3, 4, 8, seed=400)
    cu = _cu(lens)

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


def test_compile_pad_and_index_first_axis_no_graph_break(dynamo_reset):
    x = rand(4, 5, 3, seed=430)
    idx = torch.tensor([0, 1, 2, 5, 6, 11])

    def fn(x, idx):
        rows = index_first_axis(x.flatten(0, 1), idx)
        return pad_input(rows * 2, idx, 4, 5)

    got = one_graph(fn, x, idx)(x, idx)
    assert torch.equal(got, fn(x, idx))
