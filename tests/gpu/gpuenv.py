"""Where the GPU tests get the real flash-attn, and processes with and without it.

The GPU suite (scripts/gpu_suite.sh) unpacks the real flash-attn 2.8.3 wheel (built for sm90,
torch 2.11, CUDA 13, Python 3.12: flash_attn/, hopper/, ``flash_attn_2_cuda.*.so``, the
dist-info) into a directory and exports ``TEST_REAL_FLASH_ATTN_DIR`` with it. Nothing else puts
flash-attn on the path: a test that needs the kernel puts that directory on a child's PYTHONPATH
(:func:`child_env` with ``real=True``) or on ``sys.path`` (:func:`put_on_sys_path`), and skips
with the reason when the variable is unset or ``import flash_attn_2_cuda`` fails there. A test
about "flash-attn absent" runs in a child whose PYTHONPATH has no directory holding a
``flash_attn`` package (:func:`child_env` with ``real=False``). The stand-in of tests/standins
never counts as flash-attn here; only tests/gpu/test_standin_vs_real_gpu.py puts it on a child's
path, to compare it with the real kernel.

Not a test module (no ``test_`` prefix): imported by the tests of this directory.
"""

from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ENV = "TEST_REAL_FLASH_ATTN_DIR"
REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
STANDINS = TESTS / "standins"
WORKERS = TESTS / "workers"
PY = sys.executable

_PROBE = (
    "import torch, flash_attn_2_cuda, flash_attn, flash_attn.flash_attn_interface\n"
    "assert not getattr(flash_attn, 'IS_ATTNGUARD_STANDIN', False), 'the stand-in'\n"
    "print('FLASH', flash_attn.__version__, flash_attn.__file__, flash_attn_2_cuda.__file__)\n"
)


def holds_flash(entry: str) -> bool:
    """A path entry that would make ``import flash_attn`` work (a package or its extension)."""
    if not entry:
        return False
    p = Path(entry)
    try:
        if p.resolve() == STANDINS.resolve():
            return True
        return (p / "flash_attn").is_dir() or any(p.glob("flash_attn_2_cuda*.so"))
    except OSError:
        return False


def without_flash(entries: list[str]) -> list[str]:
    return [e for e in entries if e and not holds_flash(e)]


def configured() -> Path | None:
    raw = os.environ.get(ENV, "").strip()
    return Path(raw).resolve() if raw else None


