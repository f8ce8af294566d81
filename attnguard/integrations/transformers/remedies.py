"""Apply load-time plans to transformers: the bodies of the loading wrappers and ``guard_model``.

Every entry point here follows the same shape:

1. read the request (kwargs / config / built model) and the facts, call the pure planner;
2. report the plan as events (``applied`` says whether fix mode changed something);
3. strict mode: raise :class:`AttnGuardError` before any weight loads; warn mode: change
   nothing; fix mode: inject the load kwargs (backend, dtype, device_map) or, for a built model,
   switch backend / cast / move it where that is safe;
4. after loading, check the real model against the plan (``plan_mismatch`` when it differs).

Fail-open: an error in steps 1, 2 or 4 is reported once as ``internal_error`` and the original
call runs unchanged; a load that fails with our kwargs is retried once with the caller's own.
"""

from __future__ import annotations

import contextvars
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from packaging.version import Version

from ... import facts as facts_mod
from ... import runtime
from ...config import Settings
from ...errors import AttnGuardError
from ...facts import Facts, _canonical
from ...failopen import report_internal_error
from ...multigpu import spreads_over_ranks
from ...observability import events
from ...plan import Action, LoadRequest, Plan, dtype_name, is_flash, plan_backend, plan_load

SITE_LOAD = "transformers.load"
SITE_FROM_CONFIG = "transformers.from_config"
SITE_INIT = "transformers.init"
SITE_SET_ATTN = "transformers.set_attn_implementation"

_HUB_KWARGS = (
    "cache_dir",
    "force_download",
    "proxies",
    "token",
    "use_auth_token",
    "revision",
    "local_files_only",
    "subfolder",
)


@dataclass
class Scope:
    """The outermost guarded call in progress: nested loads and the backend gate inside it
    leave decisions to it (one decision, one event per load)."""

    site: str
    model: str
    backend_decided: bool
    twins: bool = False  # the decided backend is flash's code path on the SDPA twins


_SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar(
    "attnguard_scope", default=None
)


@contextmanager
def _scoped(scope: Scope | None) -> Iterator[None]:
    token = _SCOPE.set(scope)
    try:
        yield
    finally:
        _SCOPE.reset(token)


# Models whose backend attnguard decided and reported as flash's code path on the SDPA twins (at
# their own gate in ``Model(config)``, or by their load): the sub-models their ``__init__`` builds
# next (``LlamaModel`` inside ``LlamaForCausalLM``, each with its own gate) and ``guard_model()``
# on them reuse that decision instead of reporting it again. One model, one occurrence.
_ON_TWINS: weakref.WeakKeyDictionary[Any, Scope] = weakref.WeakKeyDictionary()


def _remember_twins(model: Any, site: str) -> None:
    if model is not None:
        _ON_TWINS[model] = Scope(site, type(model).__name__, True, True)


def _models_being_built(max_depth: int = 64) -> list[Any]:
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


def _enclosing_decision() -> Scope | None:
    """The decision of the load in progress, else that of a model under construction around
    this gate (its own gate already decided the backend on the twins)."""
    scope = _SCOPE.get()
    if scope is not None:
        return scope
    for model in _models_being_built():
        decided = _ON_TWINS.get(model)
        if decided is not None:
            return decided
    return None


# --- small readers -------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def transformers_version() -> Version:
    try:
        import transformers

        return Version(transformers.__version__)
    except Exception:
        return Version("0")


def dtype_kwarg(kwargs: Mapping[str, Any]) -> str:
    """The load-dtype keyword: ``torch_dtype`` before 4.56, ``dtype`` after (the caller's own
    spelling is kept when they used the old one)."""
    if transformers_version() < Version("4.56.0.dev0"):
        return "torch_dtype"
    if "torch_dtype" in kwargs and kwargs.get("dtype") is None:
        return "torch_dtype"
    return "dtype"


def _requested_dtype(kwargs: Mapping[str, Any]) -> Any:
    value = kwargs.get("dtype")
    return value if value is not None else kwargs.get("torch_dtype")


def _name(value: Any) -> str | None:
    """dtype name, or "per-module" for a dict of dtypes (5.x): never planned on."""
    if isinstance(value, Mapping):
        return "per-module"
    return dtype_name(value)


