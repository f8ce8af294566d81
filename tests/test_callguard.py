"""Call-time guard: the shared decisions (dtype choice, masks, known errors, modes, fail-open).

Real torch kernels throughout; entry points that need a kernel which cannot run on CPU are
exercised in test_registry_guard.py / test_direct_entry.py.
"""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import tensors

import attnguard
from attnguard import callguard, dtypes, kernels
from attnguard.errors import AttnGuardError
from attnguard.fallback import registry
from attnguard.integrations.transformers import attention
from attnguard.observability import events

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
reference = functools.partial(tensors.reference, heads_first=True)  # q, k, v: (B, H, S, D)


class Attn(torch.nn.Module):
    """Minimal transformers-style attention module: weights in ``dtype``, is_causal."""

    def __init__(self, dtype=FP32, causal=True):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8, dtype=dtype)
        self.is_causal = causal


# --- the dtype decision ------------------------------------------------------------------------


def test_choose_dtype_prefers_autocast_then_module_then_half_input(guard):
    cpu = torch.device("cpu")
    mixed = (FP32, FP32, FP16)
    assert dtypes.choose_dtype(mixed, cpu) == FP16  # the half input; fp32 is the accident
    assert dtypes.choose_dtype(mixed, cpu, preferred=FP32) == FP32  # the module's dtype
    assert dtypes.choose_dtype(mixed, cpu, preferred=FP32, half_only=True) == FP16
    assert dtypes.choose_dtype((BF16, FP16, FP16), cpu) == BF16  # the query's half dtype
    assert dtypes.choose_dtype((FP32, torch.float64, FP32), cpu) == torch.float64
    # never float32 into a half-only kernel, even with no half input at all
    assert dtypes.choose_dtype((FP32, torch.float64, FP32), cpu, half_only=True) in (BF16, FP16)
    with torch.autocast("cpu", dtype=BF16):
        assert dtypes.choose_dtype(mixed, cpu, preferred=FP32) == BF16


def test_half_dtype_follows_setting(guard):
    assert (
        dtypes.half_dtype_for(torch.device("cpu"), attnguard.configure(dtype="fp16").dtype) == FP16
    )
    assert (
        dtypes.half_dtype_for(torch.device("cpu"), attnguard.configure(dtype="bf16").dtype) == BF16
    )


def test_module_dtype_reads_linear_weight_and_quantization_dtype():
    assert dtypes.module_dtype(Attn(BF16)) == BF16
    m = Attn(FP32)
    m.config = type("C", (), {"_pre_quantization_dtype": FP16})()
    assert dtypes.module_dtype(m) == FP16
    assert dtypes.module_dtype(torch.nn.ReLU()) is None


# --- masks: what a flash call gets -> what SDPA needs --------------------------------------------


def brute_keep(pad, sq, sk, causal, window=None):
    """(B, 1, sq, sk) keep mask by loops: bottom-right causal, window i - j < w, padding."""
    b = pad.shape[0]
    keep = torch.zeros(b, 1, sq, sk, dtype=torch.bool)
    for n in range(b):
        for i in range(sq):
            qi = i + sk - sq
            for j in range(sk):
                ok = bool(pad[n, j])
                if causal:
                    ok = ok and j <= qi
                if window is not None:
                    ok = ok and qi - j < window
                keep[n, 0, i, j] = ok
    return keep


@pytest.mark.parametrize(
    ("sq", "sk", "causal", "window"),
    [
        (6, 6, True, None),
        (2, 6, True, None),
        (1, 6, True, None),
        (6, 6, False, None),
        (6, 6, True, 3),
    ],
)
def test_flash_mask_matches_brute_force(sq, sk, causal, window):
    pad = torch.ones(3, sk, dtype=torch.long)
    pad[0, :2] = 0  # left padding
    pad[1, -1] = 0  # right padding
    keep, zero_rows, is_causal = registry.flash_mask_for_sdpa(
        pad,
        sq,
        sk,
        torch.device("cpu"),
        causal=causal,
        window=None if window is None else (window - 1, window - 1),
    )
    want = brute_keep(pad, sq, sk, causal, window)
    empty = ~want.any(-1)  # (B, 1, sq)
    assert not is_causal
    assert torch.equal(keep & ~empty.unsqueeze(-1), want)
    assert keep.any(-1).all()  # every row keeps a key: no NaN from SDPA
    zero = zero_rows[:, :, 0, 0]
    padded_query = pad[:, -sq:] == 0
    assert torch.equal(zero, padded_query | empty[:, 0])


