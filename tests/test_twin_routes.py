"""The table of which torch kernel computes a twin's call (attnguard/fallback/routes.py).

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
from attnguard.fallback import routes, torch_flash

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


# --- determinism: flash-attn's deterministic=True -------------------------------------------


def test_a_deterministic_call_on_a_gpu_never_reaches_sdpa_without_torchs_flag():
    """SDPA's GPU backwards (cuDNN, memory-efficient) are not reproducible unless torch's own flag
    is on; a call without deterministic=True routes as before, whatever the flags."""
    windows = [(-1, -1), (-1, 0), (3, 0)]
    for ok, w, (sq, sk), cap, alibi, lse, torch_det, gpu in itertools.product(
        (True, False), windows, ((4, 4), (2, 6)), (0.0, 5.0), *[(True, False)] * 4
    ):
        kw = dict(flash_ok=ok, window=w, sq=sq, sk=sk, softcap=cap, alibi=alibi, need_lse=lse)
        plain = routes.dense(**kw)
        assert routes.dense(**kw, torch_deterministic=torch_det, gpu=gpu) == plain
        det = routes.dense(**kw, deterministic=True, torch_deterministic=torch_det, gpu=gpu)
        kernel = routes.ROUTES[det].kernel
        if gpu and not torch_det:
            assert kernel in ("torch_flash", "explicit"), (kw, det)
        if ok and not alibi and cap == 0:
            assert kernel == "torch_flash", (kw, det)  # its deterministic mode, see below
        if not ok and (torch_det or not gpu):  # SDPA's kernels reproduce there
            assert det == plain, (kw, det)


def emulated_deterministic(calls):
    """torch_flash._DETERMINISTIC (the custom op) emulated on CPU: the same call as aten's
    forward, recorded."""

    def op(q, k, v, cu_q, cu_k, max_q, max_k, p, causal, scale, left, right):
        calls.append({"cu": cu_q is not None, "window": (left, right), "causal": causal})
        kw = {"scale": scale}
        if left is not None:
            kw.update(window_size_left=left, window_size_right=right)
        out, lse = fake_flash_op(q, k, v, cu_q, cu_k, max_q, max_k, p, causal, False, **kw)[:2]
        return out, lse, None, None

    return op


@pytest.mark.parametrize(
    "sq, sk, kw",
    [
        (6, 6, {"causal": True}),
        (6, 6, {}),
        (3, 8, {"causal": True}),
        (6, 6, {"causal": True, "window_size": (2, 0)}),
        (6, 6, {"causal": True, "return_attn_probs": True}),
    ],
)
def test_dense_deterministic_calls_take_the_deterministic_kernel(emulated, monkeypatch, sq, sk, kw):
    calls = []
    monkeypatch.setattr(torch_flash, "_DETERMINISTIC", emulated_deterministic(calls))
    q = rand(2, sq, 4, 8, seed=50, requires_grad=True)
    k = rand(2, sk, 2, 8, seed=51, requires_grad=True)
    v = rand(2, sk, 2, 8, seed=52, requires_grad=True)
    got = fb.flash_attn_func(q, k, v, deterministic=True, **kw)
    assert len(calls) == 1 and not emulated  # the deterministic op, not the plain one
    assert calls[0]["window"] == ((2, 0) if "window_size" in kw else (None, None))
    ref = fb.flash_attn_func(q, k, v, **kw)  # without deterministic=True: its usual route
    got, ref = (x[0] if isinstance(x, tuple) else x for x in (got, ref))
    close(got, ref)
    g = rand(*got.shape, seed=53)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True
    ):
        close(a, b)
    emulated.clear()
    with torch.no_grad():  # no backward to make reproducible: the plain op
        fb.flash_attn_func(q, k, v, deterministic=True, **kw)
    assert len(calls) == 1 and len(emulated) == 1


def test_varlen_deterministic_calls_take_the_deterministic_kernel(emulated, monkeypatch):
    calls = []
    monkeypatch.setattr(torch_flash, "_DETERMINISTIC", emulated_deterministic(calls))
    lens = [5, 1, 9, 4]
    cu = i32([0, *itertools.accumulate(lens)])
    q = rand(sum(lens), 6, 8, seed=60, requires_grad=True)
    k = rand(sum(lens), 2, 8, seed=61, requires_grad=True)
    v = rand(sum(lens), 2, 8, seed=62, requires_grad=True)
    got = fb.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True, deterministic=True)
    assert calls == [{"cu": True, "window": (None, None), "causal": True}] and not emulated
    ref = fb.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)
    close(got, ref)
    g = rand(*got.shape, seed=63)
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True
    ):
        close(a, b)


class _Ctx:
    """What torch.library's autograd hands setup_context / backward, reduced to what they use."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors

    def mark_non_differentiable(self, *tensors):
        self.non_differentiable = tensors


