"""diffusers' ``*_hub`` attention backends: flash attention diffusers loads from the Hugging Face
kernel hub. A hub kernel that loads is kept; one that cannot load is computed by attnguard's twins
where its functions are flash-attn's (``flash_hub`` / ``flash_varlen_hub``: flash-attn 2's,
``_flash_3_hub`` / ``_flash_3_varlen_hub``: flash-attn 3's, ``flash_4_hub``: flash-attn 4's);
any other (SageAttention, aiter) keeps diffusers' own error, with one event.

In this process the ``kernels`` package is not installed (diffusers refuses every ``*_hub``
backend): the twins against diffusers' ``native`` backend and against float64 models of the
kernels' functions, the modes, deactivation, doctor. Fresh programs
(tests/workers/diffusers_hub_worker.py) with the real ``kernels`` package ($TEST_KERNELS_DIR, put
there by scripts/test.sh) cover the machines a user meets: air-gapped with an empty cache, no
build for this device or a build whose import fails, a ``kernels`` release diffusers refuses
($TEST_KERNELS_REFUSED_DIR), and stand-in hub kernels that load (tests/standins/hub_kernel.py,
through ``LOCAL_KERNELS``, counting their calls): unguarded and guarded side by side.
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.events import names
from helpers.packages import diffusers_dispatch, hub_standin
from helpers.processes import PY, REPO, subprocess_env

import attnguard

ad = diffusers_dispatch()  # or the module skips, saying why diffusers is not here

sys.path.insert(0, str(Path(__file__).resolve().parent / "workers"))
import diffusers_worker as dw  # noqa: E402

REPOS = {
    "flash_hub": "kernels-community/flash-attn2",
    "flash_varlen_hub": "kernels-community/flash-attn2",
    "_flash_3_hub": "kernels-community/flash-attn3",
    "_flash_3_varlen_hub": "kernels-community/flash-attn3",
    "flash_4_hub": "kernels-community/flash-attn4",
}
TWINNED = tuple(REPOS)
SAGE = "sage_hub"
KERNELS = os.environ.get("TEST_KERNELS_DIR")
REFUSED = os.environ.get("TEST_KERNELS_REFUSED_DIR")
WORKER = REPO / "tests" / "workers" / "diffusers_hub_worker.py"
absent_here = pytest.mark.skipif(
    ad.is_kernels_available(), reason="the kernels package is installed in this process"
)


@pytest.fixture(autouse=True)
def _quiet_diffusers() -> Any:
    logging.disable(logging.CRITICAL)  # "experimental feature", "error occurred while fetching"
    yield
    logging.disable(logging.NOTSET)
    ad._AttentionBackendRegistry._active_backend = ad.AttentionBackendName.NATIVE


def _config(backend: str) -> Any:
    return ad._HUB_KERNELS_REGISTRY[ad.AttentionBackendName(backend)]


def _said(captured: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [
        (e["event"], e["site"], e["reason_code"], e.get("rule"))
        for e in captured
        if e["event"] != "activated"
    ]


# --- kernels not installed, in this process ------------------------------------------------------


@absent_here
@pytest.mark.smoke
@pytest.mark.parametrize("backend", TWINNED)
def test_hub_backend_without_kernels_runs_on_the_twins_with_natives_numbers(
    backend: str, captured: list[dict[str, Any]]
) -> None:
    model, inputs = dw.tiny_flux(), dw.flux_inputs()
    native = dw.run(model, inputs)
    with pytest.raises(RuntimeError, match="`kernels` package isn't available"):
        model.set_attention_backend(backend)  # unguarded: diffusers refuses
    attnguard.activate(log="none")
    model.set_attention_backend(backend)
    got = dw.run(model, inputs)
    torch.testing.assert_close(got, native, rtol=0, atol=1e-6)
    site = f"diffusers.hub_kernel:{REPOS[backend]}"
    assert _said(captured) == [("backend_fallback", site, "hub_package_missing", "hub-on-sdpa")]
    assert captured[-1]["requested"] == backend and captured[-1]["selected"] == "sdpa_twin"
    model.set_attention_backend(backend)  # chosen again: decided once, said once
    assert names(captured) == ["backend_fallback"]


@absent_here
def test_sage_hub_without_kernels_keeps_diffusers_error_with_one_event(
    captured: list[dict[str, Any]],
) -> None:
    model = dw.tiny_flux()
    with pytest.raises(RuntimeError) as unguarded:
        model.set_attention_backend(SAGE)
    attnguard.activate(log="none")
    for _ in range(2):
        with pytest.raises(RuntimeError) as guarded:
            model.set_attention_backend(SAGE)
        assert str(guarded.value) == str(unguarded.value)
    site = "diffusers.hub_kernel:SageAttention/sage-attention"
    assert _said(captured) == [("observed", site, "hub_package_missing", "hub-aside")]
    assert _config(SAGE).kernel_fn is None


def _attention64(q, k, v, *, causal=False, scale=None, window=(-1, -1), softcap=0.0):
    """(B, S, H, D) attention in float64, flash-attn's conventions (grouped k/v heads, causal
    masks and windows aligned to the bottom-right corner); also the LSE (B, H, Sq)."""
    h, hk = q.shape[2], k.shape[2]
    k, v = (x.repeat_interleave(h // hk, dim=2) for x in (k, v))
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    i, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    left, right = window[0], 0 if causal else window[1]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    keep &= (j >= i - left) if left >= 0 else keep
    keep &= (j <= i + right) if right >= 0 else keep
    s = s.masked_fill(~keep, -math.inf)
    return (torch.softmax(s, dim=-1) @ vd).transpose(1, 2).to(q.dtype), torch.logsumexp(s, -1)


def _ref_fa2(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
    """flash-attn 2's flash_attn_func in float64."""
    assert dropout_p == 0.0 and alibi_slopes is None
    out, lse = _attention64(q, k, v, causal=causal, scale=softmax_scale, window=window_size,
                            softcap=softcap)  # fmt: skip
    return (out, lse.float(), None) if return_attn_probs else out


