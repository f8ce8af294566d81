"""What attnguard knows of diffusers' attention dispatcher, and how it recognises it by shape.

Facts (diffusers 0.35 to 0.42): ``_AttentionBackendRegistry._backends`` maps each
``AttentionBackendName`` to a backend function that ``dispatch_attention_fn`` calls with keyword
arguments in the layout (batch, seq, heads, head_dim): ``query``, ``key``, ``value``,
``attn_mask``, ``dropout_p``, ``is_causal``, ``scale`` and, where the function takes them,
``enable_gqa``, ``window_size``, ``return_lse``, ``_parallel_config``. The flash and xformers
backend functions call module globals bound at import (``flash_attn_func``,
``flash_attn_varlen_func``, ``xops``), ``None`` when diffusers could not import the package; the
requirements check then raises ``RuntimeError``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from ...kernel_identity import Family
from ...observability import events


@dataclass(frozen=True)
class Twinned:
    """A backend whose package's functions attnguard has twins of."""

    package: str  # the distribution diffusers needs for it
    family: Family  # what the package's functions are
    function: str  # the package's function the twins stand for, as users know it
    kernels: tuple[str, ...]  # module globals the backend function calls: served by twins
    # module globals of that package the backend reaches only for calls the twins do not
    # compute (context parallelism): there the user's own error stands
    refused: tuple[str, ...] = ()


TWINNED: dict[str, Twinned] = {
    "flash": Twinned(
        "flash-attn",
        Family.FA2,
        "flash_attn_func",
        ("flash_attn_func",),
        ("_wrapped_flash_attn_forward", "_wrapped_flash_attn_backward"),
    ),
    "flash_varlen": Twinned(
        "flash-attn", Family.FA2, "flash_attn_varlen_func", ("flash_attn_varlen_func",)
    ),
    "xformers": Twinned(
        "xformers", Family.XFORMERS, "xformers.ops.memory_efficient_attention", ("xops",)
    ),
}

# torch's own backends: ``native`` lets SDPA choose its kernel; the others force one
NATIVE = "native"
FORCED_SDPA = ("_native_cudnn", "_native_efficient", "_native_flash", "_native_math")
# the backends whose calls the per-call guard sees (dtypes, devices, recoveries)
GUARDED = (NATIVE, *FORCED_SDPA, *TWINNED)
# the packages the other backends need, for the doctor's table
PACKAGES = {
    "flash_hub": "kernels",
    "flash_varlen_hub": "kernels",
    "flash_4_hub": "kernels",
    "_flash_3_hub": "kernels",
    "_flash_3_varlen_hub": "kernels",
    "aiter_fa2_hub": "kernels",
    "sage_hub": "kernels",
    "sage_blackwell_hub": "kernels",
    "_flash_3": "flash-attn 3",
    "_flash_varlen_3": "flash-attn 3",
    "flex": "torch>=2.5",
    "_native_npu": "torch_npu",
    "_native_xla": "torch_xla",
    **{
        b: "sageattention"
        for b in (
            "sage",
            "sage_varlen",
            "_sage_qk_int8_pv_fp8_cuda",
            "_sage_qk_int8_pv_fp8_cuda_sm90",
            "_sage_qk_int8_pv_fp16_cuda",
            "_sage_qk_int8_pv_fp16_triton",
        )
    },
    **{n: t.package for n, t in TWINNED.items()},
}
_TENSORS = ("query", "key", "value")

# The ``*_hub`` backends: ``_HUB_KERNELS_REGISTRY`` maps each to the config of the hub kernel it
# loads (``repo_id``, the kernel's function it calls, ``kernel_fn`` once loaded), loaded by
# ``_maybe_download_kernel_for_backend(backend)``; the backend function calls ``kernel_fn``.
_HUB_CONFIG = ("repo_id", "function_attr", "kernel_fn")
HUB_LOADER = "_maybe_download_kernel_for_backend"
HUB_KERNEL_READS = ("_HUB_KERNELS_REGISTRY", "kernel_fn")


def registry(module: ModuleType) -> Any:
    return getattr(module, "_AttentionBackendRegistry", None)


def backends(module: ModuleType) -> dict[str, Any]:
    """backend name (its value, e.g. ``"flash"``) -> the registry key (the enum member)."""
    held = getattr(registry(module), "_backends", None)
    if not isinstance(held, dict):
        return {}
    return {str(getattr(k, "value", k)): k for k in held}


def hub_configs(module: ModuleType) -> dict[str, Any]:
    """backend name -> the config of the hub kernel diffusers loads for it, for each config
    shaped as attnguard knows it (``{}`` where this diffusers has no hub backends)."""
    held = getattr(module, "_HUB_KERNELS_REGISTRY", None)
    if not isinstance(held, dict):
        return {}
    return {
        str(getattr(k, "value", k)): c
        for k, c in held.items()
        if all(hasattr(c, a) for a in _HUB_CONFIG) and isinstance(c.repo_id, str)
    }


def hub_loader(module: ModuleType) -> Any:
    """diffusers' loader of hub kernels, or None where it is not shaped as attnguard knows it."""
    loader = getattr(module, HUB_LOADER, None)
    return loader if callable(loader) and _takes(loader, ("backend",)) else None


def reads_names(fn: Any, names: tuple[str, ...]) -> bool:
    """True when ``fn``'s code reads every one of ``names`` (as a global or an attribute: how a
    backend function reaches its kernel)."""
    fn = getattr(fn, "__attnguard_original__", fn)  # the registry may hold our guarded entry
    code = getattr(fn, "__code__", None)
    return code is not None and all(n in code.co_names for n in names)


def _takes(fn: Any, params: tuple[str, ...]) -> bool:
    try:
        have = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return all(p in have for p in params)


def unrecognised(module: ModuleType) -> str | None:
    """Why ``module`` is not the dispatcher attnguard knows, or None: it is."""
    reg = registry(module)
    held = getattr(reg, "_backends", None)
    if not isinstance(held, dict) or not callable(getattr(reg, "get_active_backend", None)):
        return "no _AttentionBackendRegistry with a _backends dict"
    check = getattr(module, "_check_attention_backend_requirements", None)
    if not callable(check) or not _takes(check, ("backend",)):
        return "no _check_attention_backend_requirements(backend)"
    names = backends(module)
    if NATIVE not in names:
        return "no native backend in the registry"
    if not takes_qkv(held[names[NATIVE]]):
        return "the native backend function does not take query, key, value"
    return None


def takes_qkv(fn: Any) -> bool:
    """A backend function the per-call guard can read: it takes query, key and value."""
    return _takes(getattr(fn, "__attnguard_original__", fn), _TENSORS)


def forces_one_sdpa_kernel(fn: Any) -> bool:
    """The shape of diffusers' forced torch backends: one SDPA call inside ``sdpa_kernel(...)``
    (what :func:`.twins.sdpa_unforced` computes without the context)."""
    return reads_names(fn, ("sdpa_kernel", "scaled_dot_product_attention"))


def report_unrecognised(why: str) -> None:
    events.emit(
        "observed",
        site="diffusers.attention_dispatch",
        reason_code="dispatch_unrecognised",
        reason=f"diffusers' attention dispatch is not shaped as attnguard knows it ({why}): "
        "left unguarded",
    )
