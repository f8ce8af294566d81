"""The diffusers integration, in this process: tiny real diffusers models (a Flux transformer whose
attention goes through diffusers' dispatcher, a Stable-Diffusion-shaped UNet) and
``dispatch_attention_fn`` itself, guarded and unguarded, compared with diffusers' ``native``
backend.

Here flash-attn is not installed (the ``flash`` / ``flash_varlen`` backends cannot run: attnguard's
twins carry them), and xformers is the PyPI wheel whose ops do not run on a CPU (the xformers
backend runs, its kernel calls are rerouted by the xformers integration). Fresh interpreters
(activation, import orders, flash-attn installed or broken, xformers missing,
``DIFFUSERS_ATTN_BACKEND``) are tests/test_diffusers_activation.py.
"""

from __future__ import annotations

import inspect
import logging
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.events import names, reasons
from helpers.packages import diffusers_dispatch

import attnguard
from attnguard import callguard
from attnguard.observability import events

ad = diffusers_dispatch()  # or the module skips, saying why diffusers is not here

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
import diffusers_worker as dw  # noqa: E402

pytestmark = pytest.mark.skipif(
    ad.flash_attn_func is not None, reason="flash-attn importable here: its kernel would run"
)


@pytest.fixture(autouse=True)
def _quiet_diffusers() -> Any:
    logging.disable(logging.WARNING)  # "Attention backends are an experimental feature"
    yield
    logging.disable(logging.NOTSET)
    ad._AttentionBackendRegistry._active_backend = ad.AttentionBackendName.NATIVE


def _flux() -> tuple[Any, dict[str, Any], torch.Tensor]:
    model, inputs = dw.tiny_flux(), dw.flux_inputs()
    return model, inputs, dw.run(model, inputs)


def _qkv(b=2, sq=12, sk=12, h=4, hk=4, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, sq, h, d, generator=g, dtype=dtype)
    k = torch.randn(b, sk, hk, d, generator=g, dtype=dtype)
    v = torch.randn(b, sk, hk, d, generator=g, dtype=dtype)
    return q, k, v


def _reference(q, k, v, *, causal=False, scale=None, mask=None, window=(-1, -1)):
    """Attention in float64, flash-attn's conventions: (B, S, H, D), GQA by repeating k/v heads,
    causal and windows aligned to the bottom-right corner; also the LSE (B, H, Sq)."""
    h, hk = q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = qd @ kd.transpose(-1, -2) * scale
    sq, sk = q.shape[1], k.shape[1]
    i = torch.arange(sq)[:, None] + sk - sq
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window[0] >= 0:
        keep &= j >= i - window[0]
    if window[1] >= 0:
        keep &= j <= i + window[1]
    s = s.masked_fill(~keep, -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    return (torch.softmax(s, dim=-1) @ vd).transpose(1, 2), lse


# --- a backend diffusers cannot run here: the twins ----------------------------------------------


@pytest.mark.smoke
@pytest.mark.parametrize("model_name", ["flux", "unet"])
@pytest.mark.parametrize("backend", ["flash", "flash_varlen"])
def test_flash_backend_without_flash_attn_runs_on_the_twin_with_natives_numbers(
    backend: str, model_name: str, captured: list[dict[str, Any]]
) -> None:
    """Flux's attention goes through the dispatcher (the twin computes it); the UNet's processors
    call torch SDPA whatever backend is set: the request must not fail or change its numbers."""
    build, make_inputs = dw.MODELS[model_name]
    model, inputs = build(), make_inputs()
    ref = dw.run(model, inputs)
    with pytest.raises(RuntimeError, match=f"backend '{backend}' is not usable"):
        model.set_attention_backend(backend)  # unguarded: diffusers refuses
    attnguard.activate(log="none")
    model.set_attention_backend(backend)
    first, second = dw.run(model, inputs), dw.run(model, inputs)
    # the twin computes on torch's kernels what flash-attn would: on a CPU exactly native's
    torch.testing.assert_close(first, ref, rtol=0, atol=1e-6)
    assert torch.equal(first, second)
    fallback = [e for e in captured if e["event"] == "backend_fallback"]
    assert [(e["site"], e["reason_code"], e["requested"], e["selected"]) for e in fallback] == [
        (f"diffusers.{backend}", "backend_package_unusable", backend, "sdpa_twin")
    ]
    assert "flash-attn>=" in fallback[0]["reason"]  # diffusers' own words, kept
    assert names(captured) == ["backend_fallback"]  # one decision, not one event per call


def _reference_flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """flash_attn_func's contract in float64 (what the real kernel computes of a call)."""
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None
    out, lse = _reference(q, k, v, causal=causal, scale=softmax_scale, window=tuple(window_size))
    out = out.to(q.dtype)
    return (out, lse.float(), None) if return_attn_probs else out


def _reference_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """flash_attn_varlen_func's contract in float64: each packed sequence on its own."""
    assert not return_attn_probs
    outs = []
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]][None]
        ks, vs = (x[cu_seqlens_k[i] : cu_seqlens_k[i + 1]][None] for x in (k, v))
        outs.append(
            _reference_flash_attn_func(qs, ks, vs, 0.0, softmax_scale, causal, window_size)[0]
        )
    return torch.cat(outs)