def test_flash_mask_without_padding_uses_sdpa_causal_flag():
    cpu = torch.device("cpu")
    assert registry.flash_mask_for_sdpa(None, 5, 5, cpu, causal=True) == (None, None, True)
    assert registry.flash_mask_for_sdpa(None, 1, 5, cpu, causal=True) == (None, None, False)
    keep, _, is_causal = registry.flash_mask_for_sdpa(None, 2, 5, cpu, causal=True)
    assert not is_causal and torch.equal(keep[0, 0], brute_keep(torch.ones(1, 5), 2, 5, True)[0, 0])


def test_packed_sequences_from_position_ids_do_not_attend_across(guard):
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 7, 8) for _ in range(3))
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    out, _ = registry.flash_call_on_sdpa(Attn(), q, k, v, None, (), {"position_ids": pos})
    seg = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    keep = (seg[:, None] == seg[None, :]) & torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(out.double(), reference(q, k, v, keep), atol=1e-5, rtol=1e-5)


# --- known and unknown kernel errors ------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("FlashAttention only supports Ampere GPUs or newer.", "gpu_too_old"),
        ("FlashAttention only support fp16 and bf16 data type", "dtype_unsupported"),
        ("No available kernel. Aborting execution.", "no_sdpa_kernel"),
        ("FlashAttention forward only supports head dimension at most 256", "head_dim_unsupported"),
        (
            "No operator found for `memory_efficient_attention_forward` with inputs:\n  query: ...",
            "xformers_no_operator",
        ),
        (
            "Expected all tensors to be on the same device, but got mat2 is on cuda:1, "
            "different from other tensors on cuda:0",
            "device_mismatch",
        ),
        (
            "Could not run 'flash_attn::_flash_attn_forward' with arguments from the 'CPU' backend.",
            "cpu_backend",
        ),
    ],
)
def test_known_kernel_errors_are_classified_with_first_line(message, code):
    got = kernels.classify_kernel_error(RuntimeError(message))
    assert got == (code, message.splitlines()[0])


def test_unknown_errors_and_other_types_are_not_recoverable():
    assert kernels.classify_kernel_error(RuntimeError("CUDA out of memory")) is None
    assert kernels.classify_kernel_error(KeyError("head dimension")) is None
    assert kernels.classify_kernel_error(AttnGuardError("x", "head dimension", "y")) is None


def _sdpa_entry():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def test_unknown_kernel_error_propagates_untouched(guard):
    boom = RuntimeError("CUDA error: an illegal memory access was encountered")

    def kernel(module, query, key, value, attention_mask, **kw):
        raise boom

    fn = attention.wrap_registry_entry("sdpa", kernel)
    q = torch.randn(1, 2, 4, 8)
    with events.capture() as seen, pytest.raises(RuntimeError) as info:
        fn(Attn(), q, q, q, None)
    assert info.value is boom
    assert seen == []


def test_no_sdpa_kernel_is_recovered_and_site_latched(guard):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    fn = attention.wrap_registry_entry("sdpa", _sdpa_entry())
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    module = Attn()
    # CPU has no memory-efficient SDPA kernel: the real dispatcher raises.
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        with pytest.raises(RuntimeError):
            _sdpa_entry()(module, q, k, v, None)
        with events.capture() as seen:
            out, _ = fn(module, q, k, v, None, scaling=None)
            again, _ = fn(module, q, k, v, None, scaling=None)
    want = reference(q, k, v, torch.ones(5, 5, dtype=torch.bool).tril())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again, out)
    # the failing kernel is not retried: the second call goes straight to SDPA, and says so
    assert [e["event"] for e in seen] == ["kernel_error_recovered", "backend_rerouted"]
    assert [e["reason_code"] for e in seen] == ["no_sdpa_kernel", "no_sdpa_kernel"]
    assert seen[0]["applied"] is True and seen[1]["applied"] is True
    assert (
        seen[0]["error"].startswith("No viable backend")
        or "No available kernel" in seen[0]["error"]
    )
    assert ("sdpa", Attn) in callguard.latched


