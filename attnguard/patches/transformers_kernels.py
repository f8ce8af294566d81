"""transformers' flash code path on attnguard's SDPA twins, where the flash-attn kernel cannot run.

transformers computes flash attention in ``modeling_flash_attention_utils._flash_attention_forward``:
it unpads a padded batch, detects packed sequences from ``position_ids`` / ``cu_seq_lens``, turns a
sliding window into flash's ``window_size``, passes softcap, and calls flash-attn's kernel
functions. When those kernels cannot run here (flash-attn missing, its CUDA extension broken, no
CUDA, a GPU below sm80, ...), this module hands that code path attnguard's SDPA twins of the same
functions (:mod:`attnguard.fallback`) instead of letting it fail, reach for a hub kernel (or, on
4.54, stop and ask on stdin), or be swapped for transformers' sdpa path (which on several
releases attends across packed sequences). Everything transformers decides stays as it is for
that release; only the kernel changes. Why and when is decided in :mod:`attnguard.routing`.

Where transformers keeps its kernel functions differs by release; :data:`LAYOUTS` is the one
place that knows. Outside the releases it names, the flash code path is not kept (the load-time
fallback uses transformers' own sdpa or eager path instead, and says so).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..patching import Ledger
from . import minor_release

MODULE = "transformers.modeling_flash_attention_utils"
SITE = "transformers.flash_kernels"
_FLASH_IMPLEMENTATIONS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")

# transformers minor release -> how its flash code path gets its kernel functions (checked on the
# newest patch release of each minor; exercised by the smoke suite of the CI matrix)
#   "globals": module globals bound at import when flash-attn is available (4.49-4.53)
#   "lazy454": _lazy_imports(impl) -> (func, varlen, pad, unpad, is_fa3), cached in globals() by
#              presence; asks on stdin when flash-attn fails to import (4.54)
#   "lazy4":   _lazy_imports(implementation, ...) -> (func, varlen, pad, unpad) (4.55-5.3)
#   "lazy5":   ... -> (func, varlen, with_kvcache, pad, unpad) (5.4-5.23)
LAYOUTS: dict[tuple[int, int], str] = {
    **{(4, m): "globals" for m in range(49, 54)},
    (4, 54): "lazy454",
    **{(4, m): "lazy4" for m in range(55, 58)},
    **{(5, m): "lazy4" for m in range(0, 4)},
    **{(5, m): "lazy5" for m in range(4, 24)},
}
# From 4.56 transformers gives flash a window of (w - 1, w - 1) for sliding_window=w; before, (w, w).
_WINDOW_MINUS_ONE_FROM = (4, 56)
_CACHE_GLOBALS = ("_flash_fn", "_flash_varlen_fn", "_flash_with_kvcache_fn", "_pad_fn", "_unpad_fn")

ledger = Ledger("transformers_kernels")


# --- which release ---------------------------------------------------------------------------


def _minor() -> tuple[int, int] | None:
    return minor_release("transformers")


def _layout_found(module: ModuleType, layout: str) -> bool:
    """The module really has the shape the table says (a patch release could differ)."""
    if layout == "globals":
        return callable(getattr(module, "_flash_attention_forward", None)) and hasattr(
            module, "_upad_input"
        )
    lazy = getattr(module, "_lazy_imports", None)
    if not callable(lazy):
        return False
    lazy = getattr(lazy, "__wrapped__", lazy)  # ours, once patched
    names = getattr(getattr(lazy, "__code__", None), "co_varnames", ())
    return ("flash_attn_with_kvcache" in names) == (layout == "lazy5")


def covers(model_class: type | None = None) -> bool:
    """True when transformers' flash code path can run on the twins in this process (for
    ``model_class``: before 4.54 only models whose attention goes through the registry call the
    patched functions; Qwen2-VL and others bind flash-attn's functions in their own module)."""
    layout = LAYOUTS.get(_minor() or (0, 0))
    if layout is None:
        return False
    module = sys.modules.get(MODULE)
    if module is not None and not _layout_found(module, layout):
        return False
    if layout == "globals" and model_class is not None:
        return bool(getattr(model_class, "_supports_attention_backend", False))
    return True


