"""flash_attn_with_kvcache written out by hand in float64 (loops over sequences, heads and query
rows; the mask rules spelled out), never with the twins' own helpers; the twin called beside
it, and the comparison.
"""

from __future__ import annotations

import math

import torch

from attnguard.fallback import flash_attn_with_kvcache
from helpers.tensors import F32, LSE_TOL, TOL, rand


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
