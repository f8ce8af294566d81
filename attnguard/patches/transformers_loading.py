"""Load-time guard: ``from_pretrained``, ``_from_config``, the backend gate and
``set_attn_implementation`` of ``transformers.PreTrainedModel``.

Every path that builds or re-configures a model goes through one of these:

* ``from_pretrained`` and ``_from_config`` (``AutoModel.from_config``): the whole request is seen
  here, so backend, load dtype, placement and the multi-GPU device_map are planned here and
  injected as load kwargs before any weight loads;
* the backend gate, called from every ``PreTrainedModel.__init__`` (``Model(config)``, inner
  sub-models of VLMs): ``_autoset_attn_implementation`` up to 4.53,
  ``_check_and_adjust_attn_implementation`` from 4.54 (also reached by
  ``set_attn_implementation``). Only the backend is decided there;
* ``set_attn_implementation`` (4.54+): a dict request reaches sub-models without the gate.

wrapt FunctionWrappers on the descriptors found in ``PreTrainedModel.__dict__`` (a classmethod
stays a classmethod, so subclasses bind to themselves); the bodies live in
:mod:`attnguard.remedies`.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import wrapt

from .. import remedies
from ..patching import Ledger

ledger = Ledger("transformers_loading")

# attribute -> wrapper body, patched where PreTrainedModel has the attribute
_TARGETS = (
    ("from_pretrained", remedies.guarded_from_pretrained),
    ("_from_config", remedies.guarded_from_config),
    ("_autoset_attn_implementation", remedies.guarded_autoset),  # transformers <= 4.53
    ("_check_and_adjust_attn_implementation", remedies.guarded_check_and_adjust),  # >= 4.54
    ("set_attn_implementation", remedies.guarded_set_attn_implementation),  # >= 4.54
)


def _wrapper(body: Any) -> Any:
    def make(original: Any) -> Any:
        return wrapt.FunctionWrapper(original, body)

    return make


def patch(module: ModuleType) -> None:
    """Wrap the loading entry points of ``module.PreTrainedModel``."""
    owner = getattr(module, "PreTrainedModel", None)
    if owner is None:
        return
    for attr, body in _TARGETS:
        if attr in vars(owner):
            ledger.patch(owner, attr, _wrapper(body))


def unpatch() -> None:
    """Restore every original this integration replaced."""
    ledger.unpatch_all()
