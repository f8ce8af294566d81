"""The flash-attn integration: its entry points guarded (:mod:`.entries`). Light until patched."""

from __future__ import annotations

from ..protocol import LibraryIntegration, Part

INTEGRATION = LibraryIntegration(
    name="flash_attn",
    distribution="flash-attn",
    package="flash_attn",
    low=(2, 6),
    high=(3,),
    parts=(Part(module="attnguard.integrations.flash_attn.entries", trigger="flash_attn"),),
)