def _config_dtype(config: Any) -> str | None:
    if config is None:
        return None
    if isinstance(config, Mapping):
        value = config.get("dtype") or config.get("torch_dtype")
        if value is None and isinstance(config.get("text_config"), Mapping):
            value = config["text_config"].get("dtype") or config["text_config"].get("torch_dtype")
        return _name(value)
    raw = vars(config)
    value = raw.get("dtype")
    if value is None:
        value = raw.get("torch_dtype")  # 4.4x attribute; 4.5x+ keeps it as a warning property
    return _name(value)


def _is_config(obj: Any) -> bool:
    return hasattr(obj, "to_dict") and hasattr(obj, "sub_configs")


def _sub_configs(config: Any) -> dict[str, Any]:
    out = {}
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and not isinstance(sub, Mapping):
            out[key] = sub
    return out


def config_attn(config: Any) -> str | dict[str, Any] | None:
    """What a config object requests: a backend name, or {"" and sub-config key: backend} when
    its sub-configs differ (4.5x+ spreads a dict request over the sub-configs)."""
    top = getattr(config, "_attn_implementation_internal", None)
    if isinstance(top, Mapping):
        return dict(top)
    subs = {
        k: getattr(c, "_attn_implementation_internal", None)
        for k, c in _sub_configs(config).items()
    }
    differing = {k: v for k, v in subs.items() if v is not None and v != top}
    if not differing:
        return top
    return {"": top, **differing}


def _supports_flash(cls: type) -> bool:
    for attr in ("_supports_flash_attn", "_supports_flash_attn_2"):
        value = getattr(cls, attr, None)
        if value is not None:
            return bool(value)
    return True


def _supports(cls: type, attr: str) -> bool:
    value = getattr(cls, attr, None)
    return True if value is None else bool(value)


def _support_fields(cls: type, attn: Any) -> dict[str, Any]:
    """What the model class supports, as LoadRequest fields; for a flash request whose kernel
    cannot run here, whether transformers' flash path can be kept on the twins (the first such
    request in a process reads and checks that path: :mod:`.flash_path`)."""
    from . import flash_path

    flash = _supports_flash(cls)
    fields = {
        "supports_flash": flash,
        "supports_sdpa": _supports(cls, "_supports_sdpa"),
        "supports_flex": _supports(cls, "_supports_flex_attn"),
    }
    if flash and _flash_kernel_unusable(attn):
        why = flash_path.unrecognised()
        fields["flash_path_unrecognised"] = why
        fields["flash_path_on_twins"] = not why and flash_path.covers(cls)
        fields.update(_routing_fields(cls, attn) if not why else {})
    return fields


def _routing_fields(cls: type, attn: Any) -> dict[str, Any]:
    """Where transformers would send this model's flash request instead, and what its attention
    passes that the twins do not compute (:mod:`.routing`)."""
    from . import arguments, routing

    values = attn.values() if isinstance(attn, Mapping) else [attn]
    routed = next((r for v in values if is_flash(v) and (r := routing.routed_to(cls, v))), None)
    if routed is None:
        return {}
    computed = arguments.computed_arguments()
    missed = routing.uncomputed_keywords(cls, computed)
    return {"flash_routed_to": routed, "flash_uncomputed": tuple(missed)}


def _flash_kernel_unusable(attn: Any) -> bool:
    values = attn.values() if isinstance(attn, Mapping) else [attn]
    flash = [v for v in values if is_flash(v)]
    if not flash:
        return False
    facts = facts_mod.current(runtime.settings())
    return any(not facts.backend(v).usable for v in flash)


def _explicit(dtype: str | None) -> bool:
    """A concrete dtype the caller chose ("auto" means the checkpoint's: not a choice)."""
    return dtype is not None and dtype != "auto"


def _default_dtype() -> str:
    import torch

    return dtype_name(torch.get_default_dtype()) or "float32"


def _needs_checkpoint_facts(request: LoadRequest, facts: Facts) -> bool:
    """The checkpoint's dtype, size and quantization matter only where flash attention is asked
    for on a CUDA machine (they decide the cast and the placement)."""
    attn = request.attn_implementation
    values = attn.values() if isinstance(attn, Mapping) else [attn]
    return any(is_flash(v) for v in values) and facts.cuda


