"""Each flash-attn family's twins compute that family's rules: flash-attn 2, flash-attn 3 (and
vLLM's build of it, with sinks) and flash-attn 4, each against a float64 explicit-softmax model
written from that family's own sources (tests/helpers/family_rules.py; never calling the
twins):

* flash-attn 2: csrc/flash_attn/flash_api.cpp ``mha_fwd`` + ``set_params_fprop``: a window side
  at or past seqlen_k opens; an open side beside a closed one closes at seqlen_k; +inf lse for a
  row that sees no key;
* flash-attn 3: hopper/flash_api.cpp ``mha_fwd`` + ``set_params_fprop`` (varlen: the max
  seqlens): left >= seqlen_k - 1 opens, right >= seqlen_q - 1 opens, causal sets right = 0, an
  open side becomes seqlen_k - 1 / seqlen_q - 1 (still open); -inf lse for an empty row
  (hopper/softmax.h); vLLM's ``s_aux`` joins the softmax (``finalize_aux``);
* flash-attn 4: flash_attn/cute/interface.py ``_resolve_causal_local_window`` (None open, two ints
  summing below 0: no window) and mask.py (ints literal); ``learnable_sink`` as vLLM's s_aux.

Then the family decides what transformers hands the twins: a model trained with attention dropout
under flash_attention_3 / a flash-attn 3 or 4 hub kernel that cannot load gets no dropout (those
kernels have none), under flash_attention_2 it does.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import pytest
import torch
import transformers
from helpers.family_rules import attend64, fa2_bounds, fa3_bounds, fa4_bounds, keep_of
from helpers.models import tiny_inputs
from helpers.packages import diffusers_dispatch

from attnguard.fallback import families
from attnguard.fallback.refusal import Uncomputed

FA2, FA3, VLLM, FA4 = families.FA2, families.FA3, families.FA3_VLLM, families.FA4
FUNC, VARLEN, KVCACHE = families.FUNC, families.VARLEN, families.KVCACHE
F64 = torch.float64

BOUNDS = {FA2: fa2_bounds, FA3: fa3_bounds, VLLM: fa3_bounds, FA4: fa4_bounds}
EMPTY_LSE = {FA2: math.inf, FA3: -math.inf, VLLM: -math.inf, FA4: -math.inf}


def check(got: torch.Tensor, want: torch.Tensor, worst: dict[str, float], key: str) -> None:
    assert got.shape == want.shape, (key, got.shape, want.shape)
    same_inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), same_inf), key
    assert torch.equal(got[same_inf], want[same_inf].to(got.dtype)), key
    err = (
        float((got[~same_inf].double() - want[~same_inf]).abs().max()) if (~same_inf).any() else 0.0
    )
    worst[key] = max(worst.get(key, 0.0), err)
    assert err < 1e-9, (key, err)


def qkv(b=2, sq=5, sk=5, h=4, hk=2, d=8, seed=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, n, heads, d, generator=g, dtype=F64)
        for n, heads in ((sq, h), (sk, hk), (sk, hk))
    )


SHAPES = [(5, 5), (7, 2), (2, 7), (9, 3), (3, 9), (1, 6), (6, 1)]  # incl. seqlen_q > seqlen_k + 1
WINDOWS = [(-1, -1), (2, -1), (-1, 1), (2, 1), (0, 0), (10, -1), (-1, 10), (1, 4)]


def _fa4_window(ws: tuple[int, int]) -> tuple[int | None, int | None]:
    return (None if ws[0] < 0 else ws[0], None if ws[1] < 0 else ws[1])


def _call_dense(family, q, k, v, ws, causal, softcap):  # type: ignore[no-untyped-def]
    fn = families.twins_for(family)[FUNC]
    kw: dict[str, Any] = {"causal": causal, "softcap": softcap}
    if family is FA4:
        out, lse = fn(q, k, v, window_size=_fa4_window(ws), return_lse=True, **kw)
    elif family is VLLM:
        out, lse = fn(q, k, v, window_size=ws, **kw)
    elif family is FA3:
        out, lse = fn(q, k, v, window_size=ws, return_attn_probs=True, **kw)
    else:
        out, lse, _ = fn(q, k, v, window_size=ws, return_attn_probs=True, **kw)
    return out, lse


@pytest.mark.parametrize("family", [FA2, FA3, VLLM, FA4], ids=str)
def test_dense_twins_compute_their_familys_windows(family: families.Family) -> None:
    """Every window side open and closed, causal with windows, seqlen_q != seqlen_k both ways,
    GQA and MQA, softcap, the LSE (float32, the family's value for an empty row)."""
    worst: dict[str, float] = {}
    for n, (sq, sk) in enumerate(SHAPES):
        for hk in (2, 1):
            q, k, v = qkv(sq=sq, sk=sk, hk=hk, seed=n)
            for ws in WINDOWS:
                for causal in (False, True):
                    softcap = 2.5 if (n + ws[0]) % 3 == 0 else 0.0
                    wsf = _fa4_window(ws) if family is FA4 else ws
                    keep = keep_of(BOUNDS[family](wsf, causal, sq, sk), sq, sk)
                    want, want_lse = attend64(
                        q, k, v, keep, empty_lse=EMPTY_LSE[family], softcap=softcap
                    )
                    out, lse = _call_dense(family, q, k, v, ws, causal, softcap)
                    check(out, want, worst, "out")
                    assert lse.dtype == torch.float32
                    check(lse, want_lse.float(), worst, "lse")
    print(family, worst)


def test_a_one_sided_window_with_more_queries_than_keys_is_flash_attn_3s_own() -> None:
    """seqlen_q > seqlen_k + 1, the right side open: flash-attn 3 (and 4) leave it open, where
    flash-attn 2 closes it at seqlen_k (its first rows then see no key). The flash-attn 3 twin
    computed flash-attn 2's numbers before (rows of zeros where flash-attn 3 attends)."""
    q, k, v = qkv(b=1, sq=9, sk=3, seed=7)
    fa3_keep = keep_of(fa3_bounds((1, -1), False, 9, 3), 9, 3)
    want, _ = attend64(q, k, v, fa3_keep, empty_lse=-math.inf)
    assert fa3_keep.all(dim=1).sum() > 0 and fa3_keep.any(dim=1).all()  # every row attends
    got = families.twins_for(FA3)[FUNC](q, k, v, window_size=(1, -1))
    assert float((got - want).abs().max()) < 1e-12
    got4, _ = families.twins_for(FA4)[FUNC](q, k, v, window_size=(1, None))
    assert float((got4 - want).abs().max()) < 1e-12
    fa2 = families.twins_for(FA2)[FUNC](q, k, v, window_size=(1, -1))
    assert float((fa2 - want).abs().max()) > 0.1  # flash-attn 2's rule is another one
    assert float(fa2[0, :3].abs().max()) == 0.0  # rows 0-2 see keys j <= i - 3: none


def test_torch_flash_kernel_serves_only_the_windows_it_computes() -> None:
    """On a GPU the twins use torch's flash kernel (flash-attn 2's code in aten) for windows;
    it normalises a window as flash-attn 2 does, so it serves a flash-attn 3 / 4 band only where
    that gives the same band (``masks.kernel_band``), every flash-attn 2 window, and not the
    one-sided window with seqlen_q > seqlen_k + 1 (masked SDPA computes that one)."""
    from attnguard.fallback.masks import fa3_window, kernel_band, normalize_window

    served = 0
    for sq in range(1, 9):
        for sk in range(1, 9):
            for left in range(-1, 10):
                for right in range(-1, 10):
                    band = (left, right)
                    given = keep_of(
                        (None if left < 0 else left, None if right < 0 else right), sq, sk
                    )
                    kernel = keep_of(fa2_bounds(band, False, sq, sk), sq, sk)
                    if kernel_band(band, sq, sk):
                        served += 1
                        assert torch.equal(given, kernel), (band, sq, sk)
                    assert kernel_band(normalize_window(band, False, sk), sq, sk)
                    assert kernel_band(fa3_window(band, False, sq, sk), sq, sk) or sq > sk + 1
    assert served > 0.8 * 8 * 8 * 11 * 11
    assert not kernel_band(fa3_window((1, -1), False, 9, 3), 9, 3)


def test_diffusers_flash_3_hub_backend_computes_flash_attn_3s_window() -> None:
    """The same call through diffusers' ``_flash_3_hub`` backend, whose hub kernel cannot load
    here (no ``kernels`` package): the twin the guard puts in its place follows flash-attn 3."""
    import attnguard

    ad = diffusers_dispatch()
    if ad.is_kernels_available():
        pytest.skip("the kernels package is installed in this process")
    q, k, v = qkv(b=1, sq=9, sk=3, seed=7)
    want, _ = attend64(q, k, v, keep_of(fa3_bounds((1, -1), False, 9, 3), 9, 3), empty_lse=-1)
    attnguard.activate(log="none")
    try:
        backend = ad.AttentionBackendName("_flash_3_hub")
        ad._check_attention_backend_requirements(backend)
        got = ad.dispatch_attention_fn(
            q, k, v, backend=backend, attention_kwargs={"window_size": (1, -1)}
        )
    finally:
        ad._AttentionBackendRegistry._active_backend = ad.AttentionBackendName.NATIVE
    assert float((got - want).abs().max()) < 1e-12


# --- varlen: packed rows of unequal lengths (a zero-length one too) ---------------------------------


def _packed(cu_q: list[int], cu_k: list[int], h: int = 4, hk: int = 2, d: int = 8, seed: int = 0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(cu_q[-1], h, d, generator=g, dtype=F64)
    k, v = (torch.randn(cu_k[-1], hk, d, generator=g, dtype=F64) for _ in range(2))
    return q, k, v


def _longest(cu: list[int]) -> int:
    return max(b - a for a, b in zip(cu, cu[1:], strict=False))


def _ref_varlen(family, q, k, v, cu_q, cu_k, ws, causal, sink=None):  # type: ignore[no-untyped-def]
    """Each sequence on its own, the window normalised against the max seqlens (flash-attn 2 and
    3 do; flash-attn 4's rule reads no length)."""
    max_q, max_k = _longest(cu_q), _longest(cu_k)
    bounds = BOUNDS[family](ws, causal, max_q, max_k)
    outs, lses = [], []
    for n in range(len(cu_q) - 1):
        a, b, c, e = cu_q[n], cu_q[n + 1], cu_k[n], cu_k[n + 1]
        keep = keep_of(bounds, b - a, e - c)
        out, lse = attend64(
            q[None, a:b], k[None, c:e], v[None, c:e], keep, empty_lse=EMPTY_LSE[family], sink=sink
        )
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1)


CU = [([0, 3, 3, 10, 12], [0, 4, 4, 6, 11]), ([0, 9, 11], [0, 3, 8])]  # empty seq; Sq > Sk + 1


@pytest.mark.parametrize("family", [FA2, FA3, VLLM, FA4], ids=str)
def test_varlen_twins_compute_their_familys_rules(family: families.Family) -> None:
    worst: dict[str, float] = {}
    fn = families.twins_for(family)[VARLEN]
    for n, (cu_q, cu_k) in enumerate(CU):
        q, k, v = _packed(cu_q, cu_k, seed=n)
        args = (torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32))
        max_q, max_k = _longest(cu_q), _longest(cu_k)
        for ws in WINDOWS:
            for causal in (False, True):
                wsf = _fa4_window(ws) if family is FA4 else ws
                want, want_lse = _ref_varlen(family, q, k, v, cu_q, cu_k, wsf, causal)
                kw: dict[str, Any] = {"causal": causal, "window_size": wsf}
                if family is FA4:
                    out, lse = fn(q, k, v, *args, max_q, max_k, return_lse=True, **kw)
                elif family is VLLM:
                    out, lse = fn(q, k, v, *args, max_q, max_k, **kw)
                else:
                    res = fn(q, k, v, *args, max_q, max_k, return_attn_probs=True, **kw)
                    out, lse = res[0], res[1]
                check(out, want, worst, "out")
                check(lse, want_lse.float(), worst, "lse")
    print(family, worst)


