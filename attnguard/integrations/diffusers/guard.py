"""Patching and unpatching the diffusers integration (what :mod:`attnguard.runtime` calls when
``diffusers.models.attention_dispatch`` is imported, and on deactivation)."""

from __future__ import annotations

from types import ModuleType

from . import backends, calls, hub, shape


def patch(module: ModuleType) -> None:
    """Guard diffusers' attention dispatcher (``module`` is its ``attention_dispatch``)."""
    why = shape.unrecognised(module)
    if why is not None:
        shape.report_unrecognised(why)
        return
    backends.patch(module)
    hub.patch(module)
    calls.patch(module)


def unpatch() -> None:
    """Restore everything this integration replaced."""
    calls.unpatch()
    hub.unpatch()
    backends.unpatch()
