"""attnguard: keeps attention backends in PyTorch / transformers from crashing or slowing jobs.

``import attnguard`` activates the guard with settings from ATTNGUARD_* variables. Public API:
:func:`activate`, :func:`deactivate`, :func:`configure`, :func:`guard_model`, :func:`settings`,
:class:`AttnGuardError`, :class:`Settings`.
"""

from __future__ import annotations

from typing import Any

from .config import Settings
from .errors import AttnGuardError
from .runtime import activate, configure, deactivate, is_active, settings

__version__ = "0.1.0"

__all__ = [
    "AttnGuardError",
    "Settings",
    "activate",
    "configure",
    "deactivate",
    "guard_model",
    "is_active",
    "settings",
]


def guard_model(model: Any) -> Any:
    """Check and fix a model built directly with ``Model(config)``; returns the model."""
    from .remedies import guard_built_model

    return guard_built_model(model)


def _activate_on_import() -> None:
    from ._bootstrap import activate_from_env

    activate_from_env()


_activate_on_import()