def _packed(fn, q, k, v, cu_q, cu_k, **kw):
    """A varlen call as each packed sequence on its own: (out, LSE (H, total_q))."""
    outs, lses = [], []
    for n in range(len(cu_q) - 1):
        a, b, c, e = int(cu_q[n]), int(cu_q[n + 1]), int(cu_k[n]), int(cu_k[n + 1])
        out, lse = _attention64(q[None, a:b], k[None, c:e], v[None, c:e], **kw)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=-1).float()


def _ref_fa2_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                    softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False, block_table=None):  # fmt: skip
    """flash-attn 2's flash_attn_varlen_func in float64."""
    assert dropout_p == 0.0 and alibi_slopes is None and block_table is None
    kw = {"causal": causal, "scale": softmax_scale, "window": window_size, "softcap": softcap}
    out, lse = _packed(_attention64, q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
    return (out, lse, None) if return_attn_probs else out


_FA3_DEFAULTS = {"qv": None, "q_descale": None, "k_descale": None, "v_descale": None,
                 "attention_chunk": 0, "seqused_q": None, "seqused_k": None}  # fmt: skip


def _ref_fa3(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
             return_attn_probs=False, **rest):  # fmt: skip
    """flash-attn 3's flash_attn_func in float64 (hopper/flash_attn_interface.py; the hub build
    also takes return_attn_probs)."""
    assert all(rest.get(n, d) == d for n, d in _FA3_DEFAULTS.items())
    out, lse = _attention64(q, k, v, causal=causal, scale=softmax_scale, window=window_size,
                            softcap=softcap)  # fmt: skip
    return (out, lse.float()) if return_attn_probs else out


def _ref_fa3_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    return_attn_probs=False, **rest):  # fmt: skip
    assert all(rest.get(n, d) == d for n, d in _FA3_DEFAULTS.items())
    kw = {"causal": causal, "scale": softmax_scale, "window": window_size, "softcap": softcap}
    out, lse = _packed(_attention64, q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
    return (out, lse) if return_attn_probs else out


def _ref_fa4(q, k, v, softmax_scale=None, causal=False, window_size=(None, None),
             learnable_sink=None, softcap=0.0, pack_gqa=None):  # fmt: skip
    """flash-attn 4's flash_attn_func (flash_attn/cute/interface.py) in float64: (out, lse),
    the LSE only where an input requires grad."""
    assert learnable_sink is None and window_size == (None, None)
    out, lse = _attention64(q, k, v, causal=causal, scale=softmax_scale, softcap=softcap or 0.0)
    grad = any(t.requires_grad for t in (q, k, v))
    return out, lse.float() if grad else None


REFERENCES = {
    "flash_hub": _ref_fa2,
    "flash_varlen_hub": _ref_fa2_varlen,
    "_flash_3_hub": _ref_fa3,
    "_flash_3_varlen_hub": _ref_fa3_varlen,
    "flash_4_hub": _ref_fa4,
}


def _qkv(b=2, sq=12, sk=12, h=4, hk=4, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(
        torch.randn(b, n, heads, d, generator=g) for n, heads in ((sq, h), (sk, hk), (sk, hk))
    )


# (backend, call arguments): what each backend takes from diffusers' dispatcher
_MASK = torch.ones(2, 12, dtype=torch.bool)
_MASK[1, 7:] = False  # right padding
_HOLES = torch.ones(2, 12, dtype=torch.bool)
_HOLES[0, 2] = _HOLES[1, 5:7] = False  # holes: diffusers packs the kept keys of each row
CALLS: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
    ("flash_hub", _qkv(), {"scale": 0.3}),
    ("flash_hub", _qkv(sq=5), {"is_causal": True}),  # bottom-right, as flash-attn (not SDPA)
    ("flash_hub", _qkv(hk=2), {"attention_kwargs": {"window_size": (3, 0)}}),  # GQA, a window
    ("flash_hub", _qkv(), {"attention_kwargs": {"return_lse": True}}),
    ("flash_varlen_hub", _qkv(), {"attn_mask": _MASK}),
    ("flash_varlen_hub", _qkv(), {"attn_mask": _HOLES, "scale": 0.2}),
    ("flash_varlen_hub", _qkv(sq=5), {"is_causal": True}),
    ("_flash_3_hub", _qkv(), {"scale": 0.3}),
    ("_flash_3_hub", _qkv(sq=5, hk=2), {"is_causal": True}),
    ("_flash_3_hub", _qkv(), {"attention_kwargs": {"window_size": (2, 3), "softcap": 5.0}}),
    ("_flash_3_hub", _qkv(), {"attention_kwargs": {"return_attn_probs": True}}),
    ("_flash_3_varlen_hub", _qkv(), {"attn_mask": _HOLES}),
    ("_flash_3_varlen_hub", _qkv(sq=5, hk=2), {"is_causal": True}),
    ("flash_4_hub", _qkv(sq=5, hk=2), {"is_causal": True, "scale": 0.25}),
    ("flash_4_hub", _qkv(), {"attention_kwargs": {"return_lse": True}}),
]


@absent_here
def test_the_twins_compute_what_each_hub_kernel_computes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each call through diffusers' dispatcher with the backend on attnguard's twin, and again
    with its kernel_fn a float64 model of the hub kernel's function: diffusers prepares both
    calls alike (masks packed, LSE asked for), so they must agree. Unmasked calls without a
    window or softcap equal diffusers' ``native`` too."""
    attnguard.activate(log="none")
    worst: dict[str, float] = {}
    for backend, args, kw in CALLS:
        ad._check_attention_backend_requirements(ad.AttentionBackendName(backend))
        got = ad.dispatch_attention_fn(*args, backend=backend, **kw)
        with monkeypatch.context() as m:
            m.setattr(_config(backend), "kernel_fn", REFERENCES[backend])
            want = ad.dispatch_attention_fn(*args, backend=backend, **kw)
        got, want = ((x,) if torch.is_tensor(x) else x for x in (got, want))
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None), (backend, kw)
            if g is not None:
                torch.testing.assert_close(g.float(), w.float(), atol=2e-5, rtol=0)
                diff = (g.double() - w.double()).abs().max().item()
                worst[backend] = max(worst.get(backend, 0.0), diff)
        plain = kw.get("attn_mask") is None and not kw.get("attention_kwargs")
        if plain and args[1].shape[1:3] == args[0].shape[1:3]:  # SDPA's causal: top-left
            native = ad.dispatch_attention_fn(*args, backend="native", **kw)
            torch.testing.assert_close(got[0], native, atol=2e-6, rtol=0)
    print(f"largest difference from the float64 models: {worst}")


