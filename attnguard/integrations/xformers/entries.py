"""Per-call guard for xformers' ``memory_efficient_attention``, patched when ``xformers.ops`` is
imported, on both ``xformers.ops`` and ``xformers.ops.fmha``.

Mixed q/k/v (and bias) dtypes are unified; when the kernel cannot run (CPU tensors, ops that did
not load next to this torch: "No operator found for `memory_efficient_attention_forward`") the
SDPA twin from :mod:`attnguard.fallback` carries the call, bias objects included. Guarded only
where its signature is the one the twin takes (see :mod:`.flash_attn`).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

from ... import callguard, kernels, runtime
from ...kernel_identity import Family
from ..ledger import Ledger, unrecognised_entry

ledger = Ledger("xformers")
SITE = "xformers.memory_efficient_attention"
XFORMERS_TENSOR_PARAMS = ("query", "key", "value")


def _wrap(original: Any) -> Any:
    if getattr(original, "__attnguard_original__", None) is not None:
        return original
    from ...fallback import xformers_memory_efficient_attention

    entry = callguard.Entry(
        "memory_efficient_attention",
        kernels.EntryKind.XFORMERS,
        original,
        tensors=XFORMERS_TENSOR_PARAMS,
        twin=xformers_memory_efficient_attention,
        mask="attn_bias",
        site=SITE,
        in_force=runtime.IN_FORCE,
        family=Family.XFORMERS,
    )
    return callguard.wrap_direct(entry)


def patch(module: ModuleType) -> None:
    """Guard ``memory_efficient_attention`` on ``xformers.ops`` and ``xformers.ops.fmha``."""
    owners = [module]
    fmha = getattr(module, "fmha", None) or sys.modules.get("xformers.ops.fmha")
    if isinstance(fmha, ModuleType):
        owners.append(fmha)
    wrappers: dict[int, Any] = {}
    for owner in owners:
        original = getattr(owner, "memory_efficient_attention", None)
        if not callable(original):
            continue
        from ...fallback import xformers_memory_efficient_attention

        if unrecognised_entry(SITE, original, xformers_memory_efficient_attention):
            continue

        def make(orig: Any) -> Any:
            wrapper = wrappers.get(id(orig))
            if wrapper is None:
                wrapper = wrappers[id(orig)] = _wrap(orig)
            return wrapper

        ledger.patch(owner, "memory_efficient_attention", make)


def unpatch() -> None:
    """Restore every original this integration replaced."""
    ledger.unpatch_all()
    callguard.latched.pop(SITE, None)
