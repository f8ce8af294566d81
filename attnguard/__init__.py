"""attnguard: keeps attention backends in PyTorch / transformers from crashing or slowing jobs.

``import attnguard`` activates the guard with settings from ATTNGUARD_* variables (under the
``ATTNGUARD=1`` start-up hook: when the program first imports a library to guard or uses this
API, see :mod:`attnguard._bootstrap`). Public API:
:func:`activate`, :func:`deactivate`, :func:`configure`, :func:`guard_model`, :func:`settings`,
:func:`finish` (the exit summary now, before your program shuts its logging down),
:class:`AttnGuardError`, :class:`Settings`.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

    from ._settings import Settings
    from .errors import AttnGuardError
    from .runtime import activate, configure, deactivate, finish, is_active, settings

__version__ = "0.2.0"

__all__ = [
    "AttnGuardError",
    "Settings",
    "activate",
    "configure",
    "deactivate",
    "finish",
    "guard_model",
    "is_active",
    "settings",
]


def guard_model(model: Any) -> Any:
    """Check and fix a model built directly with ``Model(config)``; returns the model."""
    from ._bootstrap import activate_pending
    from .integrations.transformers.built import guard_built_model

    activate_pending()
    return guard_built_model(model)


def __getattr__(name: str) -> Any:
    """The rest of the API, imported at first use: in the start-up hook ``import attnguard``
    stays light until the program imports a library to guard or uses this API, which then
    activates attnguard first (:mod:`attnguard._bootstrap`)."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    from ._bootstrap import activate_pending

    activate_pending()
    home = {"Settings": "._settings", "AttnGuardError": ".errors"}.get(name, ".runtime")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value
    return value


def _activate_on_import() -> None:
    from ._bootstrap import activate_from_env

    activate_from_env()


_activate_on_import()
