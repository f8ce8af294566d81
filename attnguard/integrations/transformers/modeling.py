"""transformers integration: model loading (load-time guard), the attention registry (per call) and
the flash code path's kernels (the SDPA twins where flash-attn's kernel cannot run).

Four parts, each with its own ledger, patched together when ``transformers.modeling_utils`` is
imported: :mod:`.loading`, :mod:`.attention`, :mod:`.hub` (hub kernels that cannot load) and
:mod:`.flash_path`. The integration's fourth part, :mod:`.availability`,
is patched earlier, as soon as ``transformers.utils.import_utils`` exists (see the package).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from . import attention, flash_path, flash_state, hub, loading


def patch(modeling_utils: ModuleType) -> None:
    loading.patch(modeling_utils)
    attention.patch(modeling_utils)
    hub.patch()
    try:
        flash_utils = importlib.import_module(flash_state.MODULE)
    except ImportError:
        return
    flash_path.patch(flash_utils)


def unpatch() -> None:
    hub.unpatch()
    flash_path.unpatch()
    attention.unpatch()
    loading.unpatch()
