"""Per-call guard for every entry of the attention registry (issue: call-time guard).

Not implemented yet: patch() records nothing and changes nothing.
"""

from __future__ import annotations

from types import ModuleType

from ..patching import Ledger

ledger = Ledger("transformers_attention")


def patch(module: ModuleType) -> None:
    """Install this integration's wrappers on ``module``."""


def unpatch() -> None:
    """Restore every original this integration replaced."""
    ledger.unpatch_all()
