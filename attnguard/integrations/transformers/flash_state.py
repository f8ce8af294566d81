"""What this process knows of transformers' flash code path (its module, its wiring, the probes'
verdicts), shared by :mod:`.flash_path` (is the path kept on the twins, and how they are handed
over) and :mod:`.flash_serving` (which implementations the twins serve, and saying so)."""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Any

from ...fallback import families
from ...fallback.families import Family
from ..ledger import Ledger
from .wiring import Wiring

MODULE = "transformers.modeling_flash_attention_utils"
SITE = "transformers.flash_kernels"
FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")
FA2_REQUEST = FLASH_IMPLEMENTATIONS[0]

ledger = Ledger("transformers_kernels")


class State:
    """What this process knows about the patched module's flash path."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.module: ModuleType | None = None
        self.wiring: Wiring | None = None
        self.unrecognised = "transformers' flash code path has not been read"
        # probe.Result of flash-attn 2's twins (the wiring's check), once run
        self.probe: Any = None
        self.probes: dict[Family, Any] = {}  # probe.Result per family whose twins it was run on
        self.override = threading.local()  # the probe's recorders, on the probing thread only


state = State()


# the flash request the probe makes for each family (what transformers' path reads it by)
REQUEST_OF = {
    families.FA2: "flash_attention_2",
    families.FA3: "flash_attention_3",
    families.FA3_VLLM: "flash_attention_3",
    families.FA4: "flash_attention_4",
}


def family_of(implementation: Any) -> Family:
    """The flash-attn family whose twins stand for ``implementation``'s kernel (a
    ``flash_attention_N``, a hub kernel's name: :func:`attnguard.fallback.families.of_implementation`).
    None (4.54-4.57 pass no implementation): the one transformers itself takes, flash-attn 3 where
    its package is installed (its own ``is_flash_attn_3_available``), else flash-attn 2."""
    if implementation is None:
        check = getattr(state.module, "is_flash_attn_3_available", None)
        try:
            return families.FA3 if callable(check) and check() else families.FA2
        except Exception:
            return families.FA2
    return families.of_implementation(implementation) or families.FA2


def clear_lazy_cache(module: ModuleType, wired: Wiring) -> None:
    """Forget kernels resolved before (or, at unpatch, while) attnguard was active: the globals
    the release caches them in are emptied, so its next flash call resolves them again."""
    for name in wired.caches:
        if wired.cached_by_presence:
            vars(module).pop(name, None)
        elif getattr(module, name, None) is not None:
            setattr(module, name, None)
