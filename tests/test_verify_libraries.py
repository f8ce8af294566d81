"""The numbers check over every kind of entry point the guard knows, with the real libraries
where this machine has them: transformers' sdpa and flash registry entries (a real tiny model,
and the flash path on attnguard's twins), a flash-attn function called inside transformers' flash
entry (checked once, at the outer entry), xformers' ``memory_efficient_attention`` (its kernel
and its twin), diffusers' dispatcher backends (a real tiny Flux). Right kernels: no mismatch;
deliberately wrong ones: caught, and said as the kernel's or as attnguard's twin's.
"""

from __future__ import annotations

import inspect
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import tiny_config, tiny_inputs, tiny_model_class

import attnguard
from attnguard import callguard, kernels, runtime, verify
from attnguard.fallback import FLASH_FUNCTIONS, xformers_memory_efficient_attention
from attnguard.kernel_identity import Family
from attnguard.observability import numerics

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh_counts() -> Iterator[None]:
    verify.reset()
    callguard.reset_latches()
    yield
    verify.reset()
    callguard.reset_latches()


def said(captured: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [
        (e["reason_code"], e["computed_by"], e["reference"])
        for e in captured
        if e["event"] == "numerics_mismatch"
    ]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> torch.Tensor:
    """(B, H, S, D) attention in float32 with optional ``bias`` and ``causal`` (top-left)."""
    h, hk = q.shape[1], k.shape[1]
    k, v = (x.float().repeat_interleave(h // hk, dim=1) for x in (k, v))
    s = q.float() @ k.transpose(-1, -2) * kw.get("scale", q.shape[-1] ** -0.5)
    if kw.get("bias") is not None:
        s = s + kw["bias"]
    if kw.get("causal"):
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    return (torch.softmax(s, dim=-1) @ v).to(q.dtype)


# --- transformers ------------------------------------------------------------------------------


@pytest.mark.parametrize("implementation", ["sdpa", "flash_attention_2"])
def test_a_real_model_passes_every_check(
    implementation: str, captured: list[dict[str, Any]]
) -> None:
    """A tiny Llama, left-padded batch, every call checked: transformers' sdpa (against the
    explicit reference) and its flash path on attnguard's twins here (flash-attn cannot run on a
    CPU; against transformers' flash entry computed on SDPA)."""
    attnguard.activate(log="none", verify="all")
    torch.manual_seed(0)
    model = tiny_model_class("llama")(tiny_config("llama", attn_implementation=implementation))
    with torch.no_grad():
        model(**tiny_inputs("llama"))
        model(input_ids=tiny_inputs("llama")["input_ids"][1:])
    counts = numerics.snapshot()
    assert counts == {"checked": 4, "mismatched": 0, "skipped": {}}, counts
    assert said(captured) == []


def test_a_wrong_sdpa_kernel_under_transformers_sdpa_entry_is_caught(
    monkeypatch: pytest.MonkeyPatch, captured: list[dict[str, Any]]
) -> None:
    """SDPA's fused kernels serve half precision; one wrong on this machine (here: causal
    dropped for bfloat16) is caught against the explicit reference and against transformers'
    own function run in float64, which SDPA computes on its math path."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnguard.integrations.transformers import attention

    real = torch.nn.functional.scaled_dot_product_attention

    def fused(query, key, value, *args, **kwargs):
        if query.dtype is torch.bfloat16:
            kwargs["is_causal"] = False
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fused)
    attnguard.activate(log="none", verify="all")
    entry = attention.wrap_registry_entry("sdpa", sdpa_attention_forward)
    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8, 16, generator=g) for _ in range(3))
    entry(module, q, k, v, None)  # float32: right
    entry(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert numerics.snapshot() == {"checked": 2, "mismatched": 1, "skipped": {}}
    assert said(captured) == [("kernel_numbers_differ", "kernel", "explicit_float64")]


def test_a_releases_own_rule_of_causality_stands(captured: list[dict[str, Any]]) -> None:
    """Which sdpa calls transformers makes causal has changed between releases: where the
    explicit reference's reading of it differs from the release's own function, that function
    in float64 decides, and right numbers are not called wrong."""
    from attnguard.integrations.transformers import attention

    def always_causal(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True)
        return out.transpose(1, 2).contiguous(), None

    attnguard.activate(log="none", verify="all")
    entry = attention.wrap_registry_entry("sdpa", always_causal, kernels.EntryKind.REGISTRY_SDPA)
    module = torch.nn.Module()
    module.is_causal = False  # a release that does not read it
    q = torch.randn(1, 2, 8, 16)
    entry(module, q, q.flip(2), q, None)
    assert numerics.snapshot() == {"checked": 1, "mismatched": 0, "skipped": {}}
    assert said(captured) == []


def test_a_flash_function_inside_the_flash_entry_is_checked_once() -> None:
    """transformers' flash entry calls flash-attn's function: the call is checked at the entry
    (the outermost one with a reference), not again inside it."""
    from attnguard.integrations.transformers import attention

    attnguard.activate(log="none", verify="all", disable="reroute")
    twin = FLASH_FUNCTIONS["flash_attn_func"]
    inner = callguard.wrap_direct(
        callguard.Entry(
            "flash_attn_func",
            kernels.EntryKind.FLASH_KERNEL,
            twin,
            tensors=("q", "k", "v"),
            twin=twin,
            site="flash_attn.flash_attn_func",
            head_axis=3,
            in_force=runtime.IN_FORCE,
            family=Family.FA2,
        )
    )

    def flash_entry(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return inner(q, k, v, dropout, scaling, causal=True), None

    outer = attention.wrap_registry_entry(
        "flash_attention_2", flash_entry, kernels.EntryKind.REGISTRY_FLASH
    )
    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(2, h, 8, 16) for h in (4, 2, 2))
    for _ in range(3):
        outer(module, q, k, v, None)
    assert numerics.snapshot() == {"checked": 3, "mismatched": 0, "skipped": {}}
    inner(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)  # on its own
    assert numerics.snapshot()["checked"] == 4


# --- xformers ----------------------------------------------------------------------------------


def _xformers_entry(original: Any, twin: Any = xformers_memory_efficient_attention) -> Any:
    entry = callguard.Entry(
        "memory_efficient_attention",
        kernels.EntryKind.XFORMERS,
        original,
        tensors=("query", "key", "value"),
        twin=twin,
        mask="attn_bias",
        site="xformers.memory_efficient_attention",
        in_force=runtime.IN_FORCE,
        family=Family.XFORMERS,
    )
    return callguard.wrap_direct(entry)


def _wrong_xformers(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None,
                    output_dtype=None):  # fmt: skip
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    return _reference(q, k, v, scale=(query.shape[-1] + 4) ** -0.5).transpose(1, 2)


def test_a_wrong_xformers_kernel_and_a_wrong_twin_are_told_apart(
    captured: list[dict[str, Any]],
) -> None:
    q, k, v = (torch.randn(2, 10, 4, 16).half() for _ in range(3))
    attnguard.activate(log="none", verify="all", disable="reroute")  # the kernel computes
    _xformers_entry(_wrong_xformers)(q, k, v)
    attnguard.configure(disable="")  # CPU tensors: the (wrong) twin computes
    _xformers_entry(xformers_memory_efficient_attention, twin=_wrong_xformers)(q, k, v)
    assert said(captured) == [
        ("kernel_numbers_differ", "kernel", "twin_float64"),
        ("twin_numbers_differ", "sdpa_twin", "explicit_float64"),
    ]


def test_real_xformers_calls_pass_on_the_twin(captured: list[dict[str, Any]]) -> None:
    """xformers installed, its ops unusable on this CPU: attnguard's twin computes every call,
    checked against the explicit reference (bias objects it cannot express: the twin in
    float64)."""
    xops = pytest.importorskip("xformers.ops")
    attnguard.activate(log="none", verify="all")
    fmha = xops.fmha
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 4, 16, generator=g).half() for _ in range(3))
    bias = torch.randn(1, 4, 12, 12, generator=g).half()
    block = fmha.attn_bias.BlockDiagonalMask.from_seqlens([5, 7])
    qb, kb, vb = (t.reshape(1, 12, 4, 16) for t in (q, k, v))
    calls = [
        lambda: xops.memory_efficient_attention(q, k, v),
        lambda: xops.memory_efficient_attention(q, k, v, attn_bias=bias),
        lambda: xops.memory_efficient_attention(q, k, v, xops.LowerTriangularMask()),
        lambda: xops.memory_efficient_attention(qb, kb, vb, attn_bias=block),
    ]
    for call in calls:
        call()
    assert numerics.snapshot() == {"checked": 4, "mismatched": 0, "skipped": {}}
    assert said(captured) == []


# --- diffusers --------------------------------------------------------------------------------


def _diffusers() -> Any:
    from helpers.packages import diffusers_dispatch

    ad = diffusers_dispatch()
    sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
    import diffusers_worker

    return ad, diffusers_worker


@pytest.mark.parametrize("backend", ["native", "flash"])
def test_a_diffusers_model_passes_every_check(backend: str, captured: list[dict[str, Any]]) -> None:
    """A tiny Flux through the dispatcher: torch's backend (explicit reference of SDPA's
    semantics) and, flash-attn missing here, the flash backend on attnguard's twin (explicit
    reference of flash-attn 2's)."""
    ad, dw = _diffusers()
    if backend == "flash" and ad.flash_attn_func is not None:
        pytest.skip("flash-attn importable here: its kernel would run")
    attnguard.activate(log="none", verify="all")
    model, inputs = dw.tiny_flux(), dw.flux_inputs()
    try:
        model.set_attention_backend(backend)
        dw.run(model, inputs)
    finally:
        ad._AttentionBackendRegistry._active_backend = ad.AttentionBackendName.NATIVE
    counts = numerics.snapshot()
    assert counts["checked"] > 0 and counts["mismatched"] == 0, counts
    assert said(captured) == []


def test_a_wrong_diffusers_backend_function_is_caught(captured: list[dict[str, Any]]) -> None:
    ad, _ = _diffusers()
    from attnguard.integrations.diffusers import calls

    def native(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False, return_lse=False, _parallel_config=None):  # fmt: skip
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return _reference(q, k, v, causal=not is_causal).transpose(1, 2)  # causal inverted

    attnguard.activate(log="none", verify="all")
    wrapped = calls.wrap("native", native, ad)
    q, k, v = (torch.randn(1, 9, 2, 8) for _ in range(3))
    out = wrapped(query=q, key=k, value=v, is_causal=False)
    assert torch.equal(out, native(q, k, v))  # the output stands
    assert said(captured) == [("kernel_numbers_differ", "kernel", "explicit_float64")]


def test_the_setting_reaches_a_real_entry_point_through_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("ATTNGUARD_VERIFY", "first:1")
    assert attnguard.activate(log="none").verify == "first:1"
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnguard.integrations.transformers import attention

    guarded = attention.wrap_registry_entry("sdpa", sdpa_attention_forward)
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 2, 5, 8)
    for _ in range(3):
        guarded(module, q, q, q, None)
    assert numerics.snapshot() == {"checked": 1, "mismatched": 0, "skipped": {}}
    assert inspect.signature(guarded) == inspect.signature(sdpa_attention_forward)
