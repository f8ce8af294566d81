"""The stand-ins (tests/standins) and the optional packages the tests use where installed."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from helpers.processes import TESTS

STANDINS = TESTS / "standins"
# the kernels package scripts/test.sh provides for the hub-kernel tests' programs only
KERNELS_DIR = os.environ.get("TEST_KERNELS_DIR")


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


def local_kernels_unservable() -> str:
    """Why this transformers cannot load a local stand-in hub kernel here ("" where it can)."""
    if not KERNELS_DIR:
        return os.environ.get("TEST_KERNELS_ABSENT") or "no kernels package (run scripts/test.sh)"
    package = Path(KERNELS_DIR, "kernels")
    if not any("LOCAL_KERNELS" in f.read_text(errors="replace") for f in package.rglob("*.py")):
        return "this kernels release loads no kernel from a local folder"
    import transformers.utils.import_utils as utils
    from packaging.specifiers import SpecifierSet

    low = getattr(utils, "KERNELS_MIN_VERSION", None)
    high = getattr(utils, "KERNELS_MAX_VERSION", None)
    window = ",".join(f"{op}{v}" for op, v in ((">=", low), ("<", high)) if v)
    from importlib import metadata

    dist = next(metadata.distributions(path=[KERNELS_DIR], name="kernels"), None)
    version = dist.version if dist is not None else "?"
    if window and version not in SpecifierSet(window):
        return f"no hub kernel can load beside this transformers: kernels {version}, it accepts kernels{window}"
    import transformers.integrations.hub_kernels as hub_kernels

    if not callable(getattr(hub_kernels, "load_and_register_attn_kernel", None)):
        return "this transformers has no loader of attention hub kernels to register one's own function"
    return ""
