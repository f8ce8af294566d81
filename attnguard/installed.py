"""Which version of an installed package runs in this process (nothing heavy is imported)."""

from __future__ import annotations

import sys


def imported_version(module: str, dist: str) -> str | None:
    """The version of an imported package: its ``__version__`` (what really runs, no metadata
    scan), else the distribution's metadata; None when neither says."""
    version = getattr(sys.modules.get(module), "__version__", None)
    if version is not None:
        return str(version)
    from importlib import metadata

    try:
        return metadata.version(dist)
    except Exception:
        return None
