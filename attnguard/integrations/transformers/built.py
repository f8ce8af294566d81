"""A model built directly (``Model(config)``, :func:`attnguard.guard_model`): its backend
switched, its dtype cast or its device moved where that is safe, after the same plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ... import facts as facts_mod
from ... import runtime
from ...failopen import report_internal_error
from ...plan import plan_backend, plan_load
from .apply import (
    active_settings,
    all_configs,
    dtype_named,
    keep_fp32_patterns,
    on_twins,
    report,
    safe_to_move,
    verify,
)
from .requests import SITE_INIT, model_request, model_state, sub_configs
from .scope import ON_TWINS, Scope, scoped


def _switch_backend(model: Any, attn: Any) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(attn)
        return
    # transformers <= 4.53: the config is read at every forward (registry models)
    configs = all_configs(model)
    if isinstance(attn, Mapping):
        top = attn.get("")
        if top is not None:
            model.config._attn_implementation = top
        for key, sub in sub_configs(model.config).items():
            if key in attn and attn[key] is not None:
                sub._attn_implementation = attn[key]
        return
    for cfg in configs:
        cfg._attn_implementation = attn


def _cast(model: Any, dtype: str) -> None:
    """Cast, then put the modules transformers keeps in fp32 back to fp32."""
    import torch

    model.to(dtype_named(dtype))
    keep = keep_fp32_patterns(model)
    if keep:
        for name, module in model.named_modules():
            if name and any(k in name.split(".") or name.endswith(k) for k in keep):
                module.to(torch.float32)
    if hasattr(model.config, "dtype") or "dtype" in vars(model.config):
        try:
            model.config.dtype = dtype_named(dtype)
        except Exception:
            pass


def guard_built_model(model: Any) -> Any:
    """Check and fix a model built with ``Model(config)``: backend, dtype, device."""
    settings = active_settings()
    if settings is None:
        return model
    try:
        state = model_state(model)
        facts = facts_mod.current(runtime.settings())
        if state["sharded"]:
            facts = replace(facts, init=replace(facts.init, zero3=True))
        request = model_request(model, state)
        plan = plan_load(request, facts, settings)
        if model in ON_TWINS:  # its backend was decided and reported when it was built
            reported = plan_backend(request, facts, settings).actions
            plan = replace(plan, actions=tuple(a for a in plan.actions if a not in reported))
        error = report(plan, settings, SITE_INIT)
    except Exception as exc:
        report_internal_error(SITE_INIT, exc)
        return model
    if error is not None:
        raise error
    if not (plan.changes and settings.changes_things):
        return model
    try:
        scope = Scope(
            site=SITE_INIT,
            model=type(model).__name__,
            backend_decided=True,
            twins=on_twins(plan, settings),
        )
        with scoped(scope):
            if plan.backend_changed:
                _switch_backend(model, plan.attn_implementation)
            if plan.dtype is not None and safe_to_move(model):
                _cast(model, plan.dtype)
            if plan.device is not None and safe_to_move(model):
                model.to(plan.device)
        verify(model, plan, SITE_INIT)
    except Exception as exc:
        report_internal_error(SITE_INIT, exc)
    return model