def _twin_vs_reference_kernel(monkeypatch: pytest.MonkeyPatch, *args: Any, **kw: Any) -> None:
    """The call through diffusers' dispatcher with the backend on attnguard's twin, and again
    with the backend's kernel a float64 reference of flash-attn's: diffusers prepares both calls
    (whatever this release passes the kernel, or drops), so they must agree."""
    out = ad.dispatch_attention_fn(*args, **kw)
    with monkeypatch.context() as m:
        m.setattr(ad, "flash_attn_func", _reference_flash_attn_func)
        m.setattr(ad, "flash_attn_varlen_func", _reference_flash_attn_varlen_func)
        want = ad.dispatch_attention_fn(*args, **kw)
    for got, ref in zip(*((x,) if torch.is_tensor(x) else x for x in (out, want)), strict=True):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=0)


def test_flash_backend_on_the_twin_keeps_diffusers_semantics(
    guard: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What diffusers' flash backends hand the kernel, the twin computes as flash-attn does."""
    flash, varlen = ad.AttentionBackendName.FLASH, ad.AttentionBackendName.FLASH_VARLEN
    ad._check_attention_backend_requirements(flash)
    ad._check_attention_backend_requirements(varlen)
    check = _twin_vs_reference_kernel
    check(monkeypatch, *_qkv(), scale=0.3, backend=flash)
    # causal with fewer queries than keys: bottom-right aligned, as flash-attn (not SDPA's)
    check(monkeypatch, *_qkv(sq=5, sk=12), is_causal=True, backend=flash)
    # GQA (k/v with fewer heads); a sliding window, where this diffusers passes one on
    check(monkeypatch, *_qkv(h=4, hk=2), attention_kwargs={"window_size": (3, 0)}, backend=flash)
    # the LSE, where this diffusers asks for it (ring attention merges partial results with it)
    check(monkeypatch, *_qkv(), attention_kwargs={"return_lse": True}, backend=flash)
    # packed rows: flash_varlen, with a right-padded boolean key mask where diffusers takes one
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 7:] = False
    check(monkeypatch, *_qkv(), attn_mask=mask, backend=varlen)
    check(monkeypatch, *_qkv(), is_causal=True, backend=varlen)
    # dropout is applied (the twin does not drop the argument)
    q, k, v = _qkv()
    torch.manual_seed(0)
    dropped = ad.dispatch_attention_fn(q, k, v, dropout_p=0.5, backend=flash)
    assert not torch.allclose(dropped, ad.dispatch_attention_fn(q, k, v, backend=flash))


def test_context_parallel_calls_keep_diffusers_error(captured: list[dict[str, Any]]) -> None:
    """The twins do not compute diffusers' context-parallel flash path: its kernel functions
    raise diffusers' own requirements error, with one event, never a different computation."""
    if not hasattr(ad, "_wrapped_flash_attn_forward"):
        pytest.skip("this diffusers has no context-parallel flash path")
    attnguard.activate(log="none")
    ad._check_attention_backend_requirements(ad.AttentionBackendName.FLASH)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="backend 'flash' is not usable"):
            ad._wrapped_flash_attn_forward(*_qkv())
    refused = [e for e in captured if e["reason_code"] == "no_twin"]
    assert [(e["event"], e["site"], e["count"]) for e in refused] == [
        ("observed", "diffusers.flash", 1)
    ]


def test_a_backend_without_twin_keeps_diffusers_error_with_one_event(
    captured: list[dict[str, Any]],
) -> None:
    model, _, _ = _flux()
    attnguard.activate(log="none")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="Sage Attention backend 'sage' is not usable"):
            model.set_attention_backend("sage")
    assert [(e["event"], e["reason_code"], e["count"]) for e in captured[1:]] == [
        ("observed", "no_twin", 1)
    ]