# --- sinks: vLLM's s_aux, flash-attn 4's learnable_sink ------------------------------------------


@pytest.mark.parametrize("family", [VLLM, FA4], ids=str)
def test_sinks_join_the_softmax_as_the_kernels_with_sinks_compute_them(
    family: families.Family,
) -> None:
    """Dense and packed, rows that see no key included (zeros; lse = the sink's logit)."""
    worst: dict[str, float] = {}
    name = "s_aux" if family is VLLM else "learnable_sink"
    sink = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=F64)
    q, k, v = qkv(b=2, sq=7, sk=3, seed=3)
    ws = (0, 0) if family is VLLM else (0, 0)
    keep = keep_of(BOUNDS[family](ws, False, 7, 3), 7, 3)
    assert not keep.any(dim=1).all()  # some rows see no key
    want, want_lse = attend64(q, k, v, keep, empty_lse=-math.inf, sink=sink)
    res = families.twins_for(family)[FUNC](
        q, k, v, window_size=ws, **{name: sink}, **({"return_lse": True} if family is FA4 else {})
    )
    check(res[0], want, worst, "out")
    check(res[1], want_lse.float(), worst, "lse")
    cu_q, cu_k = CU[0]
    q, k, v = _packed(cu_q, cu_k, seed=4)
    want, want_lse = _ref_varlen(family, q, k, v, cu_q, cu_k, ws, True, sink=sink)
    cu = (torch.tensor(cu_q, dtype=torch.int32), torch.tensor(cu_k, dtype=torch.int32))
    extra = {"return_lse": True} if family is FA4 else {}
    out, lse = families.twins_for(family)[VARLEN](
        q, k, v, *cu, 7, 5, causal=True, window_size=ws, **{name: sink}, **extra
    )
    check(out, want, worst, "out")
    check(lse, want_lse.float(), worst, "lse")
    print(family, worst)


