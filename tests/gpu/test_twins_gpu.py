"""SDPA twins against the REAL flash-attn kernel on a CUDA GPU (H100/H200).

Every twin in attnguard.fallback that mirrors a flash-attn function is called on the same CUDA
inputs as the real flash-attn 2.8.3 function and must agree: ``out`` within 2e-2 (bf16) / 5e-3
(fp16) of max |out| of the kernel, ``softmax_lse`` within 1e-3, and after
``flash_attn_with_kvcache`` the KV caches must hold what the kernel wrote (bit-identical; with
rotary within one rounding step of the dtype, as the kernel may fuse the float32 multiply-adds).
flash-attn's ``deterministic=True``: tests/gpu/test_twins_determinism_gpu.py.

Needs the real package with its CUDA extension (``flash_attn_2_cuda``) in
$TEST_REAL_FLASH_ATTN_DIR (the unpacked wheel; scripts/gpu_suite.sh sets it), put on sys.path by
the ``real`` fixture (tests/gpu/conftest.py); the stand-in from tests/standins never counts.
Skipped with the reason otherwise.

Run: TEST_REAL_FLASH_ATTN_DIR=/tmp/flashsite pytest -m gpu tests/gpu/test_twins_gpu.py
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from helpers.gpu_twins import (  # noqa: E402
    BF16,
    CUDA,
    DTYPES,
    FP16,
    assert_grads_close,
    assert_lse_close,
    assert_out_close,
    cu_lens,
    i32,
    randn,
)

from attnguard import fallback  # noqa: E402

CACHE_RTOL = {BF16: 2**-7, FP16: 2**-10}  # one rounding step, for rotated keys only


def kernel_alibi_shift(slopes, b, h, diag):
    """flash-attn's causal ALiBi adds ``slope * j`` instead of ``-slope * (diag - j)``: its lse
    is ours plus ``slope * diag`` (a row constant; ``out`` is unaffected). slopes (H,) or
    (B, H); diag (B, Sq) float32 -> (B, H, Sq)."""
    s = slopes.float().expand(b, h) if slopes.dim() == 1 else slopes.float()
    return s[:, :, None] * diag[:, None, :]


def unpack(res):
    return (res[0], res[1]) if isinstance(res, tuple) else (res, None)


# ------------------------------------------------------------------------------------------
# flash_attn_func and the packed dense variants
# ------------------------------------------------------------------------------------------

FUNC_CASES = {
    "plain": (128, 128, 8, 8, 64, {}),
    "causal": (128, 128, 8, 8, 128, {"causal": True}),
    "causal_bottom_right_gqa": (37, 200, 8, 2, 64, {"causal": True, "return_attn_probs": True}),
    "causal_sq_gt_sk_empty_rows": (200, 37, 4, 4, 64, {"causal": True, "return_attn_probs": True}),
    "window_mqa": (128, 160, 8, 1, 128, {"window_size": (32, 8), "return_attn_probs": True}),
    "causal_window": (128, 128, 8, 2, 64, {"causal": True, "window_size": (16, 0)}),
    "softcap": (96, 96, 4, 4, 64, {"softcap": 2.0, "causal": True, "return_attn_probs": True}),
    "alibi": (64, 100, 4, 2, 64, {"alibi": "heads", "return_attn_probs": True}),
    "alibi_causal": (
        64,
        100,
        4,
        2,
        64,
        {"alibi": "batch", "causal": True, "return_attn_probs": True},
    ),
    "decode_gqa": (1, 300, 8, 2, 128, {"causal": True, "return_attn_probs": True}),
    "scale": (64, 64, 4, 4, 64, {"softmax_scale": 0.2, "return_attn_probs": True}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(FUNC_CASES))
def test_flash_attn_func_matches_kernel(real, case, dtype):
    sq, sk, h, hk, d, kwargs = FUNC_CASES[case]
    kwargs = dict(kwargs)
    b = 2
    q = randn(b, sq, h, d, dtype=dtype, seed=1)
    k = randn(b, sk, hk, d, dtype=dtype, seed=2)
    v = randn(b, sk, hk, d, dtype=dtype, seed=3)
    alibi = kwargs.pop("alibi", None)
    if alibi is not None:
        slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=CUDA)[:h]
        kwargs["alibi_slopes"] = slopes if alibi == "heads" else torch.stack([slopes, slopes * 3])
    got_out, got_lse = unpack(fallback.flash_attn_func(q, k, v, **kwargs))
    ref_out, ref_lse = unpack(real.flash_attn_func(q, k, v, **kwargs))
    assert_out_close(got_out, ref_out, dtype)
    if kwargs.get("return_attn_probs"):
        if alibi is not None and kwargs.get("causal"):
            diag = (torch.arange(sq, device=CUDA) + sk - sq).float().expand(b, sq)
            got_lse = got_lse + kernel_alibi_shift(kwargs["alibi_slopes"], b, h, diag)
        assert_lse_close(got_lse, ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_packed_dense_variants_match_kernel(real, dtype):
    qkv = randn(2, 80, 3, 4, 64, dtype=dtype, seed=10)
    kw = {"causal": True, "window_size": (24, 0), "return_attn_probs": True}
    got = fallback.flash_attn_qkvpacked_func(qkv, **kw)
    ref = real.flash_attn_qkvpacked_func(qkv, **kw)
    assert_out_close(got[0], ref[0], dtype)
    assert_lse_close(got[1], ref[1])
    q = randn(2, 30, 8, 64, dtype=dtype, seed=11)
    kv = randn(2, 90, 2, 2, 64, dtype=dtype, seed=12)
    got = fallback.flash_attn_kvpacked_func(q, kv, **kw)
    ref = real.flash_attn_kvpacked_func(q, kv, **kw)
    assert_out_close(got[0], ref[0], dtype)
    assert_lse_close(got[1], ref[1])


# ------------------------------------------------------------------------------------------
# varlen, packed varlen
# ------------------------------------------------------------------------------------------


VARLEN_CASES = {
    "causal_gqa": ([1, 17, 64, 5, 128], None, 8, 2, {"causal": True, "return_attn_probs": True}),
    "q_shorter_window": (
        [3, 40, 7],
        [50, 40, 90],
        4,
        4,
        {"causal": True, "window_size": (16, 0), "return_attn_probs": True},
    ),
    "q_longer_empty_rows": ([20, 9], [5, 9], 4, 2, {"causal": True, "return_attn_probs": True}),
    "alibi_per_seq": ([10, 33, 2], [12, 33, 40], 4, 4, {"alibi": True, "return_attn_probs": True}),
    "alibi_causal": ([10, 33, 2], [12, 33, 40], 4, 4, {"alibi": True, "causal": True}),
    "softcap_local": (
        [64, 31],
        None,
        4,
        1,
        {"softcap": 2.0, "window_size": (8, 8), "return_attn_probs": True},
    ),
    "decode_gqa": ([1, 1, 1, 1], [10, 200, 33, 1], 8, 2, {"causal": True}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_matches_kernel(real, case, dtype):
    lens_q, lens_k, h, hk, kwargs = VARLEN_CASES[case]
    lens_k = lens_k or lens_q
    kwargs = dict(kwargs)
    d, nseq = 64, len(lens_q)
    q = randn(sum(lens_q), h, d, dtype=dtype, seed=20)
    k = randn(sum(lens_k), hk, d, dtype=dtype, seed=21)
    v = randn(sum(lens_k), hk, d, dtype=dtype, seed=22)
    if kwargs.pop("alibi", False):
        kwargs["alibi_slopes"] = torch.rand(nseq, h, device=CUDA) * 0.5
    args = (q, k, v, cu_lens(lens_q), cu_lens(lens_k), max(lens_q), max(lens_k))
    got_out, got_lse = unpack(fallback.flash_attn_varlen_func(*args, **kwargs))
    ref_out, ref_lse = unpack(real.flash_attn_varlen_func(*args, **kwargs))
    assert_out_close(got_out, ref_out, dtype)
    if kwargs.get("return_attn_probs"):
        assert_lse_close(got_lse, ref_lse)


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_paged_matches_kernel(real, dtype):
    page, h, hk, d = 256, 8, 2, 128
    lens_q, lens_k = [3, 1, 7], [300, 512, 7]
    kc = randn(7, page, hk, d, dtype=dtype, seed=30)
    vc = randn(7, page, hk, d, dtype=dtype, seed=31)
    table = i32([[5, 1], [0, 6], [3, 2]])
    q = randn(sum(lens_q), h, d, dtype=dtype, seed=32)
    args = (q, kc, vc, cu_lens(lens_q), cu_lens(lens_k), max(lens_q), max(lens_k))
    kw = {"causal": True, "block_table": table}
    assert_out_close(
        fallback.flash_attn_varlen_func(*args, **kw),
        real.flash_attn_varlen_func(*args, **kw),
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_varlen_packed_variants_match_kernel(real, dtype):
    lens = [5, 70, 33]
    cu, mx = cu_lens(lens), max(lens)
    kw = {"causal": True, "softcap": 3.0, "return_attn_probs": True}
    qkv = randn(sum(lens), 3, 4, 64, dtype=dtype, seed=40)
    got = fallback.flash_attn_varlen_qkvpacked_func(qkv, cu, mx, **kw)
    ref = real.flash_attn_varlen_qkvpacked_func(qkv, cu, mx, **kw)
    assert_out_close(got[0], ref[0], dtype)
    assert_lse_close(got[1], ref[1])
    lens_k = [9, 70, 60]
    q = randn(sum(lens), 8, 64, dtype=dtype, seed=41)
    kv = randn(sum(lens_k), 2, 2, 64, dtype=dtype, seed=42)
    args = (q, kv, cu, cu_lens(lens_k), mx, max(lens_k))
    got = fallback.flash_attn_varlen_kvpacked_func(*args, **kw)
    ref = real.flash_attn_varlen_kvpacked_func(*args, **kw)
    assert_out_close(got[0], ref[0], dtype)
    assert_lse_close(got[1], ref[1])


# ------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ------------------------------------------------------------------------------------------

B, CAP, PAGE = 4, 512, 256

# name: (seqlen_q, seqlen_new, options). Cache lengths leave room for seqlen_new.
KV_CASES = {
    "decode": (1, 1, {"causal": True}),
    "decode_mqa": (1, 1, {"causal": True, "hk": 1}),
    "attend_only": (1, 0, {}),
    "attend_whole_cache": (3, 0, {"seqlens": None, "causal": True}),
    "chunk_causal": (8, 8, {"causal": True}),
    "chunk_not_causal": (8, 8, {}),
    "int_seqlens": (4, 4, {"causal": True, "seqlens": 100}),
    "batch_idx": (2, 2, {"causal": True, "batch_idx": True}),
    "leftpad": (4, 4, {"causal": True, "leftpad": True}),
    "paged": (4, 4, {"causal": True, "paged": True}),
    "paged_decode": (1, 1, {"paged": True, "hk": 8}),
    "rotary_interleaved_causal": (4, 4, {"causal": True, "rotary": (True, 128)}),
    "rotary_neox_not_causal": (4, 4, {"rotary": (False, 128)}),
    "rotary_neox_partial_leftpad": (4, 4, {"causal": True, "rotary": (False, 64), "leftpad": True}),
    "rotary_paged_decode": (1, 1, {"causal": True, "rotary": (True, 64), "paged": True}),
    # a window wider than the cache is dropped by flash-attn: not local, q at cache_seqlens
    "rotary_window_beyond_cache": (4, 4, {"rotary": (False, 128), "window": (4096, -1)}),
    "window_causal": (8, 8, {"causal": True, "window": (32, 0)}),
    "window_local": (8, 8, {"window": (16, 4)}),
    "softcap": (4, 4, {"causal": True, "softcap": 2.0}),
    "alibi": (4, 4, {"alibi": "heads"}),
    "alibi_causal_leftpad": (4, 4, {"alibi": "batch", "causal": True, "leftpad": True}),
    "everything": (
        3,
        3,
        {
            "causal": True,
            "hk": 1,
            "rotary": (True, 128),
            "leftpad": True,
            "batch_idx": True,
            "window": (64, 0),
            "softcap": 5.0,
            "alibi": "heads",
        },
    ),
    "num_splits_1": (2, 2, {"causal": True, "num_splits": 1}),
}


def kv_inputs(sq, sn, opts, dtype, h=8, d=128):
    hk = opts.get("hk", 2)
    q = randn(B, sq, h, d, dtype=dtype, seed=50)
    if opts.get("paged"):
        kc = randn(2 * B + 3, PAGE, hk, d, dtype=dtype, seed=51)
        vc = randn(2 * B + 3, PAGE, hk, d, dtype=dtype, seed=52)
    else:
        rows = 6 if opts.get("batch_idx") else B
        kc = randn(rows, CAP, hk, d, dtype=dtype, seed=51)
        vc = randn(rows, CAP, hk, d, dtype=dtype, seed=52)
    kw = {
        "causal": opts.get("causal", False),
        "window_size": opts.get("window", (-1, -1)),
        "softcap": opts.get("softcap", 0.0),
        "num_splits": opts.get("num_splits", 0),
        "return_softmax_lse": True,
    }
    seqlens = [0, 17, 300, CAP - sn - 1]
    leftpad = [0, 5, 299, 100]
    kw["cache_seqlens"] = i32(seqlens)
    if "seqlens" in opts:
        kw["cache_seqlens"] = opts["seqlens"]
        seqlens = [CAP if opts["seqlens"] is None else opts["seqlens"]] * B
    if sn:
        kw["k"] = randn(B, sn, hk, d, dtype=dtype, seed=53)
        kw["v"] = randn(B, sn, hk, d, dtype=dtype, seed=54)
    if opts.get("paged"):
        kw["block_table"] = i32([[9, 2], [0, 7], [4, 10], [1, 5]])
    if opts.get("batch_idx"):
        kw["cache_batch_idx"] = i32([4, 0, 5, 2])
    if opts.get("leftpad"):
        kw["cache_leftpad"] = i32(leftpad)
    else:
        leftpad = [0] * B
    if "rotary" in opts:
        interleaved, rd = opts["rotary"]
        pos = torch.arange(CAP, device=CUDA, dtype=torch.float64)[:, None]
        angle = pos * 10000.0 ** (-torch.arange(0, rd, 2, device=CUDA) / rd)
        kw.update(
            rotary_cos=angle.cos().to(dtype),
            rotary_sin=angle.sin().to(dtype),
            rotary_interleaved=interleaved,
        )
    if "alibi" in opts:
        slopes = 2.0 ** -torch.arange(1, h + 1, device=CUDA, dtype=torch.float32)
        kw["alibi_slopes"] = slopes if opts["alibi"] == "heads" else torch.stack([slopes] * B) * 2
    # diagonal of query i in the kernel's (leftpad-relative) key coordinates
    ends = torch.tensor([s + sn - p for s, p in zip(seqlens, leftpad, strict=True)], device=CUDA)
    diag = (torch.arange(sq, device=CUDA)[None, :] + ends[:, None] - sq).float()
    return q, kc, vc, kw, diag


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(KV_CASES))
def test_with_kvcache_matches_kernel(real, case, dtype):
    sq, sn, opts = KV_CASES[case]
    q, kc, vc, kw, diag = kv_inputs(sq, sn, opts, dtype)
    kc_t, vc_t, kc_r, vc_r = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got_out, got_lse = fallback.flash_attn_with_kvcache(q, kc_t, vc_t, **kw)
    ref_out, ref_lse = real.flash_attn_with_kvcache(q, kc_r, vc_r, **kw)
    assert_out_close(got_out, ref_out, dtype)
    if "alibi" in opts and kw["causal"] and kw["window_size"] == (-1, -1):
        got_lse = got_lse + kernel_alibi_shift(kw["alibi_slopes"], B, q.shape[2], diag)
    assert_lse_close(got_lse, ref_lse)
    # the caches hold what the kernel wrote, and something was written when k/v were given
    assert torch.equal(vc_t, vc_r)
    if "rotary" in opts:
        torch.testing.assert_close(kc_t, kc_r, atol=1e-5, rtol=CACHE_RTOL[dtype])
    else:
        assert torch.equal(kc_t, kc_r)
    assert torch.equal(kc_r, kc) == (sn == 0)


# name: (batch, heads, kv heads, head_dim, capacity, cache lengths (a list, an int or None),
# a new token, window, LSE). Capacities from a few hundred keys to 32k: one program per kv head
# and sequence, and caches split over the GPU (two kernels) alike.
DECODE_CASES = {
    "gqa4_d128": (4, 32, 8, 128, 512, [0, 17, 300, 510], True, (-1, -1), True),
    "mha_d64": (2, 8, 8, 64, 300, [5, 298], True, (-1, -1), True),
    "mqa_d256": (3, 16, 1, 256, 400, [399, 0, 128], True, (-1, -1), True),
    "gqa7_d64_no_lse": (2, 14, 2, 64, 1000, [900, 1], True, (-1, -1), False),
    "d80_window": (2, 8, 2, 80, 700, [650, 40], True, (100, 0), True),
    "attend_only": (2, 8, 2, 128, 600, [599, 3], False, (-1, -1), True),
    "empty_rows": (2, 8, 2, 128, 600, [0, 0], False, (-1, -1), True),
    "int_lengths": (3, 8, 2, 128, 256, 200, True, (-1, -1), True),
    "whole_cache": (2, 8, 2, 128, 256, None, False, (-1, -1), True),
    "long_split_cache": (1, 32, 8, 128, 32768, [30000], True, (-1, -1), True),
    "batch8_8k": (8, 32, 8, 128, 8256, [8192, 5, 4000, 8000, 1, 2, 3, 8191], True, (-1, -1), True),
}


def decode_inputs(case, dtype):
    b, h, hk, d, cap, lens, new, win, lse = DECODE_CASES[case]
    q = randn(b, 1, h, d, dtype=dtype, seed=60)
    kc = randn(b, cap, hk, d, dtype=dtype, seed=61)
    vc = randn(b, cap, hk, d, dtype=dtype, seed=62)
    kw = {"causal": True, "window_size": win, "return_softmax_lse": lse}
    if lens is not None:
        kw["cache_seqlens"] = lens if isinstance(lens, int) else i32(lens)
    if new:
        kw["k"] = randn(b, 1, hk, d, dtype=dtype, seed=63)
        kw["v"] = randn(b, 1, hk, d, dtype=dtype, seed=64)
    return q, kc, vc, kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DECODE_CASES))
def test_decode_kernel_matches_kernel(real, routes, case, dtype):
    """One query token on attnguard's decode kernel (Triton, on the GPU image): the output and
    LSE of flash-attn's kernel within the dtype's rounding, the caches bit for bit."""
    from attnguard.fallback import triton_decode

    q, kc, vc, kw = decode_inputs(case, dtype)
    # the first call builds the kernel (through Triton's own entry); the second is launched
    # directly, as every later call is: that one is compared
    fallback.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **kw)
    kc_t, vc_t, kc_r, vc_r = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    got = fallback.flash_attn_with_kvcache(q, kc_t, vc_t, **kw)
    ref = real.flash_attn_with_kvcache(q, kc_r, vc_r, **kw)
    assert triton_decode.disabled() is None, triton_decode.disabled()
    assert routes == ["kvcache-decode"] * 2
    assert triton_decode._compiled, "no kernel launched directly"
    if kw["return_softmax_lse"]:
        assert_out_close(got[0], ref[0], dtype)
        assert_lse_close(got[1], ref[1])
    else:
        assert_out_close(got, ref, dtype)
    assert torch.equal(kc_t, kc_r) and torch.equal(vc_t, vc_r)
    assert torch.equal(kc_r, kc) == ("k" not in kw)


def test_decode_kernel_in_a_cuda_graph(real):
    """A decode step captured in a CUDA graph by the caller (after a first eager call) replays
    on the decode kernel: new inputs, the kernel's results, each replay appending."""
    q, kc, vc, kw = decode_inputs("d80_window", BF16)
    kc_r, vc_r = kc.clone(), vc.clone()
    fallback.flash_attn_with_kvcache(q, kc.clone(), vc.clone(), **kw)  # built outside capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        out, lse = fallback.flash_attn_with_kvcache(q, kc, vc, **kw)
    for step in range(3):
        for i, t in enumerate((q, kw["k"], kw["v"])):
            t.copy_(randn(*t.shape, dtype=BF16, seed=70 + 3 * step + i))
        kw["cache_seqlens"] += 1 if step else 0
        graph.replay()
        ref, ref_lse = real.flash_attn_with_kvcache(q, kc_r, vc_r, **kw)
        assert_out_close(out, ref, BF16)
        assert_lse_close(lse, ref_lse)
        assert torch.equal(kc, kc_r) and torch.equal(vc, vc_r)


