"""The fixtures the twins' GPU tests share (tests/gpu/test_twins_gpu.py,
tests/gpu/test_twins_determinism_gpu.py): the real flash-attn functions, and the kernel-table
rows the twins take. Their other shared pieces are in tests/helpers/gpu_twins.py."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import gpuenv
import pytest


@pytest.fixture(scope="module")
def real():
    """The real flash_attn functions, from $TEST_REAL_FLASH_ATTN_DIR (skipped without it)."""
    package = gpuenv.import_in_process()
    interface = importlib.import_module("flash_attn.flash_attn_interface")
    padding = importlib.import_module("flash_attn.bert_padding")

    def original(fn):  # attnguard's wrapper, if the guard patched it, unwrapped
        return getattr(fn, "__attnguard_original__", None) or fn

    names = [
        "flash_attn_func",
        "flash_attn_qkvpacked_func",
        "flash_attn_kvpacked_func",
        "flash_attn_varlen_func",
        "flash_attn_varlen_qkvpacked_func",
        "flash_attn_varlen_kvpacked_func",
        "flash_attn_with_kvcache",
    ]
    ns = SimpleNamespace(version=getattr(package, "__version__", "?"))
    for name in names:
        setattr(ns, name, original(getattr(interface, name)))
    for name in ("index_first_axis", "unpad_input", "pad_input"):
        setattr(ns, name, getattr(padding, name))
    return ns


@pytest.fixture
def routes(monkeypatch):
    """The kernel-table rows the twins take during a test (attnguard/fallback/routes.py)."""
    from attnguard.fallback import routes as twin_routes

    taken: list[str] = []
    for name in ("dense", "varlen", "kvcache", "xformers"):
        fn = getattr(twin_routes, name)

        def spy(*args, _fn=fn, **kwargs):
            taken.append(_fn(*args, **kwargs))
            return taken[-1]

        monkeypatch.setattr(twin_routes, name, spy)
    return taken
