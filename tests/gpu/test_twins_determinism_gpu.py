"""flash-attn's ``deterministic=True`` twins on a CUDA GPU (H100/H200), against themselves and
against the REAL flash-attn kernel.

Determinism (flash-attn's ``deterministic=True``; ``torch.use_deterministic_algorithms(True)``):
repeated forward+backward passes of the same dense and packed calls (several lengths, head dims
64-256, bf16 and fp16, dropout with the RNG reseeded) must give bitwise-equal outputs and
gradients, on the table's deterministic rows, with torch's flag left as it was; also compiled
whole. These need no flash-attn, except the comparison with its ``deterministic=True`` kernel.

That comparison needs the real package with its CUDA extension (``flash_attn_2_cuda``) in
$TEST_REAL_FLASH_ATTN_DIR (the unpacked wheel; scripts/gpu_suite.sh sets it), put on sys.path by
the ``real`` fixture (tests/gpu/conftest.py); the stand-in from tests/standins never counts.
Skipped with the reason otherwise. The twins' other GPU tests: tests/gpu/test_twins_gpu.py.

Run: TEST_REAL_FLASH_ATTN_DIR=/tmp/flashsite pytest -m gpu tests/gpu/test_twins_determinism_gpu.py
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
    assert_out_close,
    cu_lens,
    randn,
)

from attnguard import fallback  # noqa: E402

# ------------------------------------------------------------------------------------------
# determinism: flash-attn's deterministic=True, torch.use_deterministic_algorithms(True)
# ------------------------------------------------------------------------------------------

# name: (batch, seqlen_q, seqlen_k, heads, kv heads, head_dim, kwargs). Few heads and long rows
# are where flash backwards split the keys most (atomic dq adds from many blocks).
DET_DENSE = {
    "causal_gqa_d128": (1, 2048, 2048, 4, 1, 128, {"causal": True}),
    "full_d64": (2, 1024, 1024, 8, 8, 64, {}),
    "window_d256": (1, 1536, 1536, 4, 2, 256, {"causal": True, "window_size": (255, 0)}),
    "bottom_right_d100": (2, 300, 900, 8, 2, 100, {"causal": True}),  # head_dim padded to 104
    "dropout_d64": (2, 512, 512, 8, 2, 64, {"causal": True, "dropout_p": 0.1}),
}
# name: (sequence lengths, heads, kv heads, head_dim, kwargs)
DET_PACKS = {
    "many_short_gqa_d128": ([64 + (37 * i) % 449 for i in range(48)], 16, 4, 128, {"causal": True}),
    "few_long_window_d64": ([512, 2048, 1000, 1536], 8, 2, 64, {"window_size": (255, 255)}),
    "two_long_d256": ([3000, 1100], 4, 1, 256, {"causal": True}),
}
RUNS = 4


def _runs(call, tensors, grad, runs=RUNS):
    """``runs`` forward+backward passes of ``call`` on fresh leaves of the same values (the RNG
    reseeded each time, for dropout): [(out, dq, dk, dv), ...]."""
    results = []
    for _ in range(runs):
        leaves = [t.detach().clone().requires_grad_() for t in tensors]
        torch.manual_seed(1234)
        out = call(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        results.append((out.detach(), *torch.autograd.grad(out, leaves, grad)))
    return results


def _assert_bitwise_reproducible(results):
    for n, got in enumerate(results[1:], 1):
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, results[0], strict=True):
            assert torch.equal(a, b), f"run {n}: {name} differs from run 0 (max |diff| " + (
                f"{(a.float() - b.float()).abs().max().item():.3g})"
            )


def _varied(results):
    return any(
        not torch.equal(a, b) for got in results[1:] for a, b in zip(got, results[0], strict=True)
    )


def _dense_case(case, dtype):
    b, sq, sk, h, hk, d, kw = DET_DENSE[case]
    tensors = (
        randn(b, sq, h, d, dtype=dtype, seed=90),
        randn(b, sk, hk, d, dtype=dtype, seed=91),
        randn(b, sk, hk, d, dtype=dtype, seed=92),
    )
    return tensors, randn(b, sq, h, d, dtype=dtype, seed=93), kw


def _pack_case(pack, dtype):
    lens, h, hk, d, kw = DET_PACKS[pack]
    total = sum(lens)
    tensors = (
        randn(total, h, d, dtype=dtype, seed=94),
        randn(total, hk, d, dtype=dtype, seed=95),
        randn(total, hk, d, dtype=dtype, seed=96),
    )
    cu, mx = cu_lens(lens), max(lens)
    return tensors, randn(total, h, d, dtype=dtype, seed=97), (cu, cu, mx, mx), kw


@pytest.fixture
def torch_deterministic(monkeypatch):
    """torch.use_deterministic_algorithms(True) for one test, the caller's setting restored;
    with the cuBLAS workspace setting torch then demands of any matmul (as a training recipe that
    asks for determinism sets it, e.g. transformers' enable_full_determinism)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _flags():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.utils.deterministic.fill_uninitialized_memory,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(DET_DENSE))
def test_dense_deterministic_true_is_bitwise_reproducible(routes, case, dtype):
    tensors, grad, kw = _dense_case(case, dtype)
    flags = _flags()
    results = _runs(
        lambda q, k, v: fallback.flash_attn_func(q, k, v, deterministic=True, **kw), tensors, grad
    )
    _assert_bitwise_reproducible(results)
    assert set(routes) == {"dense-deterministic-flash"}, routes
    assert _flags() == flags  # torch's flag was set for the backward kernel only
    baseline = _runs(lambda q, k, v: fallback.flash_attn_func(q, k, v, **kw), tensors, grad)
    print(f"{case} {dtype}: deterministic=False varied run to run: {_varied(baseline)}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pack", list(DET_PACKS))
def test_varlen_deterministic_true_is_bitwise_reproducible(routes, pack, dtype):
    tensors, grad, lens, kw = _pack_case(pack, dtype)
    flags = _flags()
    results = _runs(
        lambda q, k, v: fallback.flash_attn_varlen_func(q, k, v, *lens, deterministic=True, **kw),
        tensors,
        grad,
    )
    _assert_bitwise_reproducible(results)
    assert set(routes) == {"varlen-flash"}, routes
    assert _flags() == flags
    baseline = _runs(
        lambda q, k, v: fallback.flash_attn_varlen_func(q, k, v, *lens, **kw), tensors, grad
    )
    print(f"{pack} {dtype}: deterministic=False varied run to run: {_varied(baseline)}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["causal_gqa_d128", "window_d256", "bottom_right_d100"])
def test_under_torchs_deterministic_flag_the_twins_reproduce(torch_deterministic, case, dtype):
    """torch.use_deterministic_algorithms(True) and deterministic=False (transformers' default):
    torch's own kernels keep the promise (no cuDNN, deterministic flash / memory-efficient
    backwards), dense and packed."""
    tensors, grad, kw = _dense_case(case, dtype)
    _assert_bitwise_reproducible(
        _runs(lambda q, k, v: fallback.flash_attn_func(q, k, v, **kw), tensors, grad)
    )
    _assert_bitwise_reproducible(
        _runs(
            lambda q, k, v: fallback.flash_attn_func(q, k, v, deterministic=True, **kw),
            tensors,
            grad,
        )
    )
    assert torch.are_deterministic_algorithms_enabled()  # the caller's flag left on


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pack", ["many_short_gqa_d128", "two_long_d256"])
def test_under_torchs_deterministic_flag_packed_rows_reproduce(torch_deterministic, pack, dtype):
    tensors, grad, lens, kw = _pack_case(pack, dtype)
    _assert_bitwise_reproducible(
        _runs(lambda q, k, v: fallback.flash_attn_varlen_func(q, k, v, *lens, **kw), tensors, grad)
    )


@pytest.mark.parametrize(
    "name, dtype, kw, route",
    [
        ("fp32_causal", torch.float32, {"causal": True}, "dense-deterministic"),
        ("bf16_alibi", BF16, {"causal": True, "alibi": True}, "dense-deterministic"),
        ("fp16_softcap", FP16, {"causal": True, "softcap": 20.0}, "dense-softcap"),
    ],
)
def test_deterministic_calls_torchs_flash_kernel_cannot_take_reproduce(
    routes, name, dtype, kw, route
):
    """fp32, ALiBi, softcap: the explicit path (matmuls and a softmax), reproducible, and the
    same numbers as the usual route within the dtype's rounding."""
    kw = dict(kw)
    b, s, h, hk, d = 2, 384, 8, 2, 64
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = 2.0 ** -torch.arange(1, h + 1, device=CUDA, dtype=torch.float32)
    tensors = tuple(randn(b, s, n, d, dtype=dtype, seed=98 + i) for i, n in enumerate((h, hk, hk)))
    grad = randn(b, s, h, d, dtype=dtype, seed=101)
    results = _runs(
        lambda q, k, v: fallback.flash_attn_func(q, k, v, deterministic=True, **kw), tensors, grad
    )
    _assert_bitwise_reproducible(results)
    assert set(routes) == {route}, routes
    usual = _runs(lambda q, k, v: fallback.flash_attn_func(q, k, v, **kw), tensors, grad, runs=1)[0]
    tol = {torch.float32: 1e-4, BF16: 3e-2, FP16: 1e-2}[dtype]
    for name_, a, b_ in zip(("out", "dq", "dk", "dv"), results[0], usual, strict=True):
        err = (a.float() - b_.float()).abs().max().item()
        assert err <= tol * max(b_.float().abs().max().item(), 1e-3), f"{name_}: {err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_twins_match_the_kernel_with_deterministic_true(real, dtype):
    """The deterministic routes compute what flash-attn computes with deterministic=True."""
    tensors, grad, kw = _dense_case("causal_gqa_d128", dtype)
    got = _runs(
        lambda q, k, v: fallback.flash_attn_func(q, k, v, deterministic=True, **kw),
        tensors,
        grad,
        runs=1,
    )[0]
    ref = _runs(
        lambda q, k, v: real.flash_attn_func(q, k, v, deterministic=True, **kw),
        tensors,
        grad,
        runs=2,
    )
    _assert_bitwise_reproducible(ref)  # the kernel keeps its own promise here
    assert_out_close(got[0], ref[0][0], dtype)
    assert_grads_close(got[1:], ref[0][1:], dtype)
    tensors, grad, lens, kw = _pack_case("many_short_gqa_d128", dtype)
    got = _runs(
        lambda q, k, v: fallback.flash_attn_varlen_func(q, k, v, *lens, deterministic=True, **kw),
        tensors,
        grad,
        runs=1,
    )[0]
    ref = _runs(
        lambda q, k, v: real.flash_attn_varlen_func(q, k, v, *lens, deterministic=True, **kw),
        tensors,
        grad,
        runs=1,
    )[0]
    assert_out_close(got[0], ref[0], dtype)
    assert_grads_close(got[1:], ref[1:], dtype)


@pytest.mark.parametrize("call", ["dense", "varlen"])
def test_deterministic_calls_compile_whole_and_reproduce(call):
    """deterministic=True under torch.compile(fullgraph=True): the custom ops keep the backward's
    flag inside the compiled graph; repeated compiled passes give the same bits, and the eager
    call's numbers."""
    torch._dynamo.reset()
    if call == "dense":
        tensors, grad, kw = _dense_case("causal_gqa_d128", BF16)

        def twin(q, k, v):
            return fallback.flash_attn_func(q, k, v, deterministic=True, **kw)

    else:
        tensors, grad, lens, kw = _pack_case("few_long_window_d64", BF16)

        def twin(q, k, v):
            return fallback.flash_attn_varlen_func(q, k, v, *lens, deterministic=True, **kw)

    eager = _runs(twin, tensors, grad, runs=1)[0]  # eager first: the GPU's fitness is read there
    leaves = [t.detach().clone().requires_grad_() for t in tensors]  # the deterministic route
    explanation = torch._dynamo.explain(twin)(*leaves)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(twin, fullgraph=True)
    results = _runs(compiled, tensors, grad, runs=3)
    _assert_bitwise_reproducible(results)
    assert_out_close(results[0][0], eager[0], BF16)
    assert_grads_close(results[0][1:], eager[1:], BF16)
    assert not torch.are_deterministic_algorithms_enabled()