# ------------------------------------------------------------------------------------------
# bert_padding
# ------------------------------------------------------------------------------------------


def test_bert_padding_matches_flash_attn(real):
    g = torch.Generator(device=CUDA).manual_seed(60)
    x = torch.randn(4, 33, 8, 64, device=CUDA, generator=g).to(BF16)
    lens = torch.tensor([33, 1, 20, 7], device=CUDA)
    mask = torch.arange(33, device=CUDA)[None, :] < lens[:, None]
    unused = (torch.arange(33, device=CUDA)[None, :] == lens[:, None]) & (lens[:, None] < 33)
    for args in ((x, mask), (x, mask.long(), unused.long())):
        got, ref = fallback.unpad_input(*args), real.unpad_input(*args)
        assert len(got) == len(ref) == 5
        for a, b in zip(got, ref, strict=True):
            assert a == b if isinstance(b, int) else torch.equal(a, b)
        hs, idx = got[0], got[1]
        assert torch.equal(fallback.pad_input(hs, idx, 4, 33), real.pad_input(hs, idx, 4, 33))
        flat = x.flatten(0, 1)
        assert torch.equal(fallback.index_first_axis(flat, idx), real.index_first_axis(flat, idx))


# ------------------------------------------------------------------------------------------
# which torch kernel the twins use here, and gradients against the kernel's
# ------------------------------------------------------------------------------------------

