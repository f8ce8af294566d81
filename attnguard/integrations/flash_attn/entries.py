"""Per-call guard for flash_attn's direct entry points, patched when ``flash_attn`` is imported.

``flash_attn_func``, ``flash_attn_varlen_func``, their qkv/kv-packed variants and
``flash_attn_with_kvcache`` are replaced on both ``flash_attn`` and
``flash_attn.flash_attn_interface``, so ``from flash_attn import flash_attn_func`` and
``from flash_attn.flash_attn_interface import flash_attn_func`` in user code, run after attnguard
is active, bind the guarded closures (:func:`attnguard.callguard.wrap_direct`). When the kernel
cannot run a call, its SDPA twin from :mod:`attnguard.fallback` does, with the same call shape.

A function is guarded only where its shape is the one its twin takes (every parameter, the
positional order: :func:`attnguard.integrations.ledger.signature_unrecognised`), whatever flash-attn's
version number says; a release that adds a parameter leaves that function unguarded, and one
``observed`` event (``signature_unrecognised``) says so.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from ... import callguard, kernels, runtime
from ...kernel_identity import Family
from ..ledger import Ledger, unrecognised_entry

ledger = Ledger("flash_attn")

# flash_attn function -> the parameters holding q/k/v-like tensors (the first holds the query)
FLASH_TENSOR_PARAMS: dict[str, tuple[str, ...]] = {
    "flash_attn_func": ("q", "k", "v"),
    "flash_attn_varlen_func": ("q", "k", "v"),
    "flash_attn_qkvpacked_func": ("qkv",),
    "flash_attn_kvpacked_func": ("q", "kv"),
    "flash_attn_varlen_qkvpacked_func": ("qkv",),
    "flash_attn_varlen_kvpacked_func": ("q", "kv"),
    "flash_attn_with_kvcache": ("q", "k_cache", "v_cache"),
}
# where the head dimension sits in the first tensor of each flash function
FLASH_HEAD_AXIS = {
    "flash_attn_func": 3,
    "flash_attn_varlen_func": 2,
    "flash_attn_qkvpacked_func": 4,
    "flash_attn_kvpacked_func": 3,
    "flash_attn_varlen_qkvpacked_func": 3,
    "flash_attn_varlen_kvpacked_func": 2,
    "flash_attn_with_kvcache": 3,
}
# tensors a flash_attn_with_kvcache call also takes that must sit on the query's device
FLASH_KVCACHE_AUX = ("k", "v", "alibi_slopes", "cache_seqlens", "cache_batch_idx", "cache_leftpad")


def _wrap(name: str, original: Any) -> Any:
    if getattr(original, "__attnguard_original__", None) is not None:
        return original
    from ...fallback import FLASH_FUNCTIONS

    if name == "flash_attn_with_kvcache":
        # the caches are updated in place: never cast or move them, only the query and the rest
        tensors, aux = ("q",), FLASH_KVCACHE_AUX
    else:
        tensors, aux = FLASH_TENSOR_PARAMS[name], ("alibi_slopes",)
    entry = callguard.Entry(
        name,
        kernels.EntryKind.FLASH_KERNEL,
        original,
        tensors=tensors,
        twin=FLASH_FUNCTIONS[name],
        site=f"flash_attn.{name}",
        aux=aux,
        head_axis=FLASH_HEAD_AXIS[name],
        in_force=runtime.IN_FORCE,
        family=Family.FA2,  # the release line this integration patches (>=2.6,<3)
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
    from ...fallback import FLASH_FUNCTIONS

    wrappers: dict[int, Any] = {}  # id(original) -> wrapper: one closure per function
    refused: dict[int, bool] = {}  # id(original) -> not the shape its twin takes
    for name in FLASH_TENSOR_PARAMS:
        if name not in FLASH_FUNCTIONS:
            continue  # no twin to carry the calls the kernel cannot take
        for owner in owners:
            original = getattr(owner, name, None)
            if not callable(original):
                continue
            if id(original) not in refused:
                site, twin = f"flash_attn.{name}", FLASH_FUNCTIONS[name]
                refused[id(original)] = unrecognised_entry(site, original, twin)
            if refused[id(original)]:
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
