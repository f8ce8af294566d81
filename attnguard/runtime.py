"""Activation state: settings in force, which integrations are patched, post-import hooks.

Patches land as soon as their library is imported (wrapt post-import hooks), so
``from flash_attn import flash_attn_func`` in user code binds the guarded function when attnguard
was activated first. Hooks cannot be unregistered; after :func:`deactivate` they do nothing.
"""

from __future__ import annotations

import importlib
import sys
import threading
from typing import Any

from . import events
from .config import Settings, load

_lock = threading.RLock()
_settings = Settings(enabled=False)
_active = False
_hooks_registered: set[str] = set()
_patched: set[str] = set()
_overrides: dict[str, Any] = {}


def settings() -> Settings:
    """The settings in force (enabled=False when not active)."""
    return _settings


def is_active() -> bool:
    return _active


def _patch_module(name: str) -> Any:
    from .patches import INTEGRATIONS

    return importlib.import_module(INTEGRATIONS[name][0])


def integrations() -> dict[str, Any]:
    """integration name -> its patch module (importing these imports torch)."""
    from .patches import INTEGRATIONS

    return {name: _patch_module(name) for name in INTEGRATIONS}


def _on_import(name: str, module: Any) -> None:
    """Post-import hook body: patch ``name`` if we are active and it is allowed. Never raises."""
    with _lock:
        if not _active or not _settings.allows(name) or name in _patched:
            return
        try:
            _patch_module(name).patch(module)
            _patched.add(name)
        except Exception as exc:
            from .patching import report_internal_error

            report_internal_error(f"{name}.patch", exc)


def _register_hooks() -> None:
    import wrapt

    from .patches import INTEGRATIONS

    for name, (_, target) in INTEGRATIONS.items():
        if name in _hooks_registered:
            if target in sys.modules:  # hooks already fired once; re-patch what is there now
                _on_import(name, sys.modules[target])
            continue
        _hooks_registered.add(name)
        # Fires immediately when the module is already imported.
        wrapt.register_post_import_hook(lambda mod, _n=name: _on_import(_n, mod), target)


def versions() -> dict[str, str | None]:
    """Versions of the stack, from package metadata (nothing heavy is imported)."""
    import platform
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("attnguard", "torch", "transformers", "flash-attn", "xformers", "accelerate"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def activate(**overrides: Any) -> Settings:
    """Switch the guard on with ATTNGUARD_* settings plus ``overrides``; idempotent.

    Raises ValueError (naming the setting, the value and the valid values) on bad input.
    """
    global _settings, _active, _overrides
    new = load(overrides=overrides)
    with _lock:
        _overrides = dict(overrides)
        if _active and new == _settings:
            return _settings
        if _active:
            deactivate()
        _settings = new
        events.configure_sinks(new)
        if not new.enabled:
            return new
        _active = True
        events.register_exit_summary()
        events.emit(
            "activated",
            site="attnguard",
            reason_code="activated",
            reason=f"attnguard active in {new.mode} mode",
            versions=versions(),
            settings=new.as_dict(),
        )
        _register_hooks()
        return new


def deactivate() -> None:
    """Undo every patch (originals restored by identity); hooks stay registered but inert."""
    global _active, _settings
    with _lock:
        for name in list(_patched):
            try:
                _patch_module(name).unpatch()
            except Exception as exc:
                from .patching import report_internal_error

                report_internal_error(f"{name}.unpatch", exc)
        _patched.clear()
        _active = False
        _settings = Settings(enabled=False, mode=_settings.mode)
        # Flush and close a log file now; nothing is emitted while inactive (no exit summary).
        events.configure_sinks(_settings)


def configure(**changes: Any) -> Settings:
    """Change some settings, keeping earlier overrides, and (re)activate with the result."""
    return activate(**{**_overrides, **changes})


def patched_integrations() -> frozenset[str]:
    return frozenset(_patched)