def _bind(op, args, kwargs):
    names = [a.name for a in op.default._schema.arguments]
    return {**dict(zip(names, args, strict=False)), **kwargs}


@pytest.mark.parametrize("window", [(None, None), (7, 0)])
def test_the_deterministic_ops_hand_aten_its_arguments(monkeypatch, window):
    """The custom ops' forward and backward against aten's own schemas, by argument name, and
    the backward kernel launched with torch's deterministic flag on (warn-only off, no
    uninitialised-memory filling), the flags restored after."""
    q, k, v, cu_q, cu_k, rng, unused, g = (torch.zeros(1) + i for i in range(8))
    out, lse = torch.zeros(2), torch.zeros(3)
    left, right = window
    seen = {}

    def forward(*args, **kwargs):
        seen["fwd"] = _bind(torch.ops.aten._flash_attention_forward, args, kwargs)
        return out, lse, rng, unused, None

    def backward(*args, **kwargs):
        seen["bwd"] = _bind(torch.ops.aten._flash_attention_backward, args, kwargs)
        seen["flags"] = (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory,
        )
        return "dq", "dk", "dv"

    monkeypatch.setattr(torch_flash, "_OP", forward)
    monkeypatch.setattr(torch_flash, "_BACKWARD", backward)
    monkeypatch.setattr(torch_flash, "_DETERMINISTIC_BACKWARD", torch_flash._backward_impl)
    inputs = (q, k, v, cu_q, cu_k, 11, 13, 0.25, True, 0.5, left, right)
    outputs = torch_flash._forward_impl(*inputs)
    fwd = seen["fwd"]
    assert [fwd[n] for n in ("query", "key", "value", "cum_seq_q", "cum_seq_k")] == [
        q,
        k,
        v,
        cu_q,
        cu_k,
    ]
    assert (fwd["max_q"], fwd["max_k"], fwd["dropout_p"], fwd["is_causal"]) == (11, 13, 0.25, True)
    assert fwd["return_debug_mask"] is False and fwd["scale"] == 0.5
    assert (fwd.get("window_size_left"), fwd.get("window_size_right")) == window
    assert outputs == (out, lse, rng, unused)

    ctx = _Ctx()
    torch_flash._setup_context(ctx, inputs, outputs)
    assert ctx.non_differentiable == (lse,)
    grads = torch_flash._backward(ctx, g, None, None, None)
    assert grads == ("dq", "dk", "dv") + (None,) * 9  # one per input of the forward op
    bwd = seen["bwd"]
    names = ["grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k"]
    assert [bwd[n] for n in names] == [g, q, k, v, out, lse, cu_q, cu_k]
    assert (bwd["max_q"], bwd["max_k"], bwd["dropout_p"], bwd["is_causal"]) == (11, 13, 0.25, True)
    rng_names = [a.name for a in torch.ops.aten._flash_attention_backward.default._schema.arguments]
    assert bwd[rng_names[12]] is rng and bwd[rng_names[13]] is unused  # philox seed / offset
    assert bwd["scale"] == 0.5
    assert (bwd.get("window_size_left"), bwd.get("window_size_right")) == window
    assert seen["flags"] == (True, False, False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory


@pytest.mark.parametrize("on, warn_only", [(False, False), (True, False), (True, True)])
def test_the_deterministic_flag_is_set_for_the_call_and_restored(on, warn_only):
    """Whatever the caller had set comes back, also when the kernel raises."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    try:
        inside = []

        def kernel():
            inside.append(
                (
                    torch.are_deterministic_algorithms_enabled(),
                    torch.is_deterministic_algorithms_warn_only_enabled(),
                    torch.utils.deterministic.fill_uninitialized_memory,
                )
            )
            raise RuntimeError("the kernel's own error")

        with pytest.raises(RuntimeError, match="the kernel's own error"):
            torch_flash._call_with_deterministic_flag(kernel)
        # deterministic, not warn-only; memory filling as the caller had it when the flag was
        # theirs, off when attnguard switched the flag on
        assert inside == [(True, False, fill and on)]
        assert torch.are_deterministic_algorithms_enabled() == on
        assert torch.is_deterministic_algorithms_warn_only_enabled() == warn_only
        assert torch.utils.deterministic.fill_uninitialized_memory == fill
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_registered_ops_differentiate_and_compile_whole():
    """The custom ops as torch sees them (registration, autograd, fake implementations), on meta
    tensors: shapes of outputs and gradients, and one graph under torch.compile."""
    if not torch_flash.DETERMINISTIC_BACKWARD:
        pytest.skip("this torch cannot register the ops")
    meta = {"device": "meta", "dtype": torch.bfloat16}

    def attend(q, k, v, cu):
        out, lse = torch_flash.attention(
            q,
            k,
            v,
            cu,
            cu,
            q.shape[-3] if cu is None else 20,
            k.shape[-3] if cu is None else 20,
            dropout_p=0.0,
            scale=0.1,
            window=(5, 0),
            deterministic=True,
        )
        return out, lse

    for cu in (None, torch.empty(3, dtype=torch.int32, device="meta")):
        lead = (2, 20) if cu is None else (40,)
        q = torch.empty(*lead, 8, 100, **meta, requires_grad=True)  # head_dim padded to 104
        k = torch.empty(*lead, 2, 100, **meta, requires_grad=True)
        # static shapes: the dense and the packed call are two graphs (torch 2.4 cannot pad a
        # head dim that a recompilation made symbolic; a model's head dim never changes)
        compiled = torch.compile(attend, fullgraph=True, backend="aot_eager", dynamic=False)
        for fn in (attend, compiled):
            out, lse = fn(q, k, k, cu)
            assert out.shape == q.shape and not lse.requires_grad
            assert lse.shape == ((2, 8, 20) if cu is None else (8, 40))
            dq, dk = torch.autograd.grad(out.sum(), (q, k))
            assert dq.shape == q.shape and dk.shape == k.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_calls_on_cpu_reproduce(dtype):
    """On CPU determinism changes no route (SDPA's CPU kernels reproduce): repeated backward
    passes give the same bits."""
    lens = [37, 5, 64]
    cu = i32([0, *itertools.accumulate(lens)])

    def run(call):
        q = rand(2, 64, 8, 32, seed=70, dtype=torch.float32).to(dtype).requires_grad_()
        k = rand(2, 64, 2, 32, seed=71, dtype=torch.float32).to(dtype).requires_grad_()
        v = rand(2, 64, 2, 32, seed=72, dtype=torch.float32).to(dtype).requires_grad_()
        out = call(q, k, v)
        return [out.detach(), *torch.autograd.grad(out, (q, k, v), torch.ones_like(out))]

    calls = [
        lambda q, k, v: fb.flash_attn_func(q, k, v, causal=True, deterministic=True),
        lambda q, k, v: fb.flash_attn_func(
            q, k, v, causal=True, window_size=(9, 0), deterministic=True
        ),
        lambda q, k, v: fb.flash_attn_varlen_func(
            q.flatten(0, 1)[:106],
            k.flatten(0, 1)[:106],
            v.flatten(0, 1)[:106],
            cu,
            cu,
            64,
            64,
            causal=True,
            deterministic=True,
        ),
    ]
    for call in calls:
        first = run(call)
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(run(call), first, strict=True))


def test_the_explicit_path_computes_what_masked_sdpa_computes():
    """The kernel of the deterministic rows where torch's flash kernel cannot run (explicit)
    against masked SDPA, on a padded batch's masks: outputs and gradients."""
    from attnguard.fallback.masks import padded_band
    from attnguard.fallback.sdpa import masked_attention

    len_q, len_k = torch.tensor([3, 6]), torch.tensor([5, 6])
    keep, empty, _ = padded_band(len_q, len_k, 6, 6, 2, 0)
    q = rand(2, 4, 6, 8, seed=80, requires_grad=True)
    k = rand(2, 2, 6, 8, seed=81, requires_grad=True)
    v = rand(2, 2, 6, 8, seed=82, requires_grad=True)
    kw = dict(keep=keep, empty=empty, bias_rows=None, scale=0.3, softcap=0.0, dropout_p=0.0)
    got, _ = masked_attention(q, k, v, need_lse=False, explicit=True, **kw)
    ref, _ = masked_attention(q, k, v, need_lse=False, **kw)
    rows = (torch.arange(6)[None, :] < len_q[:, None])[:, None, :, None]  # real query rows
    close(got * rows, ref * rows)
    g = rand(*got.shape, seed=83) * rows
    for a, b in zip(
        torch.autograd.grad(got, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g), strict=True
    ):
        close(a, b)
