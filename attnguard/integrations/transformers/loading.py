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

Plain wrappers (``functools.wraps``) of the descriptors found in ``PreTrainedModel.__dict__``,
of the same kind: a classmethod stays a classmethod (subclasses bind to themselves, ``super()``
works, and ``LlamaForCausalLM.from_pretrained`` is a real bound method that pickles as
``getattr(LlamaForCausalLM, "from_pretrained")``), an instance method stays a function. No wrapt
proxies here: they cannot be pickled. The bodies live in :mod:`.apply` (loads) and :mod:`.gates` (backend gates) and are called
``body(wrapped, cls_or_self, args, kwargs)`` with ``wrapped`` already bound.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from types import MethodType, ModuleType
from typing import Any

from ...failopen import report_internal_error
from ..ledger import Ledger
from . import apply, gates

ledger = Ledger("transformers_loading")

Body = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]

# attribute -> wrapper body, patched where PreTrainedModel has the attribute
_TARGETS: tuple[tuple[str, Body], ...] = (
    ("from_pretrained", apply.guarded_from_pretrained),
    ("_from_config", apply.guarded_from_config),
    ("_autoset_attn_implementation", gates.guarded_autoset),  # transformers <= 4.53
    ("_check_and_adjust_attn_implementation", gates.guarded_check_and_adjust),  # >= 4.54
    ("set_attn_implementation", gates.guarded_set_attn_implementation),  # >= 4.54
    # transformers' flash-attn availability checks: passed under a flash-on-SDPA-twins decision
    ("_check_and_enable_flash_attn_2", gates.guarded_flash_check),  # <= 4.53
    ("_flash_attn_2_can_dispatch", gates.guarded_flash_check),  # 4.54 - 5.4
    ("_flash_attn_3_can_dispatch", gates.guarded_flash_check),  # 4.54 - 5.4
    ("_flash_attn_can_dispatch", gates.guarded_flash_check),  # >= 5.5
)


def wrap_method(original: Any, body: Body) -> Any:
    """A wrapper of the same descriptor kind as ``original`` (a classmethod or a function)."""
    if isinstance(original, classmethod):
        func = original.__func__

        @functools.wraps(func)
        def guarded_classmethod(cls: Any, *args: Any, **kwargs: Any) -> Any:
            return body(MethodType(func, cls), cls, args, kwargs)

        return classmethod(guarded_classmethod)
    if inspect.isfunction(original):

        @functools.wraps(original)
        def guarded_method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return body(MethodType(original, self), self, args, kwargs)

        return guarded_method
    raise TypeError(f"cannot wrap a {type(original).__name__}")


def patch(module: ModuleType) -> None:
    """Wrap the loading entry points of ``module.PreTrainedModel``."""
    owner = getattr(module, "PreTrainedModel", None)
    if owner is None:
        return
    for attr, body in _TARGETS:
        if attr not in vars(owner):
            continue
        try:
            ledger.patch(owner, attr, lambda original, _b=body: wrap_method(original, _b))
        except Exception as exc:  # an unexpected descriptor: leave that one unguarded
            report_internal_error(f"transformers.PreTrainedModel.{attr}.patch", exc)


def unpatch() -> None:
    """Restore every original this integration replaced."""
    ledger.unpatch_all()