@absent_here
def test_arguments_the_twins_do_not_compute_keep_diffusers_error(
    captured: list[dict[str, Any]],
) -> None:
    """A call passing what the flash-attn 3 twin does not compute (``qv``), and diffusers'
    context-parallel functions: diffusers' own error, with one event each, never other numbers."""
    attnguard.activate(log="none")
    ad._check_attention_backend_requirements(ad.AttentionBackendName._FLASH_3_HUB)
    config = _config("_flash_3_hub")
    q, k, v = _qkv()
    for _ in range(2):
        with pytest.raises(RuntimeError, match="`kernels` package isn't available"):
            config.kernel_fn(q=q, k=k, v=v, qv=v)
        with pytest.raises(RuntimeError, match="`kernels` package isn't available"):
            config.wrapped_forward_fn(q, k, v)
    aside = [e for e in captured if e["event"] == "observed"]
    assert [(e["reason_code"], e["count"]) for e in aside] == [("no_twin", 1)]
    assert "qv" in aside[0]["reason"]
    ad._check_attention_backend_requirements(ad.AttentionBackendName.FLASH_HUB)
    with pytest.raises(RuntimeError, match="`kernels` package isn't available"):
        _config("flash_hub").wrapped_backward_fn(q, k, v)
    assert "context-parallel" in captured[-1]["reason"]


