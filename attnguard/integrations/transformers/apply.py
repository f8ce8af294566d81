"""Applying a load-time plan: the bodies of the loading wrappers.

Every entry point follows the same shape:

1. read the request (kwargs / config) and the facts, call the pure planner;
2. report the plan as events (``applied`` says whether fix mode changed something);
3. strict mode: raise :class:`AttnGuardError` before any weight loads; warn mode: change
   nothing; fix mode: inject the load kwargs (backend, dtype, device_map);
4. after loading, check the real model against the plan (``plan_mismatch`` when it differs).

Fail-open: an error in steps 1, 2 or 4 is reported once as ``internal_error`` and the original
call runs unchanged; a load that fails with our kwargs and could be ours (:func:`could_be_ours`)
is retried once with the caller's own.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from ... import facts as facts_mod
from ... import runtime
from ...config import Settings
from ...errors import AttnGuardError
from ...facts import Facts, canonical_backend
from ...failopen import report_internal_error
from ...observability import events
from ...plan import Action, LoadRequest, Plan, dtype_name, is_flash, plan_load
from .requests import (
    SITE_FROM_CONFIG,
    SITE_LOAD,
    dtype_kwarg,
    from_config_request,
    is_config,
    load_request,
    model_state,
    sub_configs,
)
from .scope import CURRENT_SCOPE, Scope, inside_model_init, remember_twins, scoped


def _fields(action: Action, request: LoadRequest) -> dict[str, Any]:
    out: dict[str, Any] = {"model": request.model, "rule": action.rule}
    if action.target:
        out["target"] = action.target
    if action.event == "backend_fallback":
        out.update(requested=action.before, selected=action.after)
    elif action.event == "model_cast":
        out.update(dtype_from=action.before, dtype_to=action.after)
    elif action.event == "model_placed":
        out.update(device=action.after, device_from=action.before)
    elif action.event == "device_map_rewritten":
        out.update(before=action.before, after=action.after)
    else:
        out["requested"] = request.attn_implementation
    out.update(action.fields)
    return out


def report(plan: Plan, settings: Settings, site: str) -> AttnGuardError | None:
    """Emit one event per action; in strict mode return the error to raise (first change)."""
    apply = settings.changes_things
    error = None
    for action in plan.actions:
        fields = _fields(action, plan.request)
        if action.applies:
            fields["applied"] = apply
        events.emit(
            action.event,
            site=site,
            reason_code=action.reason_code,
            reason=action.reason(settings.mode),
            **fields,
        )
        if action.applies and settings.mode == "strict" and error is None:
            error = AttnGuardError(action.reason_code, action.problem, action.change)
        if action.rule == "flash-on-sdpa" and apply:
            from . import flash_serving

            flash_serving.announced(
                action.before, action.reason_code, action.problem, action.change
            )
    return error


def active_settings() -> Settings | None:
    settings = runtime.settings()
    if not settings.enabled or settings.mode == "off" or not settings.allows("transformers"):
        return None
    return settings


def dtype_named(name: str) -> Any:
    import torch

    return getattr(torch, name)


def load_kwargs(plan: Plan, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The caller's kwargs with the plan's changes injected (fix mode)."""
    new = dict(kwargs)
    if plan.backend_changed:
        new["attn_implementation"] = plan.attn_implementation
        new.pop("use_flash_attention_2", None)
    if plan.dtype is not None:
        key = dtype_kwarg(kwargs)
        new.pop("dtype" if key == "torch_dtype" else "torch_dtype", None)
        new[key] = dtype_named(plan.dtype)
    if plan.device is not None:
        new["device_map"] = {"": plan.device}
    if plan.device_map is not None:
        new["device_map"] = plan.device_map
        if plan.max_memory is not None:
            new["max_memory"] = plan.max_memory
    return new


def keep_fp32_patterns(model: Any) -> list[str]:
    out: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        value = getattr(model, attr, None)
        if value:
            out.extend(value)
    return out