def flash_window_left(sliding_window: int) -> int:
    """The left edge of flash's window_size that transformers passes for ``sliding_window``."""
    minor = _minor() or (0, 0)
    return sliding_window - 1 if minor >= _WINDOW_MINUS_ONE_FROM else sliding_window


# --- the twins, and saying so -------------------------------------------------------------------


def _twins() -> dict[str, Callable[..., Any] | None]:
    from .. import fallback

    names = (
        "flash_attn_func",
        "flash_attn_varlen_func",
        "flash_attn_with_kvcache",
        "pad_input",
        "unpad_input",
        "index_first_axis",
    )
    return {name: getattr(fallback, name, None) for name in names}


_announced: set[str] = set()


def announced(reason_code: str) -> None:
    """A load-time ``backend_fallback`` already said the twins compute the flash path's calls."""
    _announced.add(reason_code)


def _announce(implementation: str) -> None:
    """Say once that the flash path's kernels are the twins, unless a load already said so (a
    model loaded before attnguard was active, or switched to flash by hand, arrives here)."""
    from .. import events, facts
    from ..patching import report_internal_error

    try:
        status = facts.current().backend(implementation)
        if status.reason_code in _announced:
            return
        _announced.add(status.reason_code)
        events.emit(
            "backend_fallback",
            site=SITE,
            reason_code=status.reason_code,
            reason=f"{implementation} calls: {status.reason}; attnguard's SDPA twins of the "
            "flash-attn functions compute transformers' flash code path (same semantics)",
            requested=implementation,
            selected="sdpa",
            attn_implementation=implementation,
            slower=False,
            applied=True,
        )
    except Exception as exc:
        report_internal_error(SITE, exc)


def _kernel_unusable(implementation: Any) -> bool:
    """The flash-attn kernel behind ``implementation`` cannot run here (probed once). ``None``
    (4.54-4.57 pass no implementation: transformers takes whichever flash-attn is installed)
    means none of flash-attn 2 / 3 can."""
    from .. import routing

    if implementation is None:
        names: tuple[str, ...] = ("flash_attention_2", "flash_attention_3")
    elif isinstance(implementation, str):
        names = (implementation.split("|", 1)[-1],)
    else:
        return False
    if not all(n in _FLASH_IMPLEMENTATIONS for n in names):
        return False
    return all(routing.flash_kernel_unusable(n) is not None for n in names)


def _own(module: ModuleType, *names: str) -> Any:
    for name in names:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


# --- lazy layouts (4.54+) ---------------------------------------------------------------------


