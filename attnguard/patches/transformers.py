"""transformers integration: model loading (load-time guard) and the attention registry (per call).

Two halves, each with its own ledger, patched together when ``transformers.modeling_utils`` is
imported: :mod:`.transformers_loading` and :mod:`.transformers_attention`.
"""

from __future__ import annotations

from types import ModuleType

from . import transformers_attention, transformers_loading


def patch(modeling_utils: ModuleType) -> None:
    transformers_loading.patch(modeling_utils)
    transformers_attention.patch(modeling_utils)


def unpatch() -> None:
    transformers_attention.unpatch()
    transformers_loading.unpatch()