@absent_here
@pytest.mark.parametrize("mode", ["warn", "strict", "disabled"])
def test_warn_strict_and_disabled_change_nothing(mode: str, captured: list[dict[str, Any]]) -> None:
    model = dw.tiny_flux()
    if mode == "disabled":
        attnguard.activate(log="none", disable=("fallback",))
    else:
        attnguard.activate(log="none", mode=mode)
    expected = attnguard.AttnGuardError if mode == "strict" else RuntimeError
    with pytest.raises(expected) as err:
        model.set_attention_backend("flash_hub")
    assert _config("flash_hub").kernel_fn is None  # no twin put in place
    said = [(e["event"], e["reason_code"], e.get("applied")) for e in captured[1:]]
    if mode == "strict":
        assert str(err.value).startswith("[hub_package_missing]") and said == []
    elif mode == "warn":
        assert said == [("backend_fallback", "hub_package_missing", False)]
    else:
        assert said == [("observed", "hub_package_missing", None)]
        assert "ATTNGUARD_DISABLE names fallback" in captured[-1]["reason"]


@absent_here
def test_deactivate_restores_diffusers_hub_registry() -> None:
    loader = ad._maybe_download_kernel_for_backend
    attnguard.activate(log="none")
    assert ad._maybe_download_kernel_for_backend is not loader
    ad._check_attention_backend_requirements(ad.AttentionBackendName.FLASH_VARLEN_HUB)
    assert _config("flash_varlen_hub").kernel_fn is not None
    attnguard.deactivate()
    assert ad._maybe_download_kernel_for_backend is loader
    config = _config("flash_varlen_hub")
    assert (config.kernel_fn, config.wrapped_forward_fn, config.wrapped_backward_fn) == (None,) * 3
    with pytest.raises(RuntimeError, match="`kernels` package isn't available"):
        ad._check_attention_backend_requirements(ad.AttentionBackendName.FLASH_VARLEN_HUB)


def test_doctor_says_what_computes_each_hub_backend() -> None:
    from attnguard import doctor

    rows = {r["name"]: r["under_attnguard"] for r in doctor.collect()["diffusers"]["backends"]}
    for backend, repo in REPOS.items():
        assert repo in rows[backend] and "attnguard's twin of flash-attn" in rows[backend]
    assert "diffusers' own error" in rows[SAGE] and "SageAttention/sage-attention" in rows[SAGE]


# --- the real kernels package, fresh programs -----------------------------------------------------

BACKENDS = (*TWINNED, SAGE)
LOADABLE = ("flash_hub", "flash_varlen_hub", "_flash_3_hub", "_flash_3_varlen_hub")
CODES = {
    "absent": "hub_package_missing",
    "refused": "hub_package_refused",
    "offline": "hub_kernel_unavailable",
    "no_build": "hub_kernel_unavailable",
}


def _machine(root: Path, name: str) -> dict[str, str]:
    """``absent`` (no kernels), ``refused`` (a kernels release diffusers refuses), ``offline``
    (kernels, an empty cache, HF_HUB_OFFLINE), ``no_build`` (flash-attn2 with a build for another
    backend only, flash-attn3 a build whose import fails), ``loadable`` (stand-ins of both)."""
    env = subprocess_env(
        HF_HUB_OFFLINE="1", HF_HOME=str(root / f"hf-{name}"), ATTNGUARD_LOG="none", TQDM_DISABLE="1"
    )
    env.pop("LOCAL_KERNELS", None)
    package = {"absent": None, "refused": REFUSED}.get(name, KERNELS)
    if name != "absent" and not package:
        why = os.environ.get("TEST_KERNELS_ABSENT") or "run scripts/test.sh"
        pytest.skip(f"no kernels package for the {name!r} machine: {why}")
    if package:
        env["PYTHONPATH"] = os.pathsep.join([package, env["PYTHONPATH"]])
    standin = hub_standin()
    write = standin.write_repo
    stand = root / "standins" / name
    if name == "no_build":
        fa2 = write(stand / "fa2", backend=standin.other_backend())
        fa3 = write(stand / "fa3", name="flash-attn3", version=1, interface="fa3", broken=True)
    if name == "loadable":
        fa2 = write(stand / "fa2")
        fa3 = write(stand / "fa3", name="flash-attn3", version=1, interface="fa3")
    if name in ("no_build", "loadable"):
        env["LOCAL_KERNELS"] = f"{REPOS['flash_hub']}={fa2}:{REPOS['_flash_3_hub']}={fa3}"
    return env


