"""diffusers on a CUDA GPU: the guard against the real flash-attn kernel and against ``native``
(the GPU half of tests/test_diffusers.py).

A tiny Flux transformer (diffusers' own ``FluxTransformer2DModel``; tests/workers/diffusers_worker.py)
in bfloat16 on ``cuda:0``, its attention backend set to ``flash`` / ``flash_varlen``; each program
is its own process and also runs the model on diffusers' ``native`` backend:

* ``real``: the real flash-attn 2.8.3 on the path, unguarded: diffusers calls the kernel;
* ``real-guarded``: the same with ``import attnguard``: nothing is wrong, so the outputs (the flash
  backend's and native's) are bit-identical to the unguarded program's and no event is emitted;
* ``hidden`` / ``hidden-guarded``: no flash-attn on the path: unguarded, diffusers refuses the
  backend ("... is not usable because of missing package"); guarded, one ``backend_fallback``
  event and the backend's function runs on attnguard's twin of the kernel: within bf16 rounding of
  the real kernel's output and of native's.

And the older path, ``enable_xformers_memory_efficient_attention()`` on a tiny
``UNet2DConditionModel`` in float16 with the image's xformers, whose ops do not load next to this
torch ("No operator found"): unguarded it fails; guarded it matches native within fp16 rounding.

Inputs (each test skips with the reason when one is missing):

* ``$TEST_REAL_FLASH_ATTN_DIR``: the real flash-attn (scripts/gpu_suite.sh; tests/gpu/gpuenv.py);
* ``$TEST_DIFFUSERS_DIR``: diffusers 0.42.1 and what it needs beyond the GPU image, installed
  there by scripts/gpu_suite.sh from the wheels in ``.whl-diffusers/`` (carry ``.whl-diffusers``);
  put on these programs' path only (``bash scripts/fetch_diffusers_wheels.sh`` downloads them).

Everything measured goes to $GPU_RESULTS/diffusers/ when set.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

import gpuenv  # noqa: E402

DIFFUSERS_ENV = "TEST_DIFFUSERS_DIR"
WORKER = gpuenv.WORKERS / "diffusers_worker.py"
REQUIREMENTS_MET = gpuenv.REPO / "scripts" / "requirements_met.py"
BACKENDS = ("flash", "flash_varlen")
# relative to max |reference|: bf16 / fp16 rounding of a two-block model (the twins' bound against
# the kernel in tests/gpu/test_twins_gpu.py is 2e-2 / 5e-3 per call)
REL = {"bfloat16": 3e-2, "float16": 1e-2}
REMEDIES = ("backend_fallback", "backend_rerouted", "kernel_error_recovered", "qkv_unified")


def _diffusers_dir() -> tuple[Path | None, str]:
    raw = os.environ.get(DIFFUSERS_ENV, "").strip()
    if not raw:
        return None, (
            f"{DIFFUSERS_ENV} is not set: diffusers is not in the GPU image; scripts/gpu_suite.sh "
            "installs it from .whl-diffusers/ (carry '.whl-diffusers') and sets it"
        )
    where = Path(raw).resolve()
    if not (where / "diffusers").is_dir():
        return None, f"{DIFFUSERS_ENV}={where} holds no diffusers/ package"
    env = _env(where, real=False)
    for requirement in ("diffusers==0.42.1", f"transformers=={_transformers_version()}"):
        res = subprocess.run(
            [gpuenv.PY, str(REQUIREMENTS_MET), requirement],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if res.returncode != 0:
            missing = "; ".join(res.stdout.strip().splitlines()) or res.stderr.strip()[-300:]
            return None, f"with {where} on the path, {requirement} is not met: {missing}"
    return where, ""


def _transformers_version() -> str:
    from importlib import metadata

    return metadata.version("transformers")


def _env(where: Path, *, real: bool) -> dict[str, str]:
    """A child's environment: diffusers' directory first, the real flash-attn (or none)."""
    env = gpuenv.child_env(real=real, ATTNGUARD_LOG="none")
    env["PYTHONPATH"] = os.pathsep.join([str(where), env["PYTHONPATH"]])
    return env


def _run(
    where: Path, out_dir: Path, name: str, *, real: bool, guard: bool, args: list[str]
) -> dict[str, Any]:
    saved = out_dir / f"{name}.pt"
    cmd = [gpuenv.PY, str(WORKER), "--guard", "import" if guard else "none", "--save", str(saved)]
    res = subprocess.run(
        [*cmd, "--device", "cuda:0", *args],
        env=_env(where, real=real),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = next((x for x in res.stdout.splitlines() if x.startswith('{"max_diff"')), None)
    assert res.returncode == 0 and line is not None, f"{name}: rc {res.returncode}\n{res.stderr}"
    got = json.loads(line)
    got["tensors"] = torch.load(saved) if saved.exists() else None
    (out_dir / f"{name}.json").write_text(
        json.dumps({k: v for k, v in got.items() if k != "tensors"})
    )
    return got


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Every program of this module, four at a time, keyed ``<backend>-<program>``."""
    gpuenv.require()
    where, why = _diffusers_dir()
    if where is None:
        pytest.skip(why)
    out_dir = gpuenv.results_dir(tmp_path_factory, "diffusers")
    flux = ["--model", "flux", "--dtype", "bfloat16"]
    jobs: dict[str, dict[str, Any]] = {}
    for backend in BACKENDS:
        for name, real, guard in (
            ("real", True, False),
            ("real-guarded", True, True),
            ("hidden", False, False),
            ("hidden-guarded", False, True),
        ):
            jobs[f"{backend}-{name}"] = {
                "real": real,
                "guard": guard,
                "args": [*flux, "--backend", backend],
            }
    unet = ["--model", "unet", "--dtype", "float16", "--how", "xformers"]
    jobs["xformers-unguarded"] = {"real": False, "guard": False, "args": unet}
    jobs["xformers-guarded"] = {"real": False, "guard": True, "args": unet}
    # xformers as if not installed: enable_xformers_memory_efficient_attention() (the classic
    # processors, and Flux's dispatcher modules); ACE-Step's grouped-query calls with a mask on
    # the dispatcher's xformers backend
    hide = ["--hide-xformers"]
    flux_enable = ["--model", "flux", "--dtype", "bfloat16", "--how", "xformers", *hide]
    acestep = ["--model", "acestep", "--dtype", "bfloat16", "--backend", "xformers", *hide]
    for name, args in (("unet", [*unet, *hide]), ("flux", flux_enable), ("acestep", acestep)):
        jobs[f"xformers-missing-{name}"] = {"real": False, "guard": False, "args": args}
        jobs[f"xformers-missing-{name}-guarded"] = {"real": False, "guard": True, "args": args}
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {k: pool.submit(_run, where, out_dir, k, **job) for k, job in jobs.items()}
        return {k: f.result() for k, f in futures.items()}


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _remedies(run: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [
        (e["event"], e["site"], e["reason_code"]) for e in run["events"] if e["event"] in REMEDIES
    ]


@pytest.mark.parametrize("backend", BACKENDS)
def test_real_kernel_through_diffusers_guarded_is_bit_identical_and_quiet(
    backend: str, runs: dict[str, dict[str, Any]]
) -> None:
    real, guarded = runs[f"{backend}-real"], runs[f"{backend}-real-guarded"]
    assert real["active"] is False and guarded["active"] is True
    for run in (real, guarded):
        assert run["error"] is None, run["error"]
        assert run["flash_attn"], "flash_attn was not imported"
        assert Path(run["flash_attn"]).resolve().is_relative_to(gpuenv.configured())
    # the real kernel computes what native computes, within bf16 rounding (the reference's check)
    assert _rel_err(real["tensors"]["out"], real["tensors"]["native"]) < REL["bfloat16"]
    # nothing wrong: the guard changes no number and says nothing
    assert torch.equal(guarded["tensors"]["out"], real["tensors"]["out"])
    assert torch.equal(guarded["tensors"]["native"], real["tensors"]["native"])
    assert guarded["events"] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_hidden_runs_on_the_twin_close_to_the_kernel_and_native(
    backend: str, runs: dict[str, dict[str, Any]]
) -> None:
    hidden, guarded = runs[f"{backend}-hidden"], runs[f"{backend}-hidden-guarded"]
    real = runs[f"{backend}-real"]
    assert hidden["active"] is False and guarded["active"] is True
    assert hidden["flash_attn"] is None and guarded["flash_attn"] is None
    assert hidden["error"] is not None and f"backend '{backend}' is not usable" in hidden["error"]
    assert guarded["error"] is None, guarded["error"]
    assert _remedies(guarded) == [
        ("backend_fallback", f"diffusers.{backend}", "backend_package_unusable")
    ]
    twin = guarded["tensors"]["out"]
    assert _rel_err(twin, real["tensors"]["out"]) < REL["bfloat16"]  # the real kernel's output
    assert _rel_err(twin, guarded["tensors"]["native"]) < REL["bfloat16"]
    # the same model and inputs in every process: native's output does not depend on flash-attn
    assert torch.equal(guarded["tensors"]["native"], real["tensors"]["native"])


def test_enable_xformers_with_unusable_ops_runs_guarded_with_natives_numbers(
    runs: dict[str, dict[str, Any]],
) -> None:
    unguarded, guarded = runs["xformers-unguarded"], runs["xformers-guarded"]
    if unguarded["error"] is None:
        pytest.skip("xformers' ops run here: not the 'xformers unusable' case")
    if "No module named" in unguarded["error"] or "ModuleNotFoundError" in unguarded["error"]:
        pytest.skip(f"xformers is not installed here ({unguarded['error']}): scripts/gpu_suite.sh")
    assert "No operator found" in unguarded["error"], unguarded["error"]
    assert guarded["error"] is None, guarded["error"]
    got = guarded["tensors"]
    assert _rel_err(got["out"], got["native"]) < REL["float16"]
    remedied = _remedies(guarded)
    assert remedied and {site for _, site, _ in remedied} == {"xformers.memory_efficient_attention"}


MISSING = {
    "unet": ("ModuleNotFoundError", "diffusers.xformers_processors", "xformers_missing", "float16"),
    "flux": ("ModuleNotFoundError", "diffusers.xformers", "backend_package_unusable", "bfloat16"),
    "acestep": ("RuntimeError", "diffusers.xformers", "backend_package_unusable", "bfloat16"),
}


@pytest.mark.parametrize("model", sorted(MISSING))
def test_xformers_missing_runs_guarded_with_natives_numbers(
    model: str, runs: dict[str, dict[str, Any]]
) -> None:
    """Without xformers: ``enable_xformers_memory_efficient_attention()`` (unet, flux) and the
    dispatcher's xformers backend with grouped-query calls and a mask (acestep). Unguarded
    diffusers refuses; guarded one event and native's numbers within the dtype's rounding."""
    unguarded, guarded = (
        runs[f"xformers-missing-{model}"],
        runs[f"xformers-missing-{model}-guarded"],
    )
    error, site, reason, dtype = MISSING[model]
    assert unguarded["error"] is not None and unguarded["error"].startswith(error), unguarded
    assert guarded["error"] is None, guarded["error"]
    got = guarded["tensors"]
    assert _rel_err(got["out"], got["native"]) < REL[dtype]
    assert _remedies(guarded) == [("backend_fallback", site, reason)]
