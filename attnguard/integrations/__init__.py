"""The integrations: one package per patched library, each owning everything about it, listed in
one registry that the runtime walks (:mod:`attnguard.runtime`).

Each integration is an :class:`~attnguard.integrations.protocol.Integration` (name, version
window, parts) declared in its package's ``__init__``; a library is added by adding its package
and one entry in :data:`REGISTRY`, with no change to the core. Integrations import the core
(:mod:`attnguard.callguard`, :mod:`attnguard.plan`, :mod:`attnguard.fallback`, ...) and hand it
what it needs as arguments; the core imports no integration.
"""

from __future__ import annotations

from .diffusers import INTEGRATION as DIFFUSERS
from .flash_attn import INTEGRATION as FLASH_ATTN
from .protocol import Integration, LibraryIntegration, Part
from .torch_distributed import INTEGRATION as TORCH_DISTRIBUTED
from .transformers import INTEGRATION as TRANSFORMERS
from .xformers import INTEGRATION as XFORMERS

__all__ = ["REGISTRY", "Integration", "LibraryIntegration", "Part", "by_name"]

# every integration, in patch order (diffusers after flash_attn and xformers: it binds their
# guarded functions where diffusers imported the originals)
REGISTRY: tuple[Integration, ...] = (
    TRANSFORMERS,
    FLASH_ATTN,
    XFORMERS,
    DIFFUSERS,
    TORCH_DISTRIBUTED,
)


def by_name(name: str) -> Integration:
    """The integration called ``name`` (KeyError when none is)."""
    for integration in REGISTRY:
        if integration.name == name:
            return integration
    raise KeyError(name)
