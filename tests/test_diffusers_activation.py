"""The diffusers integration in fresh interpreters: each way of switching attnguard on, each order
of imports, and each state of the backend's package a user's machine can be in (flash-attn
missing, installed but unable to run here, broken; xformers missing or unusable), with the
backend chosen each way diffusers offers (``set_attention_backend``, ``attention_backend(...)``,
``DIFFUSERS_ATTN_BACKEND``). Each run is tests/workers/diffusers_worker.py: a tiny Flux
transformer with the backend asked for, compared with the same model on ``native``.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.packages import STANDINS, diffusers_dispatch
from helpers.processes import PY, REPO, fresh_venv, subprocess_env

diffusers_dispatch()  # or the module skips, saying why diffusers is not here

WORKER = REPO / "tests" / "workers" / "diffusers_worker.py"
BROKEN_FLASH = os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR")
TIMEOUT = 300


def _path(*, xformers: bool = True, extra: tuple[str, ...] = ()) -> str:
    """PYTHONPATH for a child: this checkout, what the test run has (diffusers, xformers where
    the run puts them there), less xformers when ``xformers=False``."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not xformers:
        entries = [p for p in entries if not (Path(p) / "xformers").is_dir()]
    return os.pathsep.join([*extra, str(REPO), *entries])


def _worker(
    *args: str, xformers: bool = True, extra: tuple[str, ...] = (), **env: str
) -> dict[str, Any]:
    environ = subprocess_env(ATTNGUARD_LOG="none", **env)
    environ["PYTHONPATH"] = _path(xformers=xformers, extra=extra)
    res = subprocess.run(
        [PY, str(WORKER), *args],
        env=environ,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert res.returncode == 0 and res.stdout.strip(), res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _events(out: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(e["event"], e["site"], e["reason_code"]) for e in out["events"]]


FALLBACK = ("backend_fallback", "diffusers.flash", "backend_package_unusable")


@pytest.mark.parametrize("how", ["set", "context"])
def test_import_attnguard_flash_without_flash_attn(how: str) -> None:
    unguarded = _worker("--backend", "flash", "--how", how)
    assert unguarded["error"].startswith("RuntimeError: Flash Attention backend 'flash' is not")
    guarded = _worker("--backend", "flash", "--how", how, "--guard", "import")
    assert guarded["error"] is None and guarded["max_diff"] <= 1e-6, guarded
    assert _events(guarded) == [FALLBACK]


@pytest.mark.parametrize("order", ["attnguard-first", "diffusers-first"])
def test_flash_attn_installed_but_unable_to_run_here(order: str) -> None:
    """flash-attn importable (the stand-in: its kernel runs on CUDA only, as the real one):
    diffusers binds its functions at import; guarded, they are flash_attn's guarded ones."""
    first = ("--diffusers-first",) if order == "diffusers-first" else ()
    standin = (str(STANDINS),)
    unguarded = _worker("--backend", "flash", *first, extra=standin)
    assert unguarded["flash_attn"].startswith(str(STANDINS))
    assert unguarded["error"].startswith("NotImplementedError: Could not run 'flash_attn::")
    guarded = _worker("--backend", "flash", "--guard", "import", *first, extra=standin)
    assert guarded["error"] is None and guarded["max_diff"] <= 1e-6, guarded
    assert _events(guarded) == [("backend_rerouted", "flash_attn.flash_attn_func", "cpu_tensors")]


@pytest.mark.skipif(not BROKEN_FLASH, reason="TEST_BROKEN_FLASH_ATTN_DIR not set (scripts/test.sh)")
def test_broken_flash_attn_install() -> None:
    """flash-attn installed, its CUDA extension missing: diffusers (0.37+) catches the failed
    import and reports the backend unusable. (Without xformers: xformers.ops imports flash-attn
    and fails with it, and diffusers' models with it, guarded or not.)"""
    import diffusers

    if tuple(int(p) for p in diffusers.__version__.split(".")[:2]) < (0, 37):
        pytest.skip("diffusers < 0.37 imports flash-attn at import: a broken install fails there")
    broken = (str(BROKEN_FLASH),)
    unguarded = _worker("--backend", "flash", extra=broken, xformers=False)
    assert unguarded["error"].startswith("RuntimeError: Flash Attention backend 'flash' is not")
    guarded = _worker("--backend", "flash", "--guard", "import", extra=broken, xformers=False)
    assert guarded["error"] is None and guarded["max_diff"] <= 1e-6, guarded
    assert _events(guarded) == [FALLBACK]


def test_backend_chosen_by_diffusers_attn_backend() -> None:
    """diffusers never checks the backend its variable names: unguarded the first attention
    call fails on the missing kernel."""
    unguarded = _worker("--how", "env", DIFFUSERS_ATTN_BACKEND="flash")
    assert unguarded["error"] == "TypeError: 'NoneType' object is not callable"
    guarded = _worker("--how", "env", "--guard", "import", DIFFUSERS_ATTN_BACKEND="flash")
    assert guarded["error"] is None and guarded["max_diff"] <= 1e-6, guarded
    assert _events(guarded) == [FALLBACK]
    assert "DIFFUSERS_ATTN_BACKEND" in guarded["events"][0]["reason"]


@pytest.mark.parametrize("model", ["flux", "acestep"])
def test_xformers_backend_without_xformers(model: str) -> None:
    """acestep: grouped-query attention (``enable_gqa``) with the 4D mask diffusers builds for
    its sliding-window layers: xformers' grouped layout with a bias for every query head."""
    unguarded = _worker("--backend", "xformers", "--model", model, xformers=False)
    assert unguarded["error"].startswith("RuntimeError: Xformers Attention backend 'xformers'")
    guarded = _worker(
        "--backend", "xformers", "--model", model, "--guard", "import", xformers=False
    )
    assert guarded["error"] is None and guarded["max_diff"] <= 1e-6, guarded
    assert _events(guarded) == [
        ("backend_fallback", "diffusers.xformers", "backend_package_unusable")
    ]


def test_diffusers_outside_the_supported_versions_is_not_patched() -> None:
    code = (
        "import logging, json; logging.disable(logging.WARNING)\n"
        "import diffusers; diffusers.__version__ = '0.30.0'\n"
        "from attnguard.observability import events\n"
        "with events.capture() as got:\n"
        "    import diffusers.models.attention_dispatch as ad\n"
        "try:\n"
        "    ad._check_attention_backend_requirements(ad.AttentionBackendName.FLASH)\n"
        "    error = None\n"
        "except RuntimeError as exc:\n"
        "    error = type(exc).__name__\n"
        "print(json.dumps([error, [(e['event'], e['reason_code']) for e in got]]))\n"
    )
    environ = subprocess_env(ATTNGUARD_LOG="none")
    environ["PYTHONPATH"] = _path()
    res = subprocess.run(
        [PY, "-c", code], env=environ, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    error, got = json.loads(res.stdout.strip().splitlines()[-1])
    assert error == "RuntimeError"
    assert ["observed", "version_unsupported"] in got


# --- the start-up hook and `attnguard run`, from a real install ----------------------------------


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:

    return fresh_venv(tmp_path_factory.mktemp("venv"), editable=False)


def _installed_env(venv: Path, **extra: str) -> dict[str, str]:
    environ = subprocess_env(ATTNGUARD_LOG="none", **extra)
    # what the test run has on its path (diffusers, xformers where it puts them there); not
    # this checkout: attnguard comes from the venv's own install
    environ["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    environ["PATH"] = f"{venv / 'bin'}:{environ.get('PATH', '/usr/bin:/bin')}"
    return environ


def test_startup_hook_guards_a_diffusers_program(installed: Path) -> None:
    res = subprocess.run(
        [str(installed / "bin" / "python"), str(WORKER), "--backend", "flash"],
        env=_installed_env(installed, ATTNGUARD="1"),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd="/",
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["active"] and out["error"] is None and out["max_diff"] <= 1e-6, res.stderr[-3000:]
    assert _events(out) == [FALLBACK]


def test_attnguard_run_guards_a_diffusers_program(installed: Path) -> None:
    res = subprocess.run(
        [str(installed / "bin" / "attnguard"), "run", "--", "python", str(WORKER)],
        env=_installed_env(installed),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd="/",
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["active"] and out["error"] is None and out["max_diff"] <= 1e-6, res.stderr[-3000:]
    assert _events(out) == [FALLBACK]