def _make_lazy_imports(original: Callable[..., Any], layout: str, module: ModuleType) -> Any:
    @functools.wraps(original)
    def _lazy_imports(implementation: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            twins = _kernel_unusable(implementation)
        except Exception as exc:  # our probe failed: transformers decides as it would alone
            from ..patching import report_internal_error

            report_internal_error(SITE, exc)
            twins = False
        if not twins:
            return original(implementation, *args, **kwargs)
        _announce((implementation or "flash_attention_2").split("|", 1)[-1])
        t = _twins()
        pad = _own(module, "_pad_input", "_fa3_pad_input") or t["pad_input"]
        unpad = _own(module, "_unpad_input", "_fa3_unpad_input") or t["unpad_input"]
        func, varlen = t["flash_attn_func"], t["flash_attn_varlen_func"]
        if layout == "lazy5":
            return func, varlen, t["flash_attn_with_kvcache"], pad, unpad
        if layout == "lazy454":
            return func, varlen, pad, unpad, False  # False: flash-attn 2's kwargs (dropout_p)
        return func, varlen, pad, unpad

    return _lazy_imports


def _clear_lazy_cache(module: ModuleType, layout: str) -> None:
    """Forget kernels resolved before (or, at unpatch, while) attnguard was active."""
    if layout == "lazy454":  # cached by presence in globals()
        for name in (*_CACHE_GLOBALS, "_is_fa3", "_flash_supports_window"):
            vars(module).pop(name, None)
        return
    if hasattr(module, "_loaded_implementation"):
        module._loaded_implementation = None
    for name in (*_CACHE_GLOBALS, "_process_flash_kwargs_fn", "_process_with_kvcache_kwargs_fn"):
        if getattr(module, name, None) is not None:
            setattr(module, name, None)


# --- the globals layout (4.49-4.53) -------------------------------------------------------------


def _announcing(twin: Callable[..., Any]) -> Callable[..., Any]:
    """The twin, saying at its first call that it computes the flash path's kernel calls."""
    said = [False]

    @functools.wraps(twin)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not said[0]:
            said[0] = True
            _announce("flash_attention_2")
        return twin(*args, **kwargs)

    return kernel


# global name -> twin (4.49-4.52 bind the first five; 4.53 binds FA2's under *_2_* / *_fa2 names
# and the generic ones only when a flash-attn is available)
_KERNEL_GLOBALS = {
    "flash_attn_func": "flash_attn_func",
    "flash_attn_varlen_func": "flash_attn_varlen_func",
    "flash_attn_2_func": "flash_attn_func",
    "flash_attn_2_varlen_func": "flash_attn_varlen_func",
}
_PADDING_GLOBALS = {
    "pad_input": "pad_input",
    "unpad_input": "unpad_input",
    "index_first_axis": "index_first_axis",
    "pad_input_fa2": "pad_input",
    "unpad_input_fa2": "unpad_input",
}
_ONLY_WHERE_DECLARED = ("flash_attn_2_func", "flash_attn_2_varlen_func", "pad_input_fa2")
_ONLY_WHERE_DECLARED += ("unpad_input_fa2",)
_MISSING = object()


def _patch_globals(module: ModuleType) -> None:
    """Releases that bind flash-attn's functions at import: bind what is missing (or None) to
    the twins (flash-attn was not available when transformers was imported), and replace
    unguarded copies of flash-attn's functions by the guarded ones (transformers imported
    flash-attn before attnguard was active)."""
    flash = sys.modules.get("flash_attn")
    twins = _twins()
    bound = False
    for name, twin_name in {**_KERNEL_GLOBALS, **_PADDING_GLOBALS}.items():
        current = vars(module).get(name, _MISSING)
        if current is _MISSING and name in _ONLY_WHERE_DECLARED:
            continue  # not a name this release uses
        twin = twins[twin_name]
        if (current is None or current is _MISSING) and twin is not None:
            kernel = name in _KERNEL_GLOBALS
            ledger.patch(module, name, lambda _o, _t=twin, _k=kernel: _announcing(_t) if _k else _t)
            bound = bound or kernel
        elif name in _KERNEL_GLOBALS and current is not _MISSING and flash is not None:
            guarded = getattr(flash, twin_name, None)
            if getattr(guarded, "__attnguard_original__", None) is current:
                ledger.patch(module, name, lambda _o, _g=guarded: _g)
    if bound and not vars(module).get("_flash_supports_window_size"):
        ledger.patch(module, "_flash_supports_window_size", lambda _o: True)


# --- patch / unpatch ----------------------------------------------------------------------------


def patch(module: ModuleType) -> None:
    """Hand transformers' flash code path the twins where flash-attn's kernel cannot run."""
    layout = LAYOUTS.get(_minor() or (0, 0))
    if layout is None or not _layout_found(module, layout):
        return
    if layout == "globals":
        _patch_globals(module)
        return
    ledger.patch(module, "_lazy_imports", lambda o: _make_lazy_imports(o, layout, module))
    _clear_lazy_cache(module, layout)


def preload(implementation: str) -> None:
    """Resolve the kernels now, as transformers' own gate does (``torch.compile(fullgraph=True)``
    needs them resolved before tracing)."""
    module = sys.modules.get(MODULE)
    load = getattr(module, "lazy_import_flash_attention", None)
    if callable(load):
        load(implementation)


def unpatch() -> None:
    """Restore every original this module replaced; the lazy cache re-resolves unguarded."""
    ledger.unpatch_all()
    _announced.clear()
    module = sys.modules.get(MODULE)
    layout = LAYOUTS.get(_minor() or (0, 0))
    if module is not None and layout is not None and layout != "globals":
        _clear_lazy_cache(module, layout)
