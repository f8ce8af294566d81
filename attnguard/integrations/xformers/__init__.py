"""The xformers integration: its entry points guarded (:mod:`.entries`). Light until patched."""

from __future__ import annotations

from ..protocol import LibraryIntegration, Part

INTEGRATION = LibraryIntegration(
    name="xformers",
    distribution="xformers",
    package="xformers",
    low=(0, 0, 27),
    high=(0, 1),
    parts=(Part(module="attnguard.integrations.xformers.entries", trigger="xformers.ops"),),
)
