"""Per-call guard on every entry of transformers' attention registry.

The registry is ``ALL_ATTENTION_FUNCTIONS``: a plain dict on 4.49-4.50, an ``AttentionInterface``
from 4.51 whose class-wide ``_global_mapping`` every instance reads. Models look the function up
at each forward, so replacing the entries guards live models too. Each entry becomes a plain
closure from :func:`attnguard.callguard.wrap_registry_entry` (a wrapt proxy there breaks
torch.compile). ``AttentionInterface.register`` is wrapped as well, so entries registered later
(hub kernels, user functions) are guarded. Unpatch puts back exactly what was there, unless
someone replaced our entry since.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from .. import callguard
from ..patching import Ledger

# the registry's dict entries and AttentionInterface.register
ledger = Ledger("transformers_attention")


def registry_mapping(modeling_utils: ModuleType) -> dict[str, Any] | None:
    """The dict that holds the registry's functions in this transformers version."""
    interface = getattr(modeling_utils, "AttentionInterface", None)
    mapping = getattr(interface, "_global_mapping", None)
    if isinstance(mapping, dict):
        return mapping
    funcs = getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None)
    return funcs if isinstance(funcs, dict) else None


def _is_guarded(fn: Any) -> bool:
    return getattr(fn, "__attnguard_original__", None) is not None


def _guard_entry(mapping: dict[str, Any], key: str) -> None:
    fn = mapping.get(key)
    if not callable(fn) or _is_guarded(fn):
        return
    ledger.patch_item(mapping, key, lambda original: callguard.wrap_registry_entry(key, original))


def patch(modeling_utils: ModuleType) -> None:
    """Guard every registry entry, and entries registered from now on."""
    mapping = registry_mapping(modeling_utils)
    if mapping is None:
        return
    for key in list(mapping):
        _guard_entry(mapping, key)
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is not None and hasattr(interface, "register"):
        ledger.patch(interface, "register", _make_register)


def _make_register(original: Any) -> Any:
    # A classmethod from the class's own __dict__, or the inherited one bound to the class.
    func = getattr(original, "__func__", original)

    @functools.wraps(func)
    def register(cls: Any, key: str, value: Any) -> Any:
        result = func(cls, key, value)
        try:
            mapping = getattr(cls, "_global_mapping", None)
            if isinstance(mapping, dict) and mapping.get(key) is value:
                _guard_entry(mapping, key)
        except Exception as exc:  # never break a registration
            from ..patching import report_internal_error

            report_internal_error("transformers.AttentionInterface.register", exc)
        return result

    return classmethod(register)


def unpatch() -> None:
    """Restore every original entry that still holds our wrapper; unwrap ``register``."""
    ledger.unpatch_all()
    callguard.reset_latches()