@pytest.fixture(scope="module")
def machines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """machines(name) -> {"plain": ..., "guarded": ...}: one machine's two programs, run side by
    side the first time a test asks, then kept."""
    root = tmp_path_factory.mktemp("diffusers_hub")
    done: dict[str, dict[str, Any]] = {}

    def program(mode: str, env: dict[str, str], out: Path) -> dict[str, Any]:
        env = dict(env, HUB_STANDIN_CALLS=str(out / f"calls-{mode}"))
        args = [PY, str(WORKER), mode, str(out), "--backends", ",".join(BACKENDS)]
        res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, f"diffusers_hub_worker {mode}:\n{res.stderr[-4000:]}"
        return {"out": out, **json.loads(res.stdout.splitlines()[-1])}

    def get(name: str) -> dict[str, Any]:
        if name not in done:
            env = _machine(root, name)
            out = root / name
            out.mkdir()
            with ThreadPoolExecutor(max_workers=2) as pool:
                jobs = {m: pool.submit(program, m, env, out) for m in ("plain", "guarded")}
                done[name] = {m: f.result() for m, f in jobs.items()}
        return done[name]

    return get


@pytest.mark.parametrize(
    "machine", ["absent", pytest.param("offline", marks=pytest.mark.smoke), "no_build", "refused"]
)
def test_a_hub_kernel_that_cannot_load_is_computed_by_the_twins(
    machines: Any, machine: str
) -> None:
    ran = machines(machine)
    plain, guarded = ran["plain"]["backends"], ran["guarded"]["backends"]
    code, said = CODES[machine], set()
    for backend in TWINNED:
        p, g = plain[backend], guarded[backend]
        assert "error" in p, f"{backend}: unguarded, the hub kernel does not load here"
        assert "error" not in g, f"{backend}: {g.get('error')}"
        assert g["max_diff"] <= 1e-6, f"{backend}: {g['max_diff']} from native"
        repo = REPOS[backend]
        want = [] if repo in said else [("backend_fallback", code, "hub-on-sdpa", backend)]
        got = [(e["event"], e["reason_code"], e["rule"], e["requested"]) for e in g["events"]]
        assert got == want, backend  # one event per hub kernel
        assert all(e["site"] == f"diffusers.hub_kernel:{repo}" for e in g["events"])
        said.add(repo)
    if machine == "offline":
        assert plain["flash_hub"]["error"].startswith("ValueError: Version 3 of ")
    if machine == "refused":
        assert "version of at least" in plain["flash_hub"]["error"]
        assert "diffusers accepts only kernels>=" in guarded["flash_hub"]["events"][0]["reason"]


@pytest.mark.parametrize("machine", ["absent", "offline", "refused", "loadable"])
def test_sage_hub_fails_as_unguarded_with_one_event(machines: Any, machine: str) -> None:
    ran = machines(machine)
    p, g = ran["plain"]["backends"][SAGE], ran["guarded"]["backends"][SAGE]
    assert g["error"] == p["error"]
    code = CODES.get(machine, "hub_kernel_unavailable")
    got = [(e["event"], e["reason_code"], e["rule"]) for e in g["events"]]
    assert got == [("observed", code, "hub-aside")]


@pytest.mark.smoke
def test_a_hub_kernel_that_loads_keeps_serving(machines: Any) -> None:
    """Stand-in hub kernels through LOCAL_KERNELS (diffusers' backends check no device unless
    DIFFUSERS_ATTN_CHECKS is set, so they run on this CPU): the same calls into them, bit-equal
    outputs, no event."""
    ran = machines("loadable")
    plain, guarded = ran["plain"]["backends"], ran["guarded"]["backends"]
    out = ran["plain"]["out"]
    for backend in LOADABLE:
        p, g = plain[backend], guarded[backend]
        assert "error" not in p and "error" not in g, (backend, p.get("error"), g.get("error"))
        assert g["calls"] and g["calls"] == p["calls"], f"{backend}: the hub kernel serves"
        assert g["events"] == [], backend
        want, got = (torch.load(out / f"{m}-{backend}.pt") for m in ("plain", "guarded"))
        assert torch.equal(got, want), backend
        # a custom processor's mixed q/k/v dtypes: unified before the hub kernel, as the package
        # backends' calls are (its family takes one dtype)
        mixed = g["mixed"]
        assert "error" not in mixed and ["qkv_unified", "mixed_dtypes"] in mixed["events"], mixed
