"""The load in progress: one decision, one event per load.

The outermost guarded call (``from_pretrained``, ``from_config``, a model's ``__init__``) opens a
:class:`Scope` (a contextvar); nested loads and the backend gate inside it leave the decision to
it. Models built under a decision that keeps the flash path on the twins are remembered, and
the model being built is found by walking the caller's frames.
"""

from __future__ import annotations

import contextvars
import sys
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass(kw_only=True)
class Scope:
    """The outermost guarded call in progress: nested loads and the backend gate inside it
    leave decisions to it (one decision, one event per load)."""

    site: str
    model: str
    backend_decided: bool
    twins: bool = False  # the decided backend is flash's code path on the SDPA twins


CURRENT_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "attnguard_scope", default=None
)


@contextmanager
def scoped(scope: Scope | None) -> Iterator[None]:
    token = CURRENT_SCOPE.set(scope)
    try:
        yield
    finally:
        CURRENT_SCOPE.reset(token)


# Models whose backend attnguard decided and reported as flash's code path on the SDPA twins (at
# their own gate in ``Model(config)``, or by their load): the sub-models their ``__init__`` builds
# next (``LlamaModel`` inside ``LlamaForCausalLM``, each with its own gate) and ``guard_model()``
# on them reuse that decision instead of reporting it again. One model, one occurrence.
ON_TWINS: weakref.WeakKeyDictionary[Any, Scope] = weakref.WeakKeyDictionary()


def remember_twins(model: Any, site: str) -> None:
    if model is not None:
        ON_TWINS[model] = Scope(
            site=site, model=type(model).__name__, backend_decided=True, twins=True
        )


def models_being_built(max_depth: int = 64) -> list[Any]:
    """The PreTrainedModel instances whose ``__init__`` is running on this thread, innermost
    first (a VLM's sub-model inside the VLM, ``LlamaModel`` inside ``LlamaForCausalLM``)."""
    found: list[Any] = []
    frame = sys._getframe(1)
    depth = 0
    while frame is not None and depth < max_depth:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if _is_pretrained_model(owner) and all(owner is not f for f in found):
                found.append(owner)
        frame = frame.f_back
        depth += 1
    return found


def _is_pretrained_model(obj: Any) -> bool:
    cls = type(obj)
    return hasattr(cls, "_check_and_adjust_attn_implementation") or hasattr(
        cls, "_autoset_attn_implementation"
    )


def enclosing_decision() -> Scope | None:
    """The decision of the load in progress, else that of a model under construction around
    this gate (its own gate already decided the backend on the twins)."""
    scope = CURRENT_SCOPE.get()
    if scope is not None:
        return scope
    for model in models_being_built():
        decided = ON_TWINS.get(model)
        if decided is not None:
            return decided
    return None


def inside_model_init() -> bool:
    """True when called from a PreTrainedModel ``__init__`` (a VLM building its sub-models with
    ``_from_config``): the outer model's own load decides dtype and device for the whole model,
    and the backend gate of each sub-model still runs."""
    return bool(models_being_built())
