"""The table of which torch kernel computes a twin's call (attnguard/fallback/routes.py).

* every row is reachable from its route function, and each route function answers only with
  rows of its own call kind;
* on CPU no call ever reaches torch's flash kernel (it needs a CUDA GPU);
* the routes through torch's flash kernel compute what the twins' other routes compute: here the
  kernel is replaced by a float64 emulation of its contract (tests/helpers/torch_flash.py: dense and
  packed layouts, cu_seqlens, seqused_k, causal/window, GQA, LSE), so the plumbing around it
  (cu_seqlens strides, in-place cache appends, rotary positions, LSE layouts, gradients) is
  checked on CPU. The kernel itself is checked against the real flash-attn on the GPU
  (tests/gpu/test_twins_gpu.py). flash-attn's deterministic=True: tests/test_twin_determinism.py.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import tensors
from helpers.tensors import i32
from helpers.torch_flash import close, without_flash

import attnguard.fallback as fb
from attnguard.fallback import routes, torch_flash

F64 = torch.float64
# drawn in the dtype asked for (float64 unless said)
rand = functools.partial(tensors.rand, dtype=F64, draw=None)


# --- the table ------------------------------------------------------------------------------


def test_every_row_is_reachable_from_its_route_function():
    seen: dict[str, set[str]] = {
        "dense": set(),
        "varlen": set(),
        "kvcache": set(),
        "xformers": set(),
    }
    windows = [(-1, -1), (-1, 0), (3, 0), (2, 5), (-1, 4)]
    for ok, w, (sq, sk), cap, alibi, lse, det, torch_det, gpu in itertools.product(
        (True, False),
        windows,
        ((4, 4), (2, 6)),
        (0.0, 5.0),
        *[(True, False)] * 5,
    ):
        seen["dense"].add(
            routes.dense(
                flash_ok=ok,
                window=w,
                sq=sq,
                sk=sk,
                softcap=cap,
                alibi=alibi,
                need_lse=lse,
                deterministic=det,
                torch_deterministic=torch_det,
                gpu=gpu,
            )
        )
    for ok, cap, alibi, paged, comp in itertools.product(*[(True, False)] * 5):
        seen["varlen"].add(
            routes.varlen(flash_ok=ok, softcap=float(cap), alibi=alibi, paged=paged, compiling=comp)
        )
    for flags in itertools.product(*[(True, False)] * 8):
        decode, ok, contiguous, paged, batch_idx, leftpad, cap, alibi = flags
        seen["kvcache"].add(
            routes.kvcache(
                decode=decode,
                flash_ok=ok,
                contiguous=contiguous,
                paged=paged,
                batch_idx=batch_idx,
                leftpad=leftpad,
                softcap=float(cap),
                alibi=alibi,
            )
        )
    for ok, kind, equal in itertools.product(
        (True, False), (None, "none", "top_left", "bottom_right"), (True, False)
    ):
        seen["xformers"].add(routes.xformers(flash_ok=ok, block_kind=kind, equal_lengths=equal))
    for call, ids in seen.items():
        assert ids == {r.id for r in routes.TABLE if r.call == call}, call
    kinds = {"torch_flash", "sdpa", "sdpa_mask", "explicit", "per_sequence", "padded"}
    kinds.add("triton_decode")
    for row in routes.TABLE:
        assert row.kernel in kinds and row.when and row.why
        assert f"``{row.kernel}``" in routes.__doc__  # the module's prose names every kernel


def test_no_torch_flash_route_without_the_kernel():
    """flash_ok=False (CPU, fp32, an old GPU) never answers a torch_flash row."""
    for row in routes.TABLE:
        if row.kernel == "torch_flash":
            assert "torch's flash kernel can run" in row.when


def test_cpu_calls_never_reach_torch_flash(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("torch's flash kernel called on CPU")

    monkeypatch.setattr(torch_flash, "attention", refuse)
    q, k, v = rand(2, 5, 4, 8, seed=1), rand(2, 7, 2, 8, seed=2), rand(2, 7, 2, 8, seed=3)
    assert not torch_flash.can_run(q, k, v)
    fb.flash_attn_func(q, k, v, causal=True, window_size=(2, 0), return_attn_probs=True)
    cu = i32([0, 3, 7])
    fb.flash_attn_varlen_func(q[0, :5].repeat(2, 1, 1)[:7], k[0], v[0], cu, cu, 4, 4, causal=True)
    kc, vc = rand(2, 9, 2, 8, seed=4), rand(2, 9, 2, 8, seed=5)
    fb.flash_attn_with_kvcache(q[:, :1], kc, vc, k[:, :1], v[:, :1], cache_seqlens=i32([2, 4]))


@pytest.mark.parametrize(
    "window, causal", [((-1, -1), True), ((-1, -1), False), ((3, 0), False), ((2, 1), True)]
)
def test_varlen_on_torch_flash_equals_per_sequence(emulated, window, causal):
    lens_q, lens_k = [5, 1, 9, 4, 4], [5, 3, 9, 6, 4]
    cu_q = i32([0, *itertools.accumulate(lens_q)])
    cu_k = i32([0, *itertools.accumulate(lens_k)])
    q = rand(sum(lens_q), 6, 8, seed=10, requires_grad=True)
    k = rand(sum(lens_k), 2, 8, seed=11, requires_grad=True)
    v = rand(sum(lens_k), 2, 8, seed=12, requires_grad=True)
    kw = dict(causal=causal, window_size=window, return_attn_probs=True, softmax_scale=0.3)
    out, lse, _ = fb.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, **kw)
    assert emulated, "the varlen-flash route was not taken"
    ref, ref_lse, _ = without_flash(fb.flash_attn_varlen_func, q, k, v, cu_q, cu_k, 9, 9, **kw)
    close(out, ref)
    close(lse, ref_lse)
    g = rand(*out.shape, seed=13)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads, strict=True):
        close(a, b)


@pytest.mark.parametrize("sq, sk, window", [(3, 8, (-1, -1)), (8, 3, (-1, -1)), (6, 6, (2, 0))])
def test_dense_windows_and_lse_on_torch_flash(emulated, sq, sk, window):
    q, k, v = rand(2, sq, 4, 8, seed=20), rand(2, sk, 2, 8, seed=21), rand(2, sk, 2, 8, seed=22)
    kw = dict(causal=True, window_size=window, return_attn_probs=True)
    out, lse, _ = fb.flash_attn_func(q, k, v, **kw)
    assert emulated
    ref, ref_lse, _ = without_flash(fb.flash_attn_func, q, k, v, **kw)
    close(out, ref)
    close(lse, ref_lse)


def kvcache_case(seqlens, rotary, sq=1, sn=1, b=3, cap=16, h=4, hk=2, d=8):
    q = rand(b, sq, h, d, seed=30)
    kc, vc = rand(b + 1, cap, hk, d, seed=31), rand(b + 1, cap, hk, d, seed=32)
    k = v = None
    if sn:
        k, v = rand(b, sn, hk, d, seed=33), rand(b, sn, hk, d, seed=34)
    kw = {"cache_seqlens": seqlens}
    if rotary:
        kw.update(rotary_cos=rand(cap, d // 4, seed=35), rotary_sin=rand(cap, d // 4, seed=36))
    return q, kc, vc, k, v, kw


@pytest.mark.parametrize(
    "seqlens, rotary, sq, sn, causal, window",
    [
        (i32([3, 0, 11]), False, 1, 1, True, (-1, -1)),  # decode, a fresh row included
        (i32([3, 0, 11]), True, 1, 1, True, (-1, -1)),  # with rotary (interleaved)
        (i32([2, 5, 7]), False, 4, 4, True, (-1, -1)),  # chunked prefill
        (i32([2, 5, 7]), True, 3, 3, False, (2, 1)),  # rotary, a window, not causal
        (6, False, 1, 1, True, (-1, -1)),  # an int cache_seqlens
        (i32([4, 9, 1]), False, 2, 0, True, (-1, -1)),  # no new keys
        (None, False, 2, 0, False, (-1, -1)),  # the whole cache
    ],
)
def test_kvcache_on_torch_flash_equals_the_general_path(
    emulated, seqlens, rotary, sq, sn, causal, window
):
    q, kc, vc, k, v, kw = kvcache_case(seqlens, rotary, sq=sq, sn=sn)
    kw.update(causal=causal, window_size=window, return_softmax_lse=True)
    kc1, vc1 = kc.clone(), vc.clone()
    out, lse = fb.flash_attn_with_kvcache(q, kc1, vc1, k, v, **kw)
    assert emulated, "the kvcache-flash route was not taken"
    assert emulated[-1].get("seqused_k") is not None or seqlens is None
    kc2, vc2 = kc.clone(), vc.clone()
    ref, ref_lse = without_flash(fb.flash_attn_with_kvcache, q, kc2, vc2, k, v, **kw)
    close(out, ref)
    close(lse, ref_lse)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)  # the same in-place appends


def test_kvcache_fast_path_leaves_other_rows_of_the_cache_alone(emulated):
    q, kc, vc, k, v, kw = kvcache_case(i32([3, 0, 11]), False)
    before = kc.clone()
    fb.flash_attn_with_kvcache(q, kc, vc, k, v, **kw)
    changed = (kc != before).any(dim=(2, 3)).nonzero().tolist()
    assert changed == [[0, 3], [1, 0], [2, 11]]  # one new key per row, at its length


def test_kvcache_decode_kernel_that_cannot_run_leaves_the_call_to_torchs_kernels(
    emulated, monkeypatch
):
    """Where the decode kernel is asked but declines (Triton absent, a build or first launch
    that fails, a call it does not take), the call is computed by the next row of the table,
    with the same appends and numbers as a call never offered to it."""
    from attnguard.fallback import triton_decode

    asked = []
    monkeypatch.setattr(triton_decode, "decode", lambda *a, **k: asked.append(1))
    q, kc, vc, k, v, kw = kvcache_case(i32([3, 0, 11]), False)
    kw.update(causal=True, return_softmax_lse=True)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    out, lse = fb.flash_attn_with_kvcache(q, kc1, vc1, k, v, **kw)
    assert asked and emulated, "the decode row first, then torch's flash kernel"
    monkeypatch.setattr(routes, "kvcache", lambda decode=False, **f: "kvcache-general")
    ref, ref_lse = without_flash(fb.flash_attn_with_kvcache, q, kc2, vc2, k, v, **kw)
    close(out, ref)
    close(lse, ref_lse)
    assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2)


def test_kvcache_decode_kernel_without_triton_declines_and_says_why(monkeypatch):
    from attnguard.fallback import triton_decode

    monkeypatch.setitem(triton_decode._state, "kernels", None)
    monkeypatch.setitem(triton_decode._state, "why_not", None)
    monkeypatch.setattr(triton_decode, "_build", lambda: 1 / 0)
    assert triton_decode._kernels() is None
    assert "ZeroDivisionError" in triton_decode.disabled()
    q = torch.zeros(1, 1, 4, 8)
    assert (
        triton_decode.decode(q, q, q, None, None, None, scale=1.0, window_left=-1, need_lse=0)
        is None
    )


@pytest.mark.parametrize("kind", ["BlockDiagonalMask", "BlockDiagonalCausalFromBottomRightMask"])
def test_xformers_blocks_on_torch_flash(emulated, kind):
    from types import SimpleNamespace

    q_lens, k_lens = [3, 5, 2], [4, 5, 6]

    def info(lens):
        starts = [0, *itertools.accumulate(lens)]
        return SimpleNamespace(seqstart_py=starts, seqstart=i32(starts), max_seqlen=max(lens))

    bias = type(kind, (), {"materialize": lambda *a, **k: None})()
    bias.q_seqinfo, bias.k_seqinfo = info(q_lens), info(k_lens)
    q = rand(1, sum(q_lens), 4, 8, seed=40)
    k, v = rand(1, sum(k_lens), 4, 8, seed=41), rand(1, sum(k_lens), 4, 8, seed=42)
    out = fb.xformers_memory_efficient_attention(q, k, v, attn_bias=bias)
    assert emulated
    ref = without_flash(fb.xformers_memory_efficient_attention, q, k, v, attn_bias=bias)
    close(out, ref)
