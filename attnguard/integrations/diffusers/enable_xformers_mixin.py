"""The second part of :mod:`.enable_xformers`: ``AttentionModuleMixin`` (patched when
``diffusers.models.attention`` is imported)."""

from __future__ import annotations

from types import ModuleType

from . import enable_xformers


def patch(module: ModuleType) -> None:
    enable_xformers.patch_mixin(module)


def unpatch() -> None:
    enable_xformers.unpatch_mixin()