def all_configs(model: Any) -> list[Any]:
    seen: dict[int, Any] = {}

    def add(cfg: Any) -> None:
        if cfg is not None and not isinstance(cfg, Mapping) and id(cfg) not in seen:
            seen[id(cfg)] = cfg
            for sub in sub_configs(cfg).values():
                add(sub)

    add(getattr(model, "config", None))
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if is_config(cfg):
            add(cfg)
    return list(seen.values())


def verify(model: Any, plan: Plan, site: str) -> list[str]:
    """Compare the built model with the plan; one ``plan_mismatch`` event lists what differs."""
    problems: list[str] = []
    if plan.replaced_backends:
        for cfg in all_configs(model):
            impl = getattr(cfg, "_attn_implementation_internal", None)
            if isinstance(impl, str) and canonical_backend(impl) in plan.replaced_backends:
                problems.append(f"{type(cfg).__name__} still uses {impl}")
    if plan.dtype is not None or plan.device is not None:
        keep = keep_fp32_patterns(model)
        for name, p in model.named_parameters():
            if plan.device is not None and str(p.device) != plan.device:
                problems.append(f"parameter {name} is on {p.device}, not {plan.device}")
                break
        if plan.dtype is not None:
            for name, p in model.named_parameters():
                if not p.is_floating_point() or any(k in name for k in keep):
                    continue
                if dtype_name(p.dtype) != plan.dtype:
                    problems.append(f"parameter {name} is {dtype_name(p.dtype)}, not {plan.dtype}")
                    break
    if problems:
        events.emit(
            "plan_mismatch",
            site=site,
            reason_code="plan_mismatch",
            reason="the loaded model is not what attnguard planned: " + "; ".join(problems[:5]),
            model=plan.request.model,
            problems=problems[:20],
        )
    return problems


def _after_load(model: Any, plan: Plan | None, settings: Settings, site: str) -> None:
    try:
        if plan is not None and plan.changes and settings.changes_things:
            verify(model, plan, site)
        if on_twins(plan, settings):
            remember_twins(model, site)
            from .arguments import judge_model

            judge_model(model)  # its attention classes' own arguments
        if settings.allows("align") and hasattr(model, "parameters"):
            from .rotary import install_rotary_alignment

            install_rotary_alignment(model)
    except Exception as exc:
        report_internal_error(f"{site}.verify", exc)


def _prepare(
    make_request: Callable[[Facts], LoadRequest], settings: Settings, site: str
) -> tuple[Plan | None, AttnGuardError | None]:
    """Plan and report; attnguard's own failures become internal_error and no plan."""
    try:
        facts = facts_mod.current(runtime.settings())
        plan = plan_load(make_request(facts), facts, settings)
        return plan, report(plan, settings, site)
    except Exception as exc:
        report_internal_error(site, exc)
        return None, None


