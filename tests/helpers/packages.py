"""The stand-ins (tests/standins) and the optional packages the tests use where installed."""

from __future__ import annotations

import os
import sys
from typing import Any

from helpers.processes import TESTS

STANDINS = TESTS / "standins"


def hub_standin() -> Any:
    """tests/standins/hub_kernel.py, the stand-in hub kernel's writer (loaded by path: that folder
    also holds the flash-attn stand-in, which must not become importable in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hub_standin", STANDINS / "hub_kernel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require(module: str) -> Any:
    """Import an optional test dependency: skip without it locally, fail without it in CI."""
    import importlib

    import pytest

    if os.environ.get("CI"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


def purge_flash_attn() -> None:
    """Forget every imported flash_attn module (the next import finds whatever is on the path)."""
    for name in [m for m in sys.modules if m == "flash_attn" or m.startswith("flash_attn.")]:
        del sys.modules[name]


def diffusers_dispatch() -> Any:
    """diffusers' attention dispatcher module, or skip the calling test module with the reason.
    scripts/test.sh provides diffusers where pip can install it beside this environment's
    transformers and otherwise says why not in TEST_DIFFUSERS_ABSENT; where it provided it
    (TEST_DIFFUSERS_EXPECTED=1), diffusers failing to import is a failure, not a skip."""
    import pytest

    absent = os.environ.get("TEST_DIFFUSERS_ABSENT")
    if absent:
        pytest.skip(absent, allow_module_level=True)
    try:
        import diffusers.models.attention_dispatch as ad
    except Exception as exc:
        if os.environ.get("TEST_DIFFUSERS_EXPECTED") == "1":
            raise
        pytest.skip(f"diffusers does not import here: {exc!r}", allow_module_level=True)
    return ad


def flash_status() -> Any:
    """facts' verdict on flash_attention_2 here, or skip: these tests need flash-attn absent or
    broken (this CPU machine)."""
    import pytest

    from attnguard import facts

    status = facts.current().backend("flash_attention_2")
    if status.usable:
        pytest.skip("flash-attn is usable here: these tests need it absent or broken")
    return status
