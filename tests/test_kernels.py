"""The table of which torch kernel computes a twin's call (attnguard/fallback/kernels.py).

* every row is reachable from its route function, and each route function answers only with
  rows of its own call kind;
* on CPU no call ever reaches torch's flash kernel (it needs a CUDA GPU);
* the routes through torch's flash kernel compute what the twins' other routes compute: here the
  kernel is replaced by a float64 emulation of its contract written in this file (dense and
  packed layouts, cu_seqlens, seqused_k, causal/window, GQA, LSE), so the plumbing around it
  (cu_seqlens strides, in-place cache appends, rotary positions, LSE layouts, gradients) is
  checked on CPU. The kernel itself is checked against the real flash-attn on the GPU
  (tests/gpu/test_twins_gpu.py).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import attnguard.fallback as fb
from attnguard.fallback import kernels, torch_flash

F64 = torch.float64


def rand(*shape, seed=0, dtype=F64, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g, dtype=dtype)
    return t.requires_grad_(requires_grad)


def i32(values):
    return torch.tensor(values, dtype=torch.int32)


# --- the table ------------------------------------------------------------------------------


def test_every_row_is_reachable_from_its_route_function():
    seen: dict[str, set[str]] = {
        "dense": set(),
        "varlen": set(),
        "kvcache": set(),
        "xformers": set(),
    }
    windows = [(-1, -1), (-1, 0), (3, 0), (2, 5), (-1, 4)]
    for ok, w, (sq, sk), cap, alibi, lse in itertools.product(
        (True, False), windows, ((4, 4), (2, 6)), (0.0, 5.0), (True, False), (True, False)
    ):
        seen["dense"].add(
            kernels.dense(
                flash_ok=ok, window=w, sq=sq, sk=sk, softcap=cap, alibi=alibi, need_lse=lse
            )
        )
    for ok, cap, alibi, paged, comp in itertools.product(*[(True, False)] * 5):
        seen["varlen"].add(
            kernels.varlen(
                flash_ok=ok, softcap=float(cap), alibi=alibi, paged=paged, compiling=comp
            )
        )
    for flags in itertools.product(*[(True, False)] * 7):
        ok, contiguous, paged, batch_idx, leftpad, cap, alibi = flags
        seen["kvcache"].add(
            kernels.kvcache(
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
        seen["xformers"].add(kernels.xformers(flash_ok=ok, block_kind=kind, equal_lengths=equal))
    for call, ids in seen.items():
        assert ids == {r.id for r in kernels.TABLE if r.call == call}, call
    kinds = {"torch_flash", "sdpa", "sdpa_mask", "explicit", "per_sequence", "padded"}
    for row in kernels.TABLE:
        assert row.kernel in kinds and row.when and row.why
        assert f"``{row.kernel}``" in kernels.__doc__  # the module's prose names every kernel


def test_no_torch_flash_route_without_the_kernel():
    """flash_ok=False (CPU, fp32, an old GPU) never answers a torch_flash row."""
    for row in kernels.TABLE:
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


# --- torch's flash kernel, emulated in float64 ------------------------------------------------


def _attend(q, k, v, scale, left, right):
    """One sequence: q (Sq, H, D), k/v (Sk, Hk, D), flash-attn's bottom-right band."""
    sq, h, _ = q.shape
    sk, hk = k.shape[0], k.shape[1]
    if sk == 0:
        return q.new_zeros(sq, h, v.shape[-1]), torch.full((h, sq), math.inf, dtype=F64)
    kk = k.repeat_interleave(h // hk, dim=1)
    vv = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(F64), kk.to(F64)) * scale
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", p, vv.to(F64))
    return out, lse.masked_fill(torch.isneginf(lse), math.inf)


def fake_flash_op(
    q,
    k,
    v,
    cu_q,
    cu_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    return_debug_mask,
    *,
    scale=None,
    window_size_left=None,
    window_size_right=None,
    seqused_k=None,
    alibi_slopes=None,
):
    assert dropout_p == 0.0 and alibi_slopes is None and not return_debug_mask
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    left = -1 if window_size_left is None else window_size_left
    right = 0 if is_causal else (-1 if window_size_right is None else window_size_right)
    if cu_q is None:  # dense (B, S, H, D)
        outs, lses = zip(
            *(_attend(q[b], k[b], v[b], scale, left, right) for b in range(q.shape[0])),
            strict=True,
        )
        return torch.stack(outs).to(q.dtype), torch.stack(lses).float(), None, None, None
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    outs, lses = [], []
    for i in range(cu_q.shape[0] - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        assert q1 - q0 <= max_q and k1 - k0 <= max_k
        if seqused_k is not None:
            assert seqused_k.dtype == torch.int32
            k1 = k0 + int(seqused_k[i])
        o, lse = _attend(q[q0:q1], k[k0:k1], v[k0:k1], scale, left, right)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses, dim=1).float(), None, None, None


@pytest.fixture
def emulated(monkeypatch):
    """torch's flash kernel 'available' on CPU, computed by the emulation above; the calls it
    received are recorded."""
    calls = []

    def op(*args, **kwargs):
        calls.append(kwargs)
        return fake_flash_op(*args, **kwargs)

    monkeypatch.setattr(torch_flash, "_OP", op)
    monkeypatch.setattr(torch_flash, "can_run", lambda *a, **k: True)
    return calls


def without_flash(fn, *args, **kwargs):
    """The same twin call with torch's flash kernel unavailable (its other routes)."""
    saved = torch_flash.can_run
    torch_flash.can_run = lambda *a, **k: False
    try:
        return fn(*args, **kwargs)
    finally:
        torch_flash.can_run = saved


def close(a, b):
    torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


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