@pytest.mark.parametrize("mode", ["warn", "strict"])
def test_warn_and_strict_modes_change_nothing(mode: str, captured: list[dict[str, Any]]) -> None:
    model, _, _ = _flux()
    attnguard.activate(log="none", mode=mode)
    expected = attnguard.AttnGuardError if mode == "strict" else RuntimeError
    with pytest.raises(expected):
        model.set_attention_backend("flash")
    assert ad.flash_attn_func is None  # no twin put in place
    if mode == "warn":
        assert [(e["event"], e["applied"]) for e in captured[1:]] == [("backend_fallback", False)]


def test_disabled_integration_leaves_diffusers_alone() -> None:
    model, _, _ = _flux()
    attnguard.activate(log="none", disable=("diffusers",))
    with pytest.raises(RuntimeError, match="is not usable"):
        model.set_attention_backend("flash")
    assert not hasattr(ad._check_attention_backend_requirements, "__attnguard_original__")


def test_deactivate_restores_every_original() -> None:
    check = ad._check_attention_backend_requirements
    entries = dict(ad._AttentionBackendRegistry._backends)
    attnguard.activate(log="none")
    assert ad._check_attention_backend_requirements is not check
    ad._check_attention_backend_requirements(ad.AttentionBackendName.FLASH)
    assert ad.flash_attn_func is not None
    native = ad._AttentionBackendRegistry._backends[ad.AttentionBackendName.NATIVE]
    assert native.__attnguard_original__ is entries[ad.AttentionBackendName.NATIVE]
    attnguard.deactivate()
    assert ad._check_attention_backend_requirements is check
    assert ad._AttentionBackendRegistry._backends == entries
    assert ad.flash_attn_func is None
    assert getattr(ad, "_wrapped_flash_attn_forward", None) is None
    with pytest.raises(RuntimeError, match="is not usable"):
        ad._check_attention_backend_requirements(ad.AttentionBackendName.FLASH)


# --- a backend that runs: do no harm; and what the per-call guard remedies -----------------------


@pytest.mark.smoke
@pytest.mark.parametrize("model_name", ["flux", "unet"])
def test_nothing_wrong_gives_bit_identical_outputs_and_no_event(
    model_name: str, captured: list[dict[str, Any]]
) -> None:
    build, make_inputs = dw.MODELS[model_name]
    model, inputs = build(), make_inputs()
    unguarded = dw.run(model, inputs)
    attnguard.activate(log="none")
    if model_name == "flux":  # set explicitly too: the guarded registry entry runs
        model.set_attention_backend("native")
    assert torch.equal(dw.run(model, inputs), unguarded)
    assert names(captured) == []