@functools.cache
def probe() -> tuple[Path | None, str]:
    """(directory, version line) when the real flash-attn imports, with its CUDA extension, in a
    child Python that has only $TEST_REAL_FLASH_ATTN_DIR (and this checkout) on its path;
    (None, why not) otherwise. Run once per test process."""
    where = configured()
    if where is None:
        return None, (
            f"{ENV} is not set: the real flash-attn is needed (scripts/gpu_suite.sh unpacks "
            f"the flash-attn wheel and sets {ENV})"
        )
    if not (where / "flash_attn").is_dir():
        return None, f"{ENV}={where} holds no flash_attn/ package"
    try:
        res = subprocess.run(
            [PY, "-c", _PROBE],
            env=child_env(real=True),
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return None, f"importing flash_attn_2_cuda from {where} took over 300 s"
    line = next((x for x in res.stdout.splitlines() if x.startswith("FLASH ")), None)
    if res.returncode != 0 or line is None:
        tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
        return None, f"`import flash_attn_2_cuda` fails with {ENV}={where} on the path: {tail}"
    _, version, package, extension = line.split(" ", 3)
    if not Path(package).resolve().is_relative_to(where):
        return None, f"flash_attn was imported from {package}, not from {ENV}={where}"
    return where, f"flash-attn {version} ({extension})"


def require() -> Path:
    """The real flash-attn's directory, or skip the test with the reason."""
    where, why = probe()
    if where is None:
        pytest.skip(why)
    return where


def child_env(*, real: bool, **extra: str) -> dict[str, str]:
    """Environment for a child Python of this checkout: the real flash-attn first on its path
    (``real=True``; $TEST_REAL_FLASH_ATTN_DIR) or no flash-attn at all (``real=False``). Every
    other entry of PYTHONPATH that holds a flash_attn package (or the stand-in) is dropped.
    ATTNGUARD_* settings of this process are not passed on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    entries = without_flash(env.get("PYTHONPATH", "").split(os.pathsep))
    front = [str(configured())] if real and configured() is not None else []
    env["PYTHONPATH"] = os.pathsep.join([*front, str(REPO), *entries])
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def put_on_sys_path() -> str | None:
    """For tests that use the real kernel in their own process: put $TEST_REAL_FLASH_ATTN_DIR
    first on ``sys.path`` now (before transformers caches whether flash-attn is available) and
    drop the stand-in. Returns why not (the variable is unset, or no flash_attn there), else
    None. Importing the CUDA extension is :func:`import_in_process`'s job."""
    for entry in [e for e in sys.path if e and Path(e).resolve() == STANDINS.resolve()]:
        sys.path.remove(entry)
    where = configured()
    if where is None:
        return f"{ENV} is not set: the real flash-attn is needed (scripts/gpu_suite.sh sets it)"
    if not (where / "flash_attn").is_dir():
        return f"{ENV}={where} holds no flash_attn/ package"
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    return None


def import_in_process() -> object:
    """The real ``flash_attn`` package imported in this process from $TEST_REAL_FLASH_ATTN_DIR
    (after :func:`put_on_sys_path`), or skip with the reason. A flash_attn already imported from
    elsewhere (the stand-in) cannot be swapped: both define the same torch custom ops."""
    why = put_on_sys_path()
    if why is not None:
        pytest.skip(why)
    where = configured()
    loaded = sys.modules.get("flash_attn")
    if loaded is not None and getattr(loaded, "IS_ATTNGUARD_STANDIN", False):
        pytest.skip("the flash-attn stand-in was imported in this process: run this file alone")
    try:
        import flash_attn
        import flash_attn_2_cuda  # noqa: F401
    except Exception as exc:  # ImportError, OSError, an undefined symbol of a broken build
        pytest.skip(f"`import flash_attn_2_cuda` fails with {ENV}={where} on sys.path: {exc!r}")
    if not Path(flash_attn.__file__).resolve().is_relative_to(where):
        pytest.skip(f"flash_attn was imported from {flash_attn.__file__}, not from {where}")
    return flash_attn


def hook_installed() -> bool:
    """attnguard's start-up hook is in site-packages (ATTNGUARD=1 reaches torchrun's workers)."""
    probe_code = "import sys; print('attnguard' in sys.modules)"
    env = child_env(real=False, ATTNGUARD="1", ATTNGUARD_LOG="none")
    res = subprocess.run([PY, "-c", probe_code], env=env, capture_output=True, text=True)
    return res.stdout.strip() == "True"


@contextlib.contextmanager
def workers_with_real_flash() -> Iterator[None]:
    """For tests that launch torchrun workers with ATTNGUARD=1: the real flash-attn first on the
    workers' PYTHONPATH (tests/test_ranks.launch builds the child's path from this process's),
    and attnguard's start-up hook installed so that ATTNGUARD=1 reaches them; skips otherwise."""
    require()
    if not hook_installed():
        pytest.skip("attnguard's start-up hook is not installed (scripts/gpu_suite.sh copies it)")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", child_env(real=True)["PYTHONPATH"])
        yield


def results_dir(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """Where a test writes what it measured: $GPU_RESULTS/<name> when set (the suite bundles it),
    else a temporary directory."""
    base = os.environ.get("GPU_RESULTS")
    out = Path(base) / name if base else tmp_path_factory.mktemp(name)
    out.mkdir(parents=True, exist_ok=True)
    return out