def test_flash_attn_4_lse_and_sink_gradients_are_the_kernels() -> None:
    """flash-attn 4 returns the lse where an input requires grad (None otherwise) and, asked for
    it (``return_lse``), takes its gradient; the sink gets its gradient."""
    fn = families.twins_for(FA4)[FUNC]
    q, k, v = qkv(b=1, sq=6, sk=6, seed=5)
    assert fn(q, k, v)[1] is None
    sink = torch.tensor([0.3, -0.2, 1.0, 0.1], dtype=F64)
    ins = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    refs = [t.clone().requires_grad_() for t in (q, k, v, sink)]
    out, lse = fn(
        *ins[:3], causal=True, window_size=(2, None), learnable_sink=ins[3], return_lse=True
    )
    keep = keep_of(fa4_bounds((2, None), True), 6, 6)
    want, want_lse = attend64(*refs[:3], keep, empty_lse=-math.inf, sink=refs[3])
    w = torch.randn(out.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    (out * w).sum().add(lse.double().sum()).backward()
    (want * w).sum().add(want_lse.sum()).backward()
    for a, b in zip(ins, refs, strict=True):
        assert float((a.grad - b.grad).abs().max()) < 1e-6  # the lse is float32, as the kernel's


def test_flash_attn_4_window_resolution() -> None:
    """``_resolve_causal_local_window``: two ints summing below 0 are no window (so (-1, 0)
    without causal is full attention, not causal); (None, 0) is causal; a negative int side
    bounds the band literally, which the twins do not compute: refused, naming it."""
    fn = families.twins_for(FA4)[FUNC]
    q, k, v = qkv(b=1, sq=5, sk=5, seed=6)
    full = fn(q, k, v)[0]
    assert torch.equal(fn(q, k, v, window_size=(-1, 0))[0], full)
    assert torch.equal(fn(q, k, v, window_size=(-1, -1))[0], full)
    assert torch.equal(fn(q, k, v, window_size=(None, 0))[0], fn(q, k, v, causal=True)[0])
    assert torch.equal(
        fn(q, k, v, causal=True, window_size=(-3, 7))[0], fn(q, k, v, causal=True)[0]
    )
    with pytest.raises(Uncomputed, match="negative side"):
        fn(q, k, v, window_size=(3, -1))


# --- zero lengths, signatures, refusals --------------------------------------------------------------


@pytest.mark.parametrize("family", [FA2, FA3, VLLM, FA4], ids=str)
def test_zero_length_sequences(family: families.Family) -> None:
    for sq, sk in ((0, 4), (4, 0)):
        q, k, v = qkv(b=2, sq=sq, sk=sk)
        out, lse = _call_dense(family, q, k, v, (-1, -1), True, 0.0)
        assert out.shape == q.shape and not out.any()
        assert lse.shape == (2, 4, sq) and bool((lse == EMPTY_LSE[family]).all())


SIGNATURES = {  # the functions' parameters, as the kernels declare them (their sources)
    (
        FA3,
        FUNC,
    ): "q k v softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk softcap num_splits pack_gqa deterministic sm_margin return_attn_probs",
    (
        FA3,
        VARLEN,
    ): "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q seqused_k softmax_scale causal qv q_descale k_descale v_descale window_size attention_chunk softcap num_splits pack_gqa deterministic sm_margin return_attn_probs",
    (
        FA3,
        KVCACHE,
    ): "q k_cache v_cache k v qv rotary_cos rotary_sin cache_seqlens cache_batch_idx cache_leftpad page_table cu_seqlens_q cu_seqlens_k_new max_seqlen_q rotary_seqlens q_descale k_descale v_descale softmax_scale causal window_size attention_chunk softcap rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin return_softmax_lse",
    (
        VLLM,
        FUNC,
    ): "q k v softmax_scale causal qv q_descale k_descale v_descale window_size softcap num_splits pack_gqa deterministic sm_margin s_aux",
    (
        VLLM,
        VARLEN,
    ): "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q seqused_k softmax_scale causal qv q_descale k_descale v_descale window_size softcap num_splits pack_gqa deterministic sm_margin s_aux",
    (
        VLLM,
        KVCACHE,
    ): "q k_cache v_cache k v qv rotary_cos rotary_sin cache_seqlens cache_batch_idx cache_leftpad page_table cu_seqlens_q cu_seqlens_k_new max_seqlen_q rotary_seqlens q_descale k_descale v_descale softmax_scale causal window_size softcap rotary_interleaved scheduler_metadata num_splits pack_gqa sm_margin return_softmax_lse s_aux",
    (
        FA4,
        FUNC,
    ): "q k v softmax_scale causal window_size learnable_sink softcap num_splits pack_gqa deterministic mask_mod full_block_cnt full_block_idx mask_block_cnt mask_block_idx block_size return_lse other",
    (
        FA4,
        VARLEN,
    ): "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k seqused_q seqused_k page_table softmax_scale causal window_size learnable_sink softcap num_splits pack_gqa deterministic score_mod aux_tensors return_lse other",
}


@pytest.mark.parametrize("key", list(SIGNATURES), ids=lambda k: f"{k[0]}-{k[1]}")
def test_each_twin_declares_its_kernels_parameters_and_no_dropout(key: tuple[Any, str]) -> None:
    twin = families.twins_for(key[0])[key[1]]
    assert " ".join(inspect.signature(twin).parameters) == SIGNATURES[key]
    assert "dropout_p" not in inspect.signature(twin).parameters


def test_what_the_twins_do_not_compute_is_refused_by_name() -> None:
    q, k, v = qkv()
    f3, v3, f4 = (families.twins_for(f) for f in (FA3, VLLM, FA4))
    cu = torch.tensor([0, 5, 10], dtype=torch.int32)
    flat = [t.flatten(0, 1) for t in (q, k, v)]
    refusals = [
        (f3[FUNC], (q, k, v), {"qv": q}, "qv"),
        (f3[FUNC], (q, k, v), {"k_descale": torch.ones(2, 2)}, "k_descale"),
        (f3[FUNC], (q, k, v), {"attention_chunk": 4}, "attention_chunk"),
        (f3[FUNC], (q, k, v[..., :4]), {}, "value head_dim"),
        (f3[VARLEN], (*flat, cu, cu, 5, 5), {"seqused_k": cu[1:]}, "seqused_k"),
        (v3[VARLEN], (*flat, cu, cu, 5, 5), {"seqused_q": cu[1:]}, "seqused_q"),
        (f3[KVCACHE], (q, k, v), {"cu_seqlens_q": cu}, "cu_seqlens_q"),
        (f4[FUNC], (q, k, v), {"mask_mod": print}, "mask_mod"),
        (f4[FUNC], (q, k, v), {"qv": q}, "qv"),
        (
            f4[VARLEN],
            (*flat,),
            {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "page_table": cu},
            "page_table",
        ),
        (f4[VARLEN], (*flat,), {"cu_seqlens_q": cu}, "cu_seqlens_q without"),
    ]
    for fn, args, kw, name in refusals:
        with pytest.raises(Uncomputed, match=name):
            fn(*args, **kw)


def test_flash_attn_3_kvcache_twin_appends_and_attends_by_flash_attn_3s_rules() -> None:
    """The cache updated in place, each sequence attending to its own keys (cache_seqlens + new),
    windows normalised against (seqlen_q, the cache capacity); a paged cache (page_table) alike."""
    g = torch.Generator().manual_seed(8)
    b, cap, h, hk, d, new = 2, 8, 4, 2, 8, 3
    seqlens = torch.tensor([2, 5], dtype=torch.int32)
    q = torch.randn(b, new, h, d, generator=g, dtype=F64)
    kn, vn = (torch.randn(b, new, hk, d, generator=g, dtype=F64) for _ in range(2))
    cache0 = [torch.randn(b, cap, hk, d, generator=g, dtype=F64) for _ in range(2)]
    fn = families.twins_for(FA3)[KVCACHE]
    worst: dict[str, float] = {}
    for ws, causal in (((1, -1), False), ((-1, -1), True), ((2, 0), False), ((-1, -1), False)):
        kc, vc = (c.clone() for c in cache0)
        out, lse = fn(
            q,
            kc,
            vc,
            kn,
            vn,
            cache_seqlens=seqlens,
            causal=causal,
            window_size=ws,
            return_softmax_lse=True,
        )
        bounds = fa3_bounds(ws, causal, new, cap)
        for n in range(b):
            end = int(seqlens[n]) + new
            keys = torch.cat([cache0[0][n, : int(seqlens[n])], kn[n]])[None]
            vals = torch.cat([cache0[1][n, : int(seqlens[n])], vn[n]])[None]
            assert torch.equal(kc[n, :end], keys[0]) and torch.equal(vc[n, :end], vals[0])
            want, want_lse = attend64(
                q[n : n + 1], keys, vals, keep_of(bounds, new, end), empty_lse=-math.inf
            )
            check(out[n : n + 1], want, worst, "out")
            check(lse[n : n + 1], want_lse.float(), worst, "lse")
        # the same cache in pages of 2 slots, the pages in another order
        page = 2
        order = torch.randperm(b * cap // page, generator=g)
        table = torch.empty(b, cap // page, dtype=torch.int32)
        pk, pv = (torch.empty(b * cap // page, page, hk, d, dtype=F64) for _ in range(2))
        for n in range(b):
            for p in range(cap // page):
                slot = int(order[n * (cap // page) + p])
                table[n, p] = slot
                pk[slot], pv[slot] = (
                    cache0[0][n, p * page : (p + 1) * page],
                    cache0[1][n, p * page : (p + 1) * page],
                )
        paged = fn(
            q,
            pk,
            pv,
            kn,
            vn,
            cache_seqlens=seqlens,
            page_table=table,
            causal=causal,
            window_size=ws,
        )
        check(paged, out, worst, "paged")
    print(worst)


# --- what transformers hands the twins: no dropout where the kernel has none -----------------------

WITHOUT_DROPOUT = [
    "flash_attention_3",
    "flash_attention_4",
    "kernels-community/flash-attn3",  # hub kernels that cannot load here (no `kernels` package)
    "kernels-community/vllm-flash-attn3",
    "kernels-community/flash-attn4",
]


def _train_and_eval(path: Any, impl: str) -> tuple[Any, float, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=impl, attention_dropout=0.3
    )
    batch = tiny_inputs("llama")  # left-padded: the varlen function too
    with torch.no_grad():
        evaluated = model.eval()(**batch).logits
        torch.manual_seed(1)
        trained = model.train()(**batch).logits
    real = batch["attention_mask"].bool()
    return model, float((trained - evaluated)[real].abs().max()), evaluated[real]


def _unknown_here(impl: str) -> str:
    """Why this transformers release has no ``impl`` ("" when it has it)."""
    import importlib

    from attnguard.integrations.transformers import hub
    from attnguard.integrations.transformers.interface import registry_mapping

    if "/" in impl:
        try:
            loaders = importlib.import_module(hub.MODULE)
        except ImportError:
            return "this transformers loads no hub kernels"
        if not any(callable(getattr(loaders, n, None)) for n in hub.LOADERS):
            return "this transformers loads hub kernels without the loader attnguard wraps"
        return ""
    mapping = registry_mapping(importlib.import_module("transformers.modeling_utils"))
    return "" if mapping is not None and impl in mapping else f"this transformers has no {impl}"


@pytest.mark.parametrize("impl", WITHOUT_DROPOUT)
def test_no_dropout_where_the_kernel_has_none(
    impl: str, tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    """A Llama with attention_dropout=0.3, trained under an implementation whose kernels take no
    dropout (flash-attn 3, vLLM's flash-attn 3, flash-attn 4): transformers passes them none, and
    the twins that serve it here are handed no dropout either: training mode computes what eval
    mode computes (before, flash-attn 2's twins were handed dropout_p: 0.295 apart). Where the
    release's flash path binds flash-attn 2's functions at import (4.49-4.53), or builds no mask
    for the request (4.54-4.56 have none for flash_attention_3), a flash-attn 3 request is not
    kept on the twins: its own error stands, with one event."""
    import importlib.util
    import sys

    from attnguard.integrations.transformers import wiring

    if importlib.util.find_spec("flash_attn_interface") or importlib.util.find_spec("kernels"):
        pytest.skip("a flash-attn 3 package or `kernels` is installed in this process")
    why = _unknown_here(impl)
    if why:
        pytest.skip(why)
    path = tiny_checkpoint("llama")
    flash_module = sys.modules["transformers.modeling_flash_attention_utils"]
    masks = getattr(
        sys.modules.get("transformers.masking_utils"), "ALL_MASK_ATTENTION_FUNCTIONS", {}
    )
    unmasked = impl not in getattr(masks, "_global_mapping", {impl: 0})  # 4.54-4.56: no mask
    if "/" not in impl and (wiring.read(flash_module).layout == wiring.GLOBALS or unmasked):
        with pytest.raises(ImportError, match="Flash ?Attention ?3"):  # flash-attn 3 missing
            _train_and_eval(path, impl)
        said = [e["reason_code"] for e in captured if e["event"] == "observed"]
        assert said == ["flash_path_unrecognised"]
        return
    eager = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    batch = tiny_inputs("llama")
    with torch.no_grad():
        want = eager.eval()(**batch).logits[batch["attention_mask"].bool()]
    model, apart, evaluated = _train_and_eval(path, impl)
    assert model.config._attn_implementation == impl  # served as itself, by its family's twins
    assert apart == 0.0
    assert float((evaluated - want).abs().max()) < 1e-5


def test_flash_attention_2_twins_drop_out_in_training(tiny_checkpoint: Any, guard: Any) -> None:
    """flash-attn 2 has dropout: its twins apply it in training, as the kernel would."""
    _, apart, _ = _train_and_eval(tiny_checkpoint("llama"), "flash_attention_2")
    assert apart > 0.05
