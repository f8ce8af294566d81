"""The twins against the real flash-attn kernel on a CUDA GPU: seeded CUDA tensors, cu_seqlens,
and how close a twin's output, LSE and gradients must be to the kernel's
(tests/gpu/test_twins_gpu.py, tests/gpu/test_twins_determinism_gpu.py; their fixtures ``real``
and ``routes`` are in tests/gpu/conftest.py)."""

from __future__ import annotations

import torch

BF16, FP16 = torch.bfloat16, torch.float16
DTYPES = [BF16, FP16]
OUT_TOL = {BF16: 2e-2, FP16: 5e-3}  # relative to max |out| of the kernel
LSE_ATOL = 1e-3
GRAD_TOL = {BF16: 3e-2, FP16: 1e-2}  # relative to max |grad| of the kernel
CUDA = "cuda"


def randn(*shape, dtype=BF16, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return torch.randn(*shape, device=CUDA, generator=g, dtype=torch.float32).to(dtype)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=CUDA)


def cu_lens(lens):
    return i32([0, *torch.tensor(lens).cumsum(0).tolist()])


def assert_out_close(twin, kernel, dtype):
    assert twin.shape == kernel.shape and twin.dtype == kernel.dtype
    assert not torch.isnan(twin).any()
    err = (twin.float() - kernel.float()).abs().max().item()
    bound = OUT_TOL[dtype] * max(kernel.float().abs().max().item(), 1e-6)
    assert err <= bound, f"max |twin - flash-attn| = {err:.3g} > {bound:.3g}"


def assert_lse_close(twin, kernel):
    assert twin.shape == kernel.shape and twin.dtype == kernel.dtype == torch.float32
    empty = torch.isinf(kernel)
    assert torch.isposinf(kernel[empty]).all()
    assert torch.equal(torch.isposinf(twin), empty), "rows with no visible key differ"
    err = (twin[~empty] - kernel[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert err <= LSE_ATOL, f"max |lse twin - flash-attn| = {err:.3g}"


def assert_grads_close(got, ref, dtype):
    for name, a, b in zip("qkv", got, ref, strict=True):
        assert a.shape == b.shape and not torch.isnan(a).any(), name
        err = (a.float() - b.float()).abs().max().item()
        bound = GRAD_TOL[dtype] * max(b.float().abs().max().item(), 1e-3)
        assert err <= bound, f"d{name}: max |twin - kernel| {err:.4g} > {bound:.4g}"
