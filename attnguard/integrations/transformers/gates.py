"""The backend gates of three transformers generations: where transformers checks or picks a
model's attention implementation (``_check_and_adjust_attn_implementation``, ``_autoset_attn_implementation``,
``_check_and_enable_flash_attn_2``, ``set_attn_implementation``), the plan for the backend
alone is applied, unless a load in progress decides (:mod:`.scope`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ... import facts as facts_mod
from ... import runtime
from ...errors import AttnGuardError
from ...failopen import report_internal_error
from ...plan import LoadRequest, is_flash, plan_backend
from . import flash_serving, hub, twin_calls
from .apply import active_settings, on_twins, report
from .requests import SITE_INIT, SITE_SET_ATTN, sub_configs, support_fields
from .scope import (
    CURRENT_SCOPE,
    Scope,
    enclosing_decision,
    models_being_built,
    remember_twins,
    scoped,
)


@dataclass(frozen=True)
class GateDecision:
    """What the backend gate does with a flash request: check ``attn`` instead (``attn`` is the
    request itself when nothing changes), and with ``twins`` skip transformers' own flash check
    (the kernel cannot run here; the SDPA twins compute the flash path's calls)."""

    attn: Any
    twins: bool = False
    error: AttnGuardError | None = None


def _gate_decision(cls: type, requested: Any, site_default: str) -> GateDecision:
    settings = active_settings()
    if settings is None:
        return GateDecision(requested)
    scope = enclosing_decision()
    support = support_fields(cls, requested)
    twin_calls.note_model(cls)  # what the advice may name for it (sub-models too)
    if support.get("flash_path_on_twins") or support.get("hub_kernel"):
        flash_serving.watch_masks()  # before the model's first forward builds its first mask
    if scope is not None and scope.backend_decided and support["supports_flash"]:
        # the outer load or model already decided (and reported) the backend
        # the request stays: its flash path is handed the twins of its own family
        return GateDecision(requested, scope.twins)
    site = scope.site if scope is not None else site_default
    facts = facts_mod.current(runtime.settings())
    request = LoadRequest(model=cls.__name__, site=site, attn_implementation=requested, **support)
    plan = plan_backend(request, facts, settings)
    error = report(plan, settings, site)
    if error is not None:
        return GateDecision(requested, error=error)
    if not settings.changes_things:
        return GateDecision(requested)
    return GateDecision(plan.attn_implementation, on_twins(plan, settings))


def guarded_check_and_adjust(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the ``_check_and_adjust_attn_implementation`` wrapper (transformers >= 4.54):
    called from every PreTrainedModel ``__init__`` and from ``set_attn_implementation``."""
    requested = args[0] if args else kwargs.get("attn_implementation")
    if instance is None:
        return wrapped(*args, **kwargs)
    with hub.gate(type(instance), requested):  # a hub kernel loaded inside is loaded for it
        return _check_and_adjust(wrapped, instance, requested, args, kwargs)


def _check_and_adjust(
    wrapped: Callable[..., Any],
    instance: Any,
    requested: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    if not is_flash(requested):
        return wrapped(*args, **kwargs)
    try:
        decision = _gate_decision(type(instance), requested, SITE_INIT)
    except Exception as exc:
        report_internal_error(SITE_INIT, exc)
        return wrapped(*args, **kwargs)
    if decision.error is not None:
        raise decision.error
    new = decision.attn
    if decision.twins:
        remember_twins(instance, SITE_INIT)
        # transformers' other checks for this model still run; its flash check would refuse a
        # kernel that cannot run here (or fetch one from the hub): the twins compute instead
        _call_with(wrapped, args, kwargs, "eager")
        from . import arguments, flash_path

        arguments.bind_flash_globals(type(instance))
        flash_path.preload(new)
        return new
    if new is requested:
        return wrapped(*args, **kwargs)
    try:
        _replace_in_sub_configs(getattr(instance, "config", None), requested, new)
    except Exception as exc:
        report_internal_error(SITE_INIT, exc)
    return _call_with(wrapped, args, kwargs, new)


def _call_with(
    wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], attn: Any
) -> Any:
    if args:
        return wrapped(attn, *args[1:], **kwargs)
    return wrapped(*args, **{**kwargs, "attn_implementation": attn})


def _replace_in_sub_configs(config: Any, old: str, new: str) -> None:
    """A str request was spread over every sub-config: the sub-models built next (each through
    its own gate) get the same fallback without a second decision and a second event."""
    for sub in sub_configs(config).values():
        if getattr(sub, "_attn_implementation_internal", None) == old:
            sub._attn_implementation_internal = new
        _replace_in_sub_configs(sub, old, new)


def guarded_autoset(
    wrapped: Callable[..., Any], cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the ``_autoset_attn_implementation`` wrapper (transformers <= 4.53): the request
    is on ``config._attn_implementation_internal`` (str or per-sub-config dict) or the old
    ``use_flash_attention_2=True``."""
    config = args[0] if args else kwargs.get("config")
    try:
        requested = getattr(config, "_attn_implementation_internal", None)
        use_fa2 = kwargs.get("use_flash_attention_2", args[1] if len(args) > 1 else False)
        if use_fa2 and requested is None:
            requested = "flash_attention_2"
        values = requested.values() if isinstance(requested, Mapping) else [requested]
        decision = (
            _gate_decision(cls, requested, SITE_INIT) if any(is_flash(v) for v in values) else None
        )
    except Exception as exc:
        report_internal_error(SITE_INIT, exc)
        return wrapped(*args, **kwargs)
    if decision is None:  # no flash request: transformers' own call, its errors its own
        return wrapped(*args, **kwargs)
    if decision.error is not None:
        raise decision.error
    new = decision.attn
    if decision.twins:
        building = models_being_built()  # the classmethod is called from the model's __init__
        if building and isinstance(building[0], cls):
            remember_twins(building[0], SITE_INIT)
        from . import arguments

        arguments.bind_flash_globals(cls)
        # transformers' own flash check (``_check_and_enable_flash_attn_2``) runs inside and,
        # seeing the scope, lets flash's code path stand for the SDPA twins
        scope = Scope(
            site=SITE_INIT, model=getattr(cls, "__name__", "?"), backend_decided=True, twins=True
        )
        with scoped(scope):
            return wrapped(*args, **kwargs)
    if new is requested:
        return wrapped(*args, **kwargs)
    config._attn_implementation_internal = dict(new) if isinstance(new, Mapping) else new
    if len(args) > 1:
        args = (args[0], False, *args[2:])
    if "use_flash_attention_2" in kwargs:
        kwargs = {**kwargs, "use_flash_attention_2": False}
    return wrapped(*args, **kwargs)


def guarded_flash_check(
    wrapped: Callable[..., Any], owner: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the wrappers of transformers' flash-attn availability check
    (``_check_and_enable_flash_attn_2`` up to 4.53, ``_flash_attn_2_can_dispatch`` /
    ``_flash_attn_3_can_dispatch`` from 4.54, ``_flash_attn_can_dispatch`` from 5.5). Inside a
    load or switch whose decision is flash's code path on the SDPA twins, the check passes: the
    kernel it checks for is not the one that will compute (model support was checked by the
    planner). Everywhere else transformers checks as it always does."""
    scope = CURRENT_SCOPE.get()
    if scope is None or not scope.twins:
        return wrapped(*args, **kwargs)
    if getattr(wrapped, "__name__", "") == "_check_and_enable_flash_attn_2":
        config = args[0] if args else kwargs.get("config")
        hard_check_only = kwargs.get("hard_check_only", args[4] if len(args) > 4 else False)
        if config is not None and not hard_check_only:
            config._attn_implementation = "flash_attention_2"
        return config
    return True


def guarded_set_attn_implementation(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the ``set_attn_implementation`` wrapper: a str or per-sub-config dict request on a
    built model (sub-models are checked there without going through the gate)."""
    requested = args[0] if args else kwargs.get("attn_implementation")
    values = requested.values() if isinstance(requested, Mapping) else [requested]
    if instance is None or not any(is_flash(v) for v in values) or CURRENT_SCOPE.get() is not None:
        return wrapped(*args, **kwargs)
    try:
        decision = _gate_decision(type(instance), requested, SITE_SET_ATTN)
    except Exception as exc:
        report_internal_error(SITE_SET_ATTN, exc)
        return wrapped(*args, **kwargs)
    if decision.error is not None:
        raise decision.error
    scope = Scope(
        site=SITE_SET_ATTN,
        model=type(instance).__name__,
        backend_decided=True,
        twins=decision.twins,
    )
    with scoped(scope):
        return _call_with(wrapped, args, kwargs, decision.attn)
