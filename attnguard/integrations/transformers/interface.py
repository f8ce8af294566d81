"""Where this transformers release keeps its attention registry (``ALL_ATTENTION_FUNCTIONS``)."""

from __future__ import annotations

from types import ModuleType
from typing import Any


def registry_mapping(modeling_utils: ModuleType) -> dict[str, Any] | None:
    """The dict that holds the registry's functions in this transformers version."""
    interface = getattr(modeling_utils, "AttentionInterface", None)
    mapping = getattr(interface, "_global_mapping", None)
    if isinstance(mapping, dict):
        return mapping
    funcs = getattr(modeling_utils, "ALL_ATTENTION_FUNCTIONS", None)
    return funcs if isinstance(funcs, dict) else None
