"""transformers integration: model loading (load-time guard), the attention registry (per call) and
the flash code path's kernels (the SDPA twins where flash-attn's kernel cannot run).

Three parts, each with its own ledger, patched together when ``transformers.modeling_utils`` is
imported: :mod:`.transformers_loading`, :mod:`.transformers_attention` and
:mod:`.transformers_kernels`. The integration's fourth part, :mod:`.transformers_availability`,
is patched earlier, as soon as ``transformers.utils.import_utils`` exists (``patches.INTEGRATIONS``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import transformers_attention, transformers_kernels, transformers_loading


def patch(modeling_utils: ModuleType) -> None:
    transformers_loading.patch(modeling_utils)
    transformers_attention.patch(modeling_utils)
    try:
        flash_utils = importlib.import_module(transformers_kernels.MODULE)
    except ImportError:
        return
    transformers_kernels.patch(flash_utils)


def unpatch() -> None:
    transformers_kernels.unpatch()
    transformers_attention.unpatch()
    transformers_loading.unpatch()
