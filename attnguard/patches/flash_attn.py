"""Per-call guard for flash_attn's direct entry points, patched when ``flash_attn`` is imported.

``flash_attn_func``, ``flash_attn_varlen_func``, their qkv/kv-packed variants and
``flash_attn_with_kvcache`` are replaced on both ``flash_attn`` and
``flash_attn.flash_attn_interface``, so ``from flash_attn import flash_attn_func`` and
``from flash_attn.flash_attn_interface import flash_attn_func`` in user code, run after attnguard
is active, bind the guarded closures (:func:`attnguard.callguard.wrap_direct`). When the kernel
cannot run a call, its SDPA twin from :mod:`attnguard.fallback` does, with the same call shape.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from .. import callguard, routing
from ..patching import Ledger

ledger = Ledger("flash_attn")


def _wrap(name: str, original: Any) -> Any:
    if getattr(original, "__attnguard_original__", None) is not None:
        return original
    from ..fallback import FLASH_FUNCTIONS

    if name == "flash_attn_with_kvcache":
        # the caches are updated in place: never cast or move them, only the query and the rest
        tensors, aux = ("q",), callguard.FLASH_KVCACHE_AUX
    else:
        tensors, aux = callguard.FLASH_TENSOR_PARAMS[name], ("alibi_slopes",)
    entry = callguard.Entry(
        name,
        routing.FLASH_KERNEL,
        original,
        tensors=tensors,
        twin=FLASH_FUNCTIONS[name],
        site=f"flash_attn.{name}",
        aux=aux,
    )
    return callguard.wrap_direct(entry)


def patch(module: ModuleType) -> None:
    """Guard the four entry points on ``flash_attn`` and its ``flash_attn_interface``."""
    owners = [module]
    interface = getattr(module, "flash_attn_interface", None) or sys.modules.get(
        "flash_attn.flash_attn_interface"
    )
    if isinstance(interface, ModuleType):
        owners.append(interface)
    from ..fallback import FLASH_FUNCTIONS

    wrappers: dict[int, Any] = {}  # id(original) -> wrapper: one closure per function
    for name in callguard.FLASH_TENSOR_PARAMS:
        if name not in FLASH_FUNCTIONS:
            continue  # no twin to carry the calls the kernel cannot take
        for owner in owners:
            original = getattr(owner, name, None)
            if not callable(original):
                continue

            def make(orig: Any, _name: str = name) -> Any:
                wrapper = wrappers.get(id(orig))
                if wrapper is None:
                    wrapper = wrappers[id(orig)] = _wrap(_name, orig)
                return wrapper

            ledger.patch(owner, name, make)


def unpatch() -> None:
    """Restore every original this integration replaced."""
    ledger.unpatch_all()
    for site in [
        s for s in callguard.latched if isinstance(s, str) and s.startswith("flash_attn.")
    ]:
        callguard.latched.pop(site, None)
