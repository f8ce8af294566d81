"""The per-call guard of diffusers' backend functions (the dispatcher's registry entries).

``dispatch_attention_fn`` looks the backend function up in ``_AttentionBackendRegistry._backends``
at every call, so replacing an entry takes effect on live models. Each guarded entry is a plain
closure (:mod:`attnguard.callguard`'s, never a wrapt proxy: torch.compile) whose check runs
inline, cheapest first: q/k/v dtypes and devices, a latched site, the mask's device and dtype.
Nothing wrong -> diffusers' own function runs untouched. Something wrong -> the core's remedies:

* q/k/v of mixed dtypes (custom processors), or a float mask of another half dtype -> one dtype
  (``qkv_unified``); inputs on several devices -> the query's (``tensors_aligned``);
* a known kernel error -> the call re-run once on the backend's twin and the site sent there from
  then on (``kernel_error_recovered``, then ``backend_rerouted``): for ``native``, its own function
  with every SDPA kernel allowed (after a caller's narrower ``sdpa_kernel`` context); for a backend
  forced to one SDPA kernel (``_native_flash``, ``_native_cudnn``, ...), the same SDPA call with
  SDPA free to choose (:func:`.twins.sdpa_unforced`). A call SDPA refuses with every kernel
  allowed (a mask that does not fit, k/v heads without ``enable_gqa``) keeps its own error and
  nothing is announced: no kernel would compute it. Calls of ``_native_cudnn`` /
  ``_native_flash`` that ask for the LSE or run context-parallel take diffusers' other code path,
  which no twin computes: they run as diffusers makes them, errors included;
* flash / xformers backends, and the ``*_hub`` backends whose hub kernel is one of flash-attn's
  families: dtypes and devices only; the package kernels are guarded where they are called (the
  flash_attn and xformers integrations, or the twins of :mod:`.backends`), a hub kernel that
  loaded computes its calls untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ... import callguard, kernel_identity, runtime
from ...kernel_identity import Family
from ...kernels import EntryKind
from ...observability import events
from . import shape
from .backends import ledger, serve, site
from .twins import every_sdpa_kernel, sdpa_unforced

Tensor = torch.Tensor
# forced backends with a second code path (LSE, context parallelism) the twin does not compute
_TWO_PATHS = ("_native_cudnn", "_native_flash")


def patch(module: ModuleType) -> None:
    """Guard the registry entries of :data:`.shape.GUARDED` that this diffusers registers, and
    the ``*_hub`` backends whose hub kernel is one of flash-attn's families (loaded or on the
    twins: dtypes and devices, as the package backends; a hub kernel attnguard does not know,
    SageAttention or aiter, keeps its own calls)."""
    held = shape.registry(module)._backends
    hub = {
        name
        for name, config in shape.hub_configs(module).items()
        if (kernel := kernel_identity.of_request(config.repo_id)) is not None and kernel.flash
    }
    for name, key in shape.backends(module).items():
        if (name in shape.GUARDED or name in hub) and shape.takes_qkv(held[key]):
            ledger.patch_item(held, key, lambda original, _n=name: wrap(_n, original, module))


def wrap(
    name: str, original: Callable[..., Any], module: ModuleType | None = None
) -> Callable[..., Any]:
    """The guarded entry for backend ``name`` (signature and name preserved)."""
    if getattr(original, "__attnguard_original__", None) is not None:
        return original
    twin: Callable[..., Any] | None = None
    if name == shape.NATIVE:
        twin = every_sdpa_kernel(original)
    elif name in shape.FORCED_SDPA and shape.forces_one_sdpa_kernel(original):
        twin = sdpa_unforced
    where = site(name)
    entry = callguard.Entry(
        name,
        EntryKind.REGISTRY_OTHER,  # dtypes, devices and known kernel errors
        original,
        tensors=("query", "key", "value"),
        twin=twin,
        mask="attn_mask",
        site=where,
        in_force=runtime.IN_FORCE,
        # the twins are SDPA's own call without the kernel restriction: SDPA refusing a call
        # under every kernel is the call's own error, not attnguard's
        same_call_twin=twin is not None,
        family=shape.TWINNED[name].family if name in shape.TWINNED else Family.SDPA,
        convention="diffusers",
    )
    guarded = callguard.guard(entry, _check(where))
    if name in shape.TWINNED and module is not None and _unusable(module, name):
        return _served_first(module, name, original, guarded)
    if name not in _TWO_PATHS:
        return guarded

    def attnguard_attention(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("return_lse") or kwargs.get("_parallel_config") is not None:
            return original(*args, **kwargs)
        return guarded(*args, **kwargs)

    wrapper = functools.wraps(original)(attnguard_attention)
    wrapper.__attnguard_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _served_first(
    module: ModuleType, name: str, original: Callable[..., Any], guarded: Callable[..., Any]
) -> Callable[..., Any]:
    """A call straight into a backend diffusers never checked (``dispatch_attention_fn(...,
    backend=name)``, the registry's function itself) whose package it cannot use: the backend
    goes on the twins first, as ``set_attention_backend`` would have put it (one
    ``backend_fallback``). Where it does not (warn mode, no twin), diffusers' own call runs
    untouched, its error included: no remedy of the per-call guard helps a backend without its
    kernel, and none is announced."""

    def attnguard_attention(*args: Any, **kwargs: Any) -> Any:
        if _unusable(module, name) and not _serve_unchecked(module, name):
            return original(*args, **kwargs)
        return guarded(*args, **kwargs)

    wrapper = functools.wraps(original)(attnguard_attention)
    wrapper.__attnguard_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _unusable(module: ModuleType, name: str) -> bool:
    """diffusers bound no kernel for backend ``name`` at import: its package cannot be used here
    (the layer of :func:`_served_first` costs nothing where the kernel is installed)."""
    return getattr(module, shape.TWINNED[name].kernels[0], None) is None


def _serve_unchecked(module: ModuleType, name: str) -> bool:
    """True when backend ``name`` now runs on the twins (:func:`.backends.serve`)."""
    if events.is_compiling():
        return False
    check = module._check_attention_backend_requirements
    check = getattr(check, "__attnguard_original__", check)
    try:
        check(shape.backends(module)[name])
    except RuntimeError as err:
        how = " (named by the call; diffusers did not check it)"
        return serve(module, name, err, how=how)
    except Exception:
        return False
    return False


def _check(where: str) -> Callable[[tuple[Any, ...], dict[str, Any]], bool]:
    """True when the call needs the slow path. The dispatcher passes keywords only; positional
    calls are read by position in the backend functions' order (query, key, value, attn_mask)."""
    lat = callguard.latched
    fp32, boolean = torch.float32, torch.bool

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if args:
            q, k, v = (*args, None, None)[:3]
            k = kwargs["key"] if k is None else k
            v = kwargs["value"] if v is None else v
            mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        else:
            q, k, v = kwargs["query"], kwargs["key"], kwargs["value"]
            mask = kwargs.get("attn_mask")
        dt = q.dtype
        if k.dtype is not dt or v.dtype is not dt:
            return True
        dev = q.get_device()
        if k.get_device() != dev or v.get_device() != dev:
            return True
        if lat and where in lat:
            return True
        if mask is None or not isinstance(mask, Tensor):
            return False
        md = mask.dtype
        return mask.get_device() != dev or (
            md is not dt and md is not boolean and md is not fp32 and md.is_floating_point
        )

    return check


def unpatch() -> None:
    """Forget the sites latched after a kernel error (the entries go back with the ledger)."""
    for key in [k for k in callguard.latched if isinstance(k, str) and k.startswith("diffusers.")]:
        callguard.latched.pop(key, None)