PACKS = {
    # name: (sequence lengths, heads, kv heads, head_dim, kwargs)
    "many_short_gqa": (
        [64 + (37 * i) % 449 for i in range(48)],
        16,
        4,
        128,
        {"causal": True},
    ),
    "few_long_window": (
        [512, 2048, 1000, 1536],
        8,
        2,
        128,
        {"causal": True, "window_size": (255, 0)},
    ),
    "softcap_gqa": ([300, 17, 129, 64], 8, 2, 64, {"causal": True, "softcap": 30.0}),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pack", list(PACKS))
def test_varlen_packs_outputs_and_gradients_match_kernel(real, routes, pack, dtype):
    lens, h, hk, d, kw = PACKS[pack]
    total, cu, mx = sum(lens), cu_lens(lens), max(lens)
    q = randn(total, h, d, dtype=dtype, seed=70).requires_grad_()
    k = randn(total, hk, d, dtype=dtype, seed=71).requires_grad_()
    v = randn(total, hk, d, dtype=dtype, seed=72).requires_grad_()
    g = randn(total, h, d, dtype=dtype, seed=73)
    got = fallback.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, **kw)
    ref = real.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, **kw)
    assert_out_close(got, ref, dtype)
    assert_grads_close(
        torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), dtype
    )
    # softcap has no fused torch kernel: per sequence; everything else: torch's flash kernel
    want = "varlen-segments" if kw.get("softcap") else "varlen-flash"
    assert routes[0] == want


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "sq, sk, kw, route",
    [
        (512, 512, {"causal": True}, "dense-plain"),
        (300, 700, {"causal": True}, "dense-window-flash"),
        (512, 512, {"causal": True, "window_size": (63, 0)}, "dense-window-flash"),
    ],
)
def test_dense_outputs_and_gradients_match_kernel(real, routes, sq, sk, kw, route, dtype):
    q = randn(2, sq, 8, 128, dtype=dtype, seed=80).requires_grad_()
    k = randn(2, sk, 2, 128, dtype=dtype, seed=81).requires_grad_()
    v = randn(2, sk, 2, 128, dtype=dtype, seed=82).requires_grad_()
    g = randn(2, sq, 8, 128, dtype=dtype, seed=83)
    got = fallback.flash_attn_func(q, k, v, **kw)
    ref = real.flash_attn_func(q, k, v, **kw)
    assert_out_close(got, ref, dtype)
    assert_grads_close(
        torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), dtype
    )
    assert routes == [route]


def test_kvcache_routes_on_this_gpu(real, routes):
    """Decode steps (one query token) take the decode kernel; other calls with contiguous
    caches take torch's flash kernel; what it cannot express (pages, a batch index, left
    padding, softcap, ALiBi) takes the general path."""
    expected = {
        "decode": "kvcache-decode",
        "decode_mqa": "kvcache-decode",
        "attend_only": "kvcache-decode",
        "int_seqlens": "kvcache-flash",
        "attend_whole_cache": "kvcache-flash",
        "rotary_interleaved_causal": "kvcache-flash",
        "window_local": "kvcache-flash",
        "paged": "kvcache-general",
        "batch_idx": "kvcache-general",
        "leftpad": "kvcache-general",
        "softcap": "kvcache-general",
        "alibi": "kvcache-general",
    }
    for case, route in expected.items():
        sq, sn, opts = KV_CASES[case]
        q, kc, vc, kw, _ = kv_inputs(sq, sn, opts, BF16)
        routes.clear()
        fallback.flash_attn_with_kvcache(q, kc, vc, **kw)
        assert routes == [route], case
