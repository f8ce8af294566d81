"""Per-call guard for flash_attn direct entry points (issue: call-time guard).

Not implemented yet: patch() records nothing and changes nothing.
"""

from __future__ import annotations

from types import ModuleType

from ..patching import Ledger

TARGET_MODULE = "flash_attn"
ledger = Ledger("flash_attn")


def patch(module: ModuleType) -> None:
    """Install this integration's wrappers on ``module``."""


def unpatch() -> None:
    """Restore every original this integration replaced."""
    ledger.unpatch_all()
