"""What a load asks for, read from transformers' arguments, configs and built models: the
:class:`~attnguard.plan.LoadRequest` the pure planner decides on (backend, dtype, device_map,
what the model class supports, how transformers routes its flash request).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Any

from packaging.version import Version

from ... import facts as facts_mod
from ... import runtime
from ...facts import Facts
from ...plan import LoadRequest, dtype_name, is_flash
from ...plan.device_map import spreads_over_ranks

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


def _dtype_label(value: Any) -> str | None:
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
        return _dtype_label(value)
    raw = vars(config)
    value = raw.get("dtype")
    if value is None:
        value = raw.get("torch_dtype")  # 4.4x attribute; 4.5x+ keeps it as a warning property
    return _dtype_label(value)


def is_config(obj: Any) -> bool:
    return hasattr(obj, "to_dict") and hasattr(obj, "sub_configs")


def sub_configs(config: Any) -> dict[str, Any]:
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
        k: getattr(c, "_attn_implementation_internal", None) for k, c in sub_configs(config).items()
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


def support_fields(cls: type, attn: Any) -> dict[str, Any]:
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
    hub_kernel = _hub_route(cls, attn) if flash else ""
    if hub_kernel:  # transformers loads a hub kernel for it: tried as without attnguard
        fields["hub_kernel"] = hub_kernel
    elif flash and _flash_kernel_unusable(attn):
        values = attn.values() if isinstance(attn, Mapping) else [attn]
        request = next((v for v in values if is_flash(v)), None)  # the family's twins serve it
        why = flash_path.unrecognised(request)
        fields["flash_path_unrecognised"] = why
        fields["flash_path_on_twins"] = not why and flash_path.covers(cls, request)
        fields.update(_routing_fields(cls, attn) if not why else {})
    return fields


def _hub_route(cls: type, attn: Any) -> str:
    """The hub kernel transformers loads for the flash request in ``attn`` ("" = none)."""
    from . import hub

    values = attn.values() if isinstance(attn, Mapping) else [attn]
    return next((r for v in values if is_flash(v) and (r := hub.route(cls, v))), "")


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


def load_request(
    cls: type, args: tuple[Any, ...], kwargs: Mapping[str, Any], facts: Facts
) -> LoadRequest:
    """The request of ``cls.from_pretrained(*args, **kwargs)``."""
    config = kwargs.get("config")
    config_obj = config if is_config(config) else None
    attn = kwargs.get("attn_implementation")
    if attn is None and kwargs.get("use_flash_attention_2"):
        attn = "flash_attention_2"
    if attn is None and config_obj is not None:
        attn = config_attn(config_obj)
    tf5 = transformers_version() >= Version("5.0.0.dev0")
    placement = None
    if kwargs.get("tp_plan") is not None or kwargs.get("device_mesh") is not None:
        placement = "tp_plan"
    dtype = _dtype_label(_requested_dtype(kwargs))
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
        **support_fields(cls, attn),
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
        from ...plan.device_map import estimate_model_bytes

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
    requested = _dtype_label(_requested_dtype(kwargs))
    return LoadRequest(
        model=cls.__name__,
        site=SITE_FROM_CONFIG,
        attn_implementation=attn,
        dtype=requested if requested is not None else _config_dtype(config),
        dtype_explicit=_explicit(requested),
        default_dtype=_default_dtype(),
        quantized=facts_mod.is_quantized_load(kwargs, config),
        **support_fields(cls, attn),
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
        **support_fields(type(model), config_attn(model.config)),
    )
