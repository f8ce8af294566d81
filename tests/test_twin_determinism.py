"""flash-attn's deterministic=True on the twins (attnguard/fallback/routes.py, torch_flash.py): on
a GPU a deterministic call never reaches SDPA's kernels without torch's own flag; it takes
torch's flash kernel in its deterministic mode (custom ops handing aten its arguments, the flag
set for the call and restored) or the explicit path, which computes what masked SDPA computes;
on CPU repeated backward passes give the same bits. torch's flash kernel is emulated in float64
(tests/helpers/torch_flash.py).
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
from helpers import tensors
from helpers.tensors import i32
from helpers.torch_flash import close, fake_flash_op

import attnguard.fallback as fb
from attnguard.fallback import routes, torch_flash

F64 = torch.float64
# drawn in the dtype asked for (float64 unless said)
rand = functools.partial(tensors.rand, dtype=F64, draw=None)


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