# --- modes, remedies switched off, fail-open ----------------------------------------------------


def _mixed():
    torch.manual_seed(1)
    return torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8).to(BF16)


def test_strict_mode_raises_instead_of_fixing(guard):
    attnguard.configure(mode="strict")
    fn = attention.wrap_registry_entry("sdpa", _sdpa_entry())
    q, k, v = _mixed()
    with pytest.raises(AttnGuardError) as info:
        fn(Attn(BF16), q, k, v, None)
    assert info.value.reason_code == "mixed_dtypes"


def test_warn_mode_reports_and_leaves_the_call_alone(guard):
    attnguard.configure(mode="warn")
    fn = attention.wrap_registry_entry("sdpa", _sdpa_entry())
    q, k, v = _mixed()
    with events.capture() as seen, pytest.raises(RuntimeError, match="same dtype"):
        fn(Attn(BF16), q, k, v, None)
    assert [(e["event"], e["applied"]) for e in seen] == [("qkv_unified", False)]


def test_disabled_remedy_is_not_applied(guard):
    attnguard.configure(disable="unify")
    fn = attention.wrap_registry_entry("sdpa", _sdpa_entry())
    q, k, v = _mixed()
    with events.capture() as seen, pytest.raises(RuntimeError, match="same dtype"):
        fn(Attn(BF16), q, k, v, None)
    assert seen == []


def test_inactive_guard_passes_calls_through(guard):
    fn = attention.wrap_registry_entry("sdpa", _sdpa_entry())
    attnguard.deactivate()
    q, k, v = _mixed()
    with pytest.raises(RuntimeError, match="same dtype"):
        fn(Attn(BF16), q, k, v, None)


def test_internal_error_runs_the_original_and_reports_once(guard, monkeypatch):
    sdpa = _sdpa_entry()
    fn = attention.wrap_registry_entry("sdpa", sdpa)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    module = Attn()
    callguard.latched[("sdpa", Attn)] = "no_sdpa_kernel"  # forces the slow path and the twin

    def broken(*a, **kw):
        raise ZeroDivisionError("bug in attnguard")

    monkeypatch.setattr(attention, "all_sdpa_backends", broken)
    with events.capture() as seen:
        out, _ = fn(module, q, k, v, None)
        out2, _ = fn(module, q, k, v, None)
    want, _ = sdpa(module, q, k, v, None)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out2, want)
    internal = [(e["event"], e["reason_code"]) for e in seen if e["event"] == "internal_error"]
    assert internal == [("internal_error", "ZeroDivisionError")]  # once, though it failed twice


def test_fast_path_calls_the_original_unchanged(guard):
    calls = []

    def kernel(module, query, key, value, attention_mask, **kw):
        calls.append((query, key, value, attention_mask, kw))
        return query.transpose(1, 2), None

    fn = attention.wrap_registry_entry("sdpa", kernel)
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4)
    with events.capture() as seen:
        fn(Attn(), q, k, v, mask, dropout=0.0, scaling=0.5)
    ((cq, ck, cv, cm, kw),) = calls
    assert cq is q and ck is k and cv is v and cm is mask and kw == {"dropout": 0.0, "scaling": 0.5}
    assert seen == []


def test_sdpa_reroute_math_matches_reference_with_gqa_and_sinks():
    torch.manual_seed(2)
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    keep = torch.ones(5, 5, dtype=torch.bool).tril()[None, None]
    out = registry.sdpa_bhsd(q, k, v, keep, dropout=0.0, scale=None, is_causal=False)
    torch.testing.assert_close(out.double(), reference(q, k, v, keep), atol=1e-5, rtol=1e-5)
    eager, weights = registry.eager_bhsd(q, k, v, keep, dropout=0.0, scale=None)
    torch.testing.assert_close(eager.double(), reference(q, k, v, keep), atol=1e-5, rtol=1e-5)
    assert weights.shape == (2, 4, 5, 5)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 5))
    sinks = torch.zeros(4)  # a zero-logit sink takes e^0 of the mass from every row
    _, w_sink = registry.eager_bhsd(q, k, v, keep, dropout=0.0, scale=None, sinks=sinks)
    assert bool((w_sink.sum(-1) < 1).all())