def _out_of_memory(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom is not None and isinstance(exc, oom):
        return True
    return isinstance(exc, (RuntimeError, MemoryError)) and "out of memory" in str(exc).lower()


# A value shorter than this says too little to tell whose it is ("cpu", "auto", "0").
_TELLING_CHARS = 5


def _texts(value: Any, out: list[str], depth: int = 0) -> list[str]:
    """The strings a load argument is spelled with (dict keys and values, list items, paths,
    devices and dtypes by name), long enough to be recognised in an error message."""
    if depth > 4 or len(out) > 256:
        return out
    if isinstance(value, Mapping):
        for k, v in list(value.items())[:64]:
            _texts(k, out, depth + 1)
            _texts(v, out, depth + 1)
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        for v in list(value)[:64]:
            _texts(v, out, depth + 1)
        return out
    if isinstance(value, (str, int, float)) or type(value).__name__ in ("device", "dtype"):
        text = str(value).removeprefix("torch.")
    elif hasattr(value, "__fspath__"):
        text = str(value.__fspath__())
    else:
        return out
    if len(text) >= _TELLING_CHARS:
        out.append(text.lower())
    return out


def _mentions(text: str, values: list[str]) -> bool:
    return any(v in text for v in values)


def could_be_ours(exc: BaseException, kwargs: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Can the kwargs attnguard changed (``kwargs`` -> ``new``) have caused this load error?

    An out-of-memory, a missing or unreadable file (OSError), or a missing dependency of the
    caller's own arguments is the caller's: a retry would only fail again, later. An error whose
    message names a value the caller passed and attnguard left as it was (an invalid device
    string in their device_map, say), and none of the values attnguard put in, is about the
    caller's argument. An ImportError is ours only when it names what our change brought in
    (accelerate for an injected device_map, flash-attn for a backend we decided). Any other
    error may come from what we changed.
    """
    if _out_of_memory(exc):
        return False
    try:
        text = str(exc).lower()
    except Exception:
        text = ""
    changed = [k for k in new if k not in kwargs or new[k] is not kwargs[k]]
    ours: list[str] = []
    for k in changed:
        _texts(new[k], ours)
    theirs: list[str] = []
    for k, v in kwargs.items():
        if k not in changed and k in new:
            _texts(v, theirs)
    if text and not _mentions(text, ours) and _mentions(text, theirs):
        return False
    injected_map = new.get("device_map") is not None and kwargs.get("device_map") is None
    if "accelerate" in text and not injected_map:
        return False  # e.g. the caller's device_map="auto" without accelerate installed
    if isinstance(exc, ImportError):
        changed_backend = new.get("attn_implementation") != kwargs.get("attn_implementation")
        return (injected_map and "accelerate" in text) or (changed_backend and "flash" in text)
    return not isinstance(exc, OSError)


def _run_load(
    wrapped: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    new_kwargs: dict[str, Any],
    scope: Scope,
) -> tuple[Any, bool]:
    """Run the load with our kwargs -> (result, whether our kwargs were used).

    If it fails in a way our change can have caused, report it and retry once with the caller's
    own kwargs (fail-open). The caller's own errors (out of memory, a missing file, a missing
    dependency of their own arguments) propagate at once, and only once.
    """
    retry: Scope | None = None  # the gate may still fix the backend on the retry
    with scoped(scope):
        if new_kwargs is kwargs and not scope.twins:
            return wrapped(*args, **kwargs), False
        try:
            return wrapped(*args, **new_kwargs), new_kwargs is not kwargs
        except Exception as exc:
            if scope.twins and could_be_ours(exc, kwargs, new_kwargs):
                _twins_load_failed(scope, exc)
                # flash as requested
                retry = Scope(site=scope.site, model=scope.model, backend_decided=True, twins=False)
            elif new_kwargs is kwargs or not could_be_ours(exc, kwargs, new_kwargs):
                raise
            elif new_kwargs.get("attn_implementation") != kwargs.get("attn_implementation"):
                _fallback_load_failed(scope, exc, new_kwargs.get("attn_implementation"))
                # as requested: the gate must not choose the backend that failed again
                retry = Scope(site=scope.site, model=scope.model, backend_decided=True)
            else:
                report_internal_error(f"{scope.site}.remedy", exc)
    with scoped(retry):
        return wrapped(*args, **kwargs), False


def _fallback_load_failed(scope: Scope, exc: BaseException, backend: Any) -> None:
    """The load with the fallback backend attnguard chose failed (a part of the model, such as
    a vision tower, does not support that backend in this release)."""
    _stepped_aside(
        scope,
        exc,
        "fallback_model_unrunnable",
        tried=f"with the fallback backend {backend!r}",
        runs="as requested, as it would without attnguard",
    )


def _twins_load_failed(scope: Scope, exc: BaseException) -> None:
    """The load on transformers' flash path with the twins failed (the model's own flash code
    needs more of flash-attn than its kernels)."""
    _stepped_aside(
        scope,
        exc,
        "flash_model_unrunnable",
        tried="on transformers' flash code path with attnguard's SDPA twins",
        runs="as it would without attnguard",
    )


def _stepped_aside(
    scope: Scope, exc: BaseException, reason_code: str, *, tried: str, runs: str
) -> None:
    """A remedied load failed: step aside, and say so once. The load then runs without the
    remedy, and its error (transformers' own) is the caller's."""
    events.emit(  # the error's type only: its text may carry the caller's paths
        "observed",
        site=scope.site,
        reason_code=reason_code,
        reason=f"{scope.model} did not load {tried} ({type(exc).__name__}); left as is: the load "
        f"runs {runs}",
        model=scope.model,
        error_type=type(exc).__name__,
    )


def guarded_from_pretrained(
    wrapped: Callable[..., Any], cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the ``PreTrainedModel.from_pretrained`` wrapper."""
    settings = active_settings()
    if settings is None or CURRENT_SCOPE.get() is not None or inside_model_init():
        return wrapped(*args, **kwargs)
    plan, error = _prepare(lambda f: load_request(cls, args, kwargs, f), settings, SITE_LOAD)
    if error is not None:
        raise error
    new_kwargs = kwargs
    if plan is not None and plan.changes and settings.changes_things:
        try:
            new_kwargs = load_kwargs(plan, kwargs)
        except Exception as exc:
            report_internal_error(SITE_LOAD, exc)
    scope = Scope(
        site=SITE_LOAD,
        model=getattr(cls, "__name__", "?"),
        backend_decided=_decided(plan),
        twins=on_twins(plan, settings),
    )
    result, applied = _run_load(wrapped, args, kwargs, new_kwargs, scope)
    model = result[0] if isinstance(result, tuple) else result  # output_loading_info=True
    _after_load(model, plan if applied else None, settings, SITE_LOAD)
    return result


def guarded_from_config(
    wrapped: Callable[..., Any], cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the ``PreTrainedModel._from_config`` wrapper (``AutoModel.from_config``)."""
    settings = active_settings()
    if settings is None or CURRENT_SCOPE.get() is not None or inside_model_init():
        return wrapped(*args, **kwargs)
    config = args[0] if args else kwargs.get("config")
    plan, error = _prepare(
        lambda f: from_config_request(cls, config, kwargs), settings, SITE_FROM_CONFIG
    )
    if error is not None:
        raise error
    new_kwargs = kwargs
    if plan is not None and plan.changes and settings.changes_things:
        try:
            new_kwargs = load_kwargs(replace(plan, device=None), kwargs)  # placed after the build
        except Exception as exc:
            report_internal_error(SITE_FROM_CONFIG, exc)
    scope = Scope(
        site=SITE_FROM_CONFIG,
        model=getattr(cls, "__name__", "?"),
        backend_decided=_decided(plan),
        twins=on_twins(plan, settings),
    )
    model, used = _run_load(wrapped, args, kwargs, new_kwargs, scope)
    applied = plan if used else None
    if applied is not None and applied.device is not None:
        try:
            if safe_to_move(model):
                model.to(applied.device)
        except Exception as exc:
            report_internal_error(f"{SITE_FROM_CONFIG}.place", exc)
    _after_load(model, applied, settings, SITE_FROM_CONFIG)
    return model


def _decided(plan: Plan | None) -> bool:
    if plan is None:
        return False
    attn = plan.request.attn_implementation
    values = attn.values() if isinstance(attn, Mapping) else [attn]
    return any(is_flash(v) for v in values)


def on_twins(plan: Plan | None, settings: Settings) -> bool:
    """The load keeps flash's code path and the SDPA twins compute its kernel calls."""
    return plan is not None and plan.kernels is not None and settings.changes_things


def safe_to_move(model: Any) -> bool:
    state = model_state(model)
    device = state["device"] or ""
    return not (
        state["hooked"] or state["sharded"] or device in ("mixed", "") or device.startswith("meta")
    )