class _MixedDtypeProcessor:
    """A custom processor whose key and value come out of an fp32 norm while the query is bf16
    (diffusers' dispatcher passes them on as they are)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ad.dispatch_attention_fn(q.bfloat16(), k, v)


def test_mixed_qkv_dtypes_from_a_custom_processor_are_unified(
    captured: list[dict[str, Any]],
) -> None:
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="same dtype"):
        _MixedDtypeProcessor()(q, k, v)
    attnguard.activate(log="none")
    out = _MixedDtypeProcessor()(q, k, v)
    want = ad.dispatch_attention_fn(q.bfloat16(), k.bfloat16(), v.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    unified = [e for e in captured if e["event"] == "qkv_unified"]
    assert [(e["site"], e["reason_code"], e["to"]) for e in unified] == [
        ("diffusers.native", "mixed_dtypes", "bfloat16")
    ]


@pytest.mark.parametrize("backend", ["flash", "flash_varlen"])
def test_a_call_straight_into_an_unusable_backend_runs_on_the_twin(
    backend: str, captured: list[dict[str, Any]]
) -> None:
    """``dispatch_attention_fn(..., backend=...)`` from a custom processor: diffusers never checks
    the backend (no ``set_attention_backend``), the call meets the missing kernel. Guarded, the
    backend goes on the twins as ``set_attention_backend`` would have put it, and the mixed
    dtypes are unified for a call that then succeeds: each event says a change that happened."""
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        ad.dispatch_attention_fn(q.bfloat16(), k, v, backend=backend)
    attnguard.activate(log="none")
    out = ad.dispatch_attention_fn(q.bfloat16(), k, v, backend=backend)
    want = ad.dispatch_attention_fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend="native")
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)
    assert [(e["event"], e["site"], e["reason_code"], e["applied"]) for e in captured[1:]] == [
        ("backend_fallback", f"diffusers.{backend}", "backend_package_unusable", True),
        ("qkv_unified", f"diffusers.{backend}", "mixed_dtypes", True),
    ]
    assert "diffusers did not check it" in captured[1]["reason"]


def test_a_call_straight_into_an_unusable_backend_in_warn_mode_announces_no_change(
    captured: list[dict[str, Any]],
) -> None:
    q, k, v = _qkv()
    attnguard.activate(log="none", mode="warn")
    with pytest.raises(TypeError, match="'NoneType' object is not callable"):
        ad.dispatch_attention_fn(q.bfloat16(), k, v, backend="flash")
    assert ad.flash_attn_func is None
    # what would have changed (the backend on the twins), and no unification of a call that fails
    assert [(e["event"], e["applied"]) for e in captured[1:]] == [("backend_fallback", False)]


def test_a_forced_sdpa_kernel_that_cannot_take_the_call_is_rerun_unforced(
    captured: list[dict[str, Any]],
) -> None:
    """``_native_cudnn`` on a CPU: SDPA has no cuDNN kernel here ("No available kernel" /
    "No viable backend"); the same SDPA call with SDPA choosing computes it."""
    model, inputs, ref = _flux()
    model.set_attention_backend("_native_cudnn")
    with pytest.raises(RuntimeError, match="No (available kernel|viable backend)"):
        dw.run(model, inputs)
    q, k, v = _qkv()
    lse = {"return_lse": True}  # diffusers' other code path (templated attention), if it has one
    cudnn = ad._AttentionBackendRegistry._backends[ad.AttentionBackendName._NATIVE_CUDNN]
    two_paths = "return_lse" in inspect.signature(cudnn).parameters
    if two_paths:
        with pytest.raises(Exception) as unguarded:
            ad.dispatch_attention_fn(q, k, v, attention_kwargs=lse, backend="_native_cudnn")
    attnguard.activate(log="none")
    torch.testing.assert_close(dw.run(model, inputs), ref, rtol=0, atol=1e-6)
    got = reasons(captured[1:])
    assert got[:2] == [
        ("kernel_error_recovered", "no_sdpa_kernel"),
        ("backend_rerouted", "no_sdpa_kernel"),  # the site's later calls go straight there
    ]
    if not two_paths:
        return
    # diffusers' other code path (the LSE) is not the twin's: diffusers' own answer stands
    with pytest.raises(type(unguarded.value)) as guarded:
        ad.dispatch_attention_fn(q, k, v, attention_kwargs=lse, backend="_native_cudnn")
    assert str(guarded.value) == str(unguarded.value)


@pytest.mark.parametrize("backend", ["_native_cudnn", "_native_efficient"])
def test_a_call_sdpa_refuses_under_every_kernel_keeps_its_own_error_and_says_nothing(
    backend: str, captured: list[dict[str, Any]]
) -> None:
    """A forced SDPA backend on a CPU answers every call "No viable backend", a call SDPA
    refuses anyway (k/v with fewer heads and no ``enable_gqa``; mixed dtypes on top) included:
    the twin (SDPA free to choose) refuses it too. That is the call's own error, not
    attnguard's: the same error as unguarded and no event, on the site's first call and once
    the site goes straight to the twin."""
    q, k, v = _qkv(h=4, hk=2)
    mask = torch.zeros(2, 1, 12, 12)
    bad = [(q, k, v, mask), (q.bfloat16(), k, v, mask)]
    unguarded = []
    for args in bad:
        with pytest.raises(RuntimeError) as err:
            ad.dispatch_attention_fn(*args, backend=backend)
        unguarded.append(str(err.value))
    attnguard.activate(log="none")
    for args, message in zip(bad, unguarded, strict=True):  # the site's first calls
        with pytest.raises(RuntimeError) as err:
            ad.dispatch_attention_fn(*args, backend=backend)
        assert str(err.value) == message
    assert names(captured) == []
    good = ad.dispatch_attention_fn(*_qkv(), backend=backend)  # recovered: the site latched
    torch.testing.assert_close(good, ad.dispatch_attention_fn(*_qkv(), backend="native"))
    assert names(captured) == ["kernel_error_recovered"]
    for args, message in zip(bad, unguarded, strict=True):  # straight to the twin now
        with pytest.raises(RuntimeError) as err:
            ad.dispatch_attention_fn(*args, backend=backend)
        assert str(err.value) == message
    assert names(captured) == ["kernel_error_recovered"]  # no reroute, no internal_error


# --- xformers installed, its ops unusable here -------------------------------------------------


@pytest.mark.skipif(ad.xops is None, reason="xformers is not importable here")
def test_xformers_backend_with_unusable_ops_runs_on_the_twin(
    captured: list[dict[str, Any]],
) -> None:
    model, inputs, ref = _flux()
    model.set_attention_backend("xformers")  # diffusers accepts: xformers is installed
    with pytest.raises(NotImplementedError, match="No operator found"):
        dw.run(model, inputs)
    attnguard.activate(log="none")
    torch.testing.assert_close(dw.run(model, inputs), ref, rtol=0, atol=1e-6)
    assert [(e["event"], e["site"], e["reason_code"]) for e in captured[1:]] == [
        ("backend_rerouted", "xformers.memory_efficient_attention", "cpu_tensors")
    ]
    # the calls diffusers makes of xformers: causal (its LowerTriangularMask), a padding mask, GQA
    q, k, v = _qkv()
    native = ad.AttentionBackendName.NATIVE
    bias = torch.zeros(2, 1, 1, 12).masked_fill(torch.rand(2, 1, 1, 12) > 0.7, -1e4)
    for kwargs in ({"is_causal": True}, {"attn_mask": bias}):
        got = ad.dispatch_attention_fn(q, k, v, backend="xformers", **kwargs)
        torch.testing.assert_close(got, ad.dispatch_attention_fn(q, k, v, backend=native, **kwargs))
    q, k, v = _qkv(h=4, hk=2)
    got = ad.dispatch_attention_fn(q, k, v, enable_gqa=True, backend="xformers")
    want = ad.dispatch_attention_fn(q, k, v, enable_gqa=True, backend=native)
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(ad.xops is None, reason="xformers is not importable here")
def test_unet_with_xformers_processors_runs_on_the_twin(captured: list[dict[str, Any]]) -> None:
    """The older path: UNet attention processors calling ``xformers.ops`` directly (what
    ``enable_xformers_memory_efficient_attention()`` installs on a GPU machine)."""
    from diffusers.models.attention_processor import XFormersAttnProcessor

    model, inputs = dw.tiny_unet(), dw.unet_inputs()
    ref = dw.run(model, inputs)
    model.set_attn_processor(XFormersAttnProcessor())
    with pytest.raises(NotImplementedError, match="No operator found"):
        dw.run(model, inputs)
    attnguard.activate(log="none")
    torch.testing.assert_close(dw.run(model, inputs), ref, rtol=0, atol=2e-6)
    assert {e["reason_code"] for e in captured[1:]} == {"cpu_tensors"}


def test_xformers_stand_in_builds_xformers_causal_bias() -> None:
    """Where xformers is missing, diffusers' xformers backend gets attnguard's stand-in for
    ``xformers.ops``: its LowerTriangularMask is top-left causal, as xformers' own."""
    from attnguard.integrations.diffusers.twins import kernel_twins

    xops = kernel_twins()["xops"]
    q, k, v = _qkv(sq=5, sk=9)
    bias = xops.LowerTriangularMask()
    got = xops.memory_efficient_attention(q, k, v, bias, 0.0, None)
    want = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)),
        attn_mask=torch.ones(5, 9, dtype=torch.bool).tril(),
    ).transpose(1, 2)
    torch.testing.assert_close(got, want)
    mat = bias.materialize((5, 9))
    assert torch.equal(mat == 0, torch.ones(5, 9, dtype=torch.bool).tril())


def test_doctor_lists_diffusers_backends_and_what_computes_them() -> None:
    from attnguard import doctor

    data = doctor.collect()["diffusers"]
    rows = {r["name"]: r for r in data["backends"]}
    assert set(rows) == {b.value for b in ad._AttentionBackendRegistry._backends}
    assert (
        rows["flash"]["usable"] is False
        and "twin of flash_attn_func" in (rows["flash"]["under_attnguard"])
    )
    assert rows["native"]["usable"] is True
    assert "no twin" in rows["sage"]["under_attnguard"]
    text = doctor.render()
    assert "diffusers' attention backends" in text and f"diffusers {data['version']}" in text


@pytest.fixture(autouse=True)
def _forget_latches() -> Any:
    yield
    callguard.reset_latches()
    events.reset_counts()