def _config_dict(path: Any, kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's config.json (the file only; no model class is involved)."""
    if path is None:
        return None
    import transformers

    config_cls = getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig
    hub = {k: kwargs[k] for k in _HUB_KWARGS if k in kwargs}
    config_dict, _ = config_cls.get_config_dict(path, **hub)
    return config_dict


# --- requests ------------------------------------------------------------------------------------


def load_request(
    cls: type, args: tuple[Any, ...], kwargs: Mapping[str, Any], facts: Facts
) -> LoadRequest:
    """The request of ``cls.from_pretrained(*args, **kwargs)``."""
    config = kwargs.get("config")
    config_obj = config if _is_config(config) else None
    attn = kwargs.get("attn_implementation")
    if attn is None and kwargs.get("use_flash_attention_2"):
        attn = "flash_attention_2"
    if attn is None and config_obj is not None:
        attn = config_attn(config_obj)
    tf5 = transformers_version() >= Version("5.0.0.dev0")
    placement = None
    if kwargs.get("tp_plan") is not None or kwargs.get("device_mesh") is not None:
        placement = "tp_plan"
    dtype = _name(_requested_dtype(kwargs))
    request = LoadRequest(
        model=cls.__name__,
        site=SITE_LOAD,
        attn_implementation=attn,
        dtype=dtype,
        dtype_explicit=_explicit(dtype),
        default_dtype="auto" if tf5 else _default_dtype(),
        device_map=kwargs.get("device_map"),
        max_memory=kwargs.get("max_memory"),
        placement=placement,
        quantized=facts_mod.is_quantized_load(kwargs, config_obj),
        **_support_fields(cls, attn),
    )
    spreading = spreads_over_ranks(request.device_map, facts.launch.world_size)
    sizing = _needs_checkpoint_facts(request, facts)
    if not (sizing or spreading):
        return request
    path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    raw: Any = config_obj
    if raw is None:
        raw = _config_dict(path, kwargs)
    checkpoint_dtype = _config_dtype(raw)
    model_bytes = None
    if spreading or sizing:
        from ...multigpu import estimate_model_bytes

        obj = config_obj
        if obj is None and raw is not None:
            obj = getattr(cls, "config_class", None)
            obj = obj.from_dict(dict(raw)) if obj is not None else None
        if obj is not None:
            dtype = request.dtype if request.dtype not in (None, "auto") else checkpoint_dtype
            model_bytes = estimate_model_bytes(obj, dtype)
    return replace(
        request,
        checkpoint_dtype=checkpoint_dtype,
        quantized=request.quantized or facts_mod.is_quantized_load({}, raw),
        model_bytes=model_bytes,
    )


def from_config_request(cls: type, config: Any, kwargs: Mapping[str, Any]) -> LoadRequest:
    """The request of ``cls._from_config(config, **kwargs)`` (``AutoModel.from_config``)."""
    attn = kwargs.get("attn_implementation")
    if attn is None and kwargs.get("use_flash_attention_2"):
        attn = "flash_attention_2"
    if attn is None:
        attn = config_attn(config)
    requested = _name(_requested_dtype(kwargs))
    return LoadRequest(
        model=cls.__name__,
        site=SITE_FROM_CONFIG,
        attn_implementation=attn,
        dtype=requested if requested is not None else _config_dtype(config),
        dtype_explicit=_explicit(requested),
        default_dtype=_default_dtype(),
        quantized=facts_mod.is_quantized_load(kwargs, config),
        **_support_fields(cls, attn),
    )


def _is_sharded_param(p: Any) -> bool:
    # DeepSpeed ZeRO-3 tags its partitioned parameters; FSDP2 uses DTensor
    return hasattr(p, "ds_id") or type(p).__name__ == "DTensor" or hasattr(p, "_sharded_param")


def model_state(model: Any) -> dict[str, Any]:
    """Where a built model is: devices, dominant floating dtype, hooks, sharding."""
    devices: set[str] = set()
    dtypes: dict[str, int] = {}
    sharded = False
    for p in model.parameters():
        devices.add(str(p.device))
        if p.is_floating_point():
            name = dtype_name(p.dtype) or str(p.dtype)
            dtypes[name] = dtypes.get(name, 0) + p.numel()
        sharded = sharded or _is_sharded_param(p)
    hooked = any(hasattr(m, "_hf_hook") for m in model.modules())
    fsdp = any(
        type(m).__name__ in ("FullyShardedDataParallel", "FSDPModule") for m in model.modules()
    )
    dtype = max(dtypes, key=dtypes.__getitem__) if dtypes else None
    device = next(iter(devices)) if len(devices) == 1 else ("mixed" if devices else None)
    return {
        "devices": devices,
        "device": device,
        "dtype": dtype,
        "hooked": hooked,
        "sharded": sharded or fsdp,
    }


def model_request(model: Any, state: Mapping[str, Any]) -> LoadRequest:
    """The request of a model already built with ``Model(config)``."""
    placement = None
    if state["hooked"]:
        placement = "accelerate hooks"
    elif state["device"] == "mixed":
        placement = "a model spread over several devices"
    device = state["device"]
    if device is not None and device.startswith("meta"):
        device = "meta"
    return LoadRequest(
        model=type(model).__name__,
        site=SITE_INIT,
        attn_implementation=config_attn(model.config),
        dtype=state["dtype"],
        default_dtype=state["dtype"] or "float32",
        placement=placement,
        device=device,
        quantized=facts_mod.is_quantized_load({}, model.config)
        or bool(getattr(model, "is_quantized", False)),
        **_support_fields(type(model), config_attn(model.config)),
    )


# --- reporting -----------------------------------------------------------------------------------


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
            from . import flash_path

            flash_path.announced(action.reason_code)
    return error


def _active_settings() -> Settings | None:
    settings = runtime.settings()
    if not settings.enabled or settings.mode == "off" or not settings.allows("transformers"):
        return None
    return settings


# --- applying plans ------------------------------------------------------------------------------


def _torch_dtype(name: str) -> Any:
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
        new[key] = _torch_dtype(plan.dtype)
    if plan.device is not None:
        new["device_map"] = {"": plan.device}
    if plan.device_map is not None:
        new["device_map"] = plan.device_map
        if plan.max_memory is not None:
            new["max_memory"] = plan.max_memory
    return new


def _keep_fp32_patterns(model: Any) -> list[str]:
    out: list[str] = []
    for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict"):
        value = getattr(model, attr, None)
        if value:
            out.extend(value)
    return out


def _all_configs(model: Any) -> list[Any]:
    seen: dict[int, Any] = {}

    def add(cfg: Any) -> None:
        if cfg is not None and not isinstance(cfg, Mapping) and id(cfg) not in seen:
            seen[id(cfg)] = cfg
            for sub in _sub_configs(cfg).values():
                add(sub)

    add(getattr(model, "config", None))
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if _is_config(cfg):
            add(cfg)
    return list(seen.values())


def verify(model: Any, plan: Plan, site: str) -> list[str]:
    """Compare the built model with the plan; one ``plan_mismatch`` event lists what differs."""
    problems: list[str] = []
    if plan.replaced_backends:
        for cfg in _all_configs(model):
            impl = getattr(cfg, "_attn_implementation_internal", None)
            if isinstance(impl, str) and _canonical(impl) in plan.replaced_backends:
                problems.append(f"{type(cfg).__name__} still uses {impl}")
    if plan.dtype is not None or plan.device is not None:
        keep = _keep_fp32_patterns(model)
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
        if _on_twins(plan, settings):
            _remember_twins(model, site)
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
    with _scoped(scope):
        if new_kwargs is kwargs and not scope.twins:
            return wrapped(*args, **kwargs), False
        try:
            return wrapped(*args, **new_kwargs), new_kwargs is not kwargs
        except Exception as exc:
            if scope.twins and could_be_ours(exc, kwargs, new_kwargs):
                _twins_load_failed(scope, exc)
                retry = Scope(scope.site, scope.model, True, False)  # flash as requested
            elif new_kwargs is kwargs or not could_be_ours(exc, kwargs, new_kwargs):
                raise
            else:
                report_internal_error(f"{scope.site}.remedy", exc)
    with _scoped(retry):
        return wrapped(*args, **kwargs), False


def _twins_load_failed(scope: Scope, exc: BaseException) -> None:
    """The load on transformers' flash path with the twins failed (the model's own flash code
    needs more of flash-attn than its kernels): step aside, and say so once. The load then runs
    as it would without attnguard, and its error (transformers' own) is the caller's."""
    events.emit(  # the error's type only: its text may carry the caller's paths
        "observed",
        site=scope.site,
        reason_code="flash_model_unrunnable",
        reason=f"{scope.model} did not load on transformers' flash code path with attnguard's "
        f"SDPA twins ({type(exc).__name__}); left as is: the load runs as it would without "
        "attnguard",
        model=scope.model,
        error_type=type(exc).__name__,
    )


def guarded_from_pretrained(
    wrapped: Callable[..., Any], cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the ``PreTrainedModel.from_pretrained`` wrapper."""
    settings = _active_settings()
    if settings is None or _SCOPE.get() is not None or _inside_model_init():
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
        SITE_LOAD, getattr(cls, "__name__", "?"), _decided(plan), _on_twins(plan, settings)
    )
    result, applied = _run_load(wrapped, args, kwargs, new_kwargs, scope)
    model = result[0] if isinstance(result, tuple) else result  # output_loading_info=True
    _after_load(model, plan if applied else None, settings, SITE_LOAD)
    return result


def guarded_from_config(
    wrapped: Callable[..., Any], cls: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the ``PreTrainedModel._from_config`` wrapper (``AutoModel.from_config``)."""
    settings = _active_settings()
    if settings is None or _SCOPE.get() is not None or _inside_model_init():
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
        SITE_FROM_CONFIG, getattr(cls, "__name__", "?"), _decided(plan), _on_twins(plan, settings)
    )
    model, used = _run_load(wrapped, args, kwargs, new_kwargs, scope)
    applied = plan if used else None
    if applied is not None and applied.device is not None:
        try:
            if _safe_to_move(model):
                model.to(applied.device)
        except Exception as exc:
            report_internal_error(f"{SITE_FROM_CONFIG}.place", exc)
    _after_load(model, applied, settings, SITE_FROM_CONFIG)
    return model


def _inside_model_init() -> bool:
    """True when called from a PreTrainedModel ``__init__`` (a VLM building its sub-models with
    ``_from_config``): the outer model's own load decides dtype and device for the whole model,
    and the backend gate of each sub-model still runs."""
    return bool(_models_being_built())


def _decided(plan: Plan | None) -> bool:
    if plan is None:
        return False
    attn = plan.request.attn_implementation
    values = attn.values() if isinstance(attn, Mapping) else [attn]
    return any(is_flash(v) for v in values)


def _on_twins(plan: Plan | None, settings: Settings) -> bool:
    """The load keeps flash's code path and the SDPA twins compute its kernel calls."""
    return plan is not None and plan.kernels is not None and settings.changes_things


@dataclass(frozen=True)
class GateDecision:
    """What the backend gate does with a flash request: check ``attn`` instead (``attn`` is the
    request itself when nothing changes), and with ``twins`` skip transformers' own flash check
    (the kernel cannot run here; the SDPA twins compute the flash path's calls)."""

    attn: Any
    twins: bool = False
    error: AttnGuardError | None = None


def _gate_decision(cls: type, requested: Any, site_default: str) -> GateDecision:
    settings = _active_settings()
    if settings is None:
        return GateDecision(requested)
    scope = _enclosing_decision()
    support = _support_fields(cls, requested)
    if scope is not None and scope.backend_decided and support["supports_flash"]:
        # the outer load or model already decided (and reported) the backend
        return GateDecision(_twins_attn(requested) if scope.twins else requested, scope.twins)
    site = scope.site if scope is not None else site_default
    facts = facts_mod.current(runtime.settings())
    request = LoadRequest(model=cls.__name__, site=site, attn_implementation=requested, **support)
    plan = plan_backend(request, facts, settings)
    error = report(plan, settings, site)
    if error is not None:
        return GateDecision(requested, error=error)
    if not settings.changes_things:
        return GateDecision(requested)
    return GateDecision(plan.attn_implementation, _on_twins(plan, settings))


def _twins_attn(requested: Any) -> Any:
    """flash_attention_3/4 on the twins run flash_attention_2's path (the same functions)."""
    if isinstance(requested, Mapping):
        return {k: _twins_attn(v) for k, v in requested.items()}
    return "flash_attention_2" if is_flash(requested) and "paged" not in requested else requested


def guarded_check_and_adjust(
    wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """Body of the ``_check_and_adjust_attn_implementation`` wrapper (transformers >= 4.54):
    called from every PreTrainedModel ``__init__`` and from ``set_attn_implementation``."""
    requested = args[0] if args else kwargs.get("attn_implementation")
    if not is_flash(requested) or instance is None:
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
        _remember_twins(instance, SITE_INIT)
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
    for sub in _sub_configs(config).values():
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
        if not any(is_flash(v) for v in values):
            return wrapped(*args, **kwargs)
        decision = _gate_decision(cls, requested, SITE_INIT)
    except Exception as exc:
        report_internal_error(SITE_INIT, exc)
        return wrapped(*args, **kwargs)
    if decision.error is not None:
        raise decision.error
    new = decision.attn
    if decision.twins:
        building = _models_being_built()  # the classmethod is called from the model's __init__
        if building and isinstance(building[0], cls):
            _remember_twins(building[0], SITE_INIT)
        from . import arguments

        arguments.bind_flash_globals(cls)
        # transformers' own flash check (``_check_and_enable_flash_attn_2``) runs inside and,
        # seeing the scope, lets flash's code path stand for the SDPA twins
        with _scoped(Scope(SITE_INIT, getattr(cls, "__name__", "?"), True, True)):
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
    scope = _SCOPE.get()
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
    if instance is None or not any(is_flash(v) for v in values) or _SCOPE.get() is not None:
        return wrapped(*args, **kwargs)
    try:
        decision = _gate_decision(type(instance), requested, SITE_SET_ATTN)
    except Exception as exc:
        report_internal_error(SITE_SET_ATTN, exc)
        return wrapped(*args, **kwargs)
    if decision.error is not None:
        raise decision.error
    scope = Scope(SITE_SET_ATTN, type(instance).__name__, True, decision.twins)
    with _scoped(scope):
        return _call_with(wrapped, args, kwargs, decision.attn)


# --- models built with Model(config) -------------------------------------------------------------


def _safe_to_move(model: Any) -> bool:
    state = model_state(model)
    device = state["device"] or ""
    return not (
        state["hooked"] or state["sharded"] or device in ("mixed", "") or device.startswith("meta")
    )


def _switch_backend(model: Any, attn: Any) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter(attn)
        return
    # transformers <= 4.53: the config is read at every forward (registry models)
    configs = _all_configs(model)
    if isinstance(attn, Mapping):
        top = attn.get("")
        if top is not None:
            model.config._attn_implementation = top
        for key, sub in _sub_configs(model.config).items():
            if key in attn and attn[key] is not None:
                sub._attn_implementation = attn[key]
        return
    for cfg in configs:
        cfg._attn_implementation = attn


def _cast(model: Any, dtype: str) -> None:
    """Cast, then put the modules transformers keeps in fp32 back to fp32."""
    import torch

    model.to(_torch_dtype(dtype))
    keep = _keep_fp32_patterns(model)
    if keep:
        for name, module in model.named_modules():
            if name and any(k in name.split(".") or name.endswith(k) for k in keep):
                module.to(torch.float32)
    if hasattr(model.config, "dtype") or "dtype" in vars(model.config):
        try:
            model.config.dtype = _torch_dtype(dtype)
        except Exception:
            pass


def guard_built_model(model: Any) -> Any:
    """Check and fix a model built with ``Model(config)``: backend, dtype, device."""
    settings = _active_settings()
    if settings is None:
        return model
    try:
        state = model_state(model)
        facts = facts_mod.current(runtime.settings())
        if state["sharded"]:
            facts = replace(facts, init=replace(facts.init, zero3=True))
        request = model_request(model, state)
        plan = plan_load(request, facts, settings)
        if model in _ON_TWINS:  # its backend was decided and reported when it was built
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
        with _scoped(Scope(SITE_INIT, type(model).__name__, True, _on_twins(plan, settings))):
            if plan.backend_changed:
                _switch_backend(model, plan.attn_implementation)
            if plan.dtype is not None and _safe_to_move(model):
                _cast(model, plan.dtype)
            if plan.device is not None and _safe_to_move(model):
                model.to(plan.device)
        verify(model, plan, SITE_INIT)
    except Exception as exc:
        report_internal_error(SITE_INIT, exc)
    return model
