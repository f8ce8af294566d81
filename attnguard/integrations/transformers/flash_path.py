"""transformers' flash code path on attnguard's SDPA twins, where the flash-attn kernel cannot run.

transformers computes flash attention in ``modeling_flash_attention_utils._flash_attention_forward``:
it unpads a padded batch, detects packed sequences from ``position_ids`` / ``cu_seq_lens``, turns a
sliding window into flash's ``window_size``, passes softcap, and calls flash-attn's kernel
functions. When those kernels cannot run here (flash-attn missing, its CUDA extension broken, no
CUDA, a GPU below sm80, ...), this module hands that code path attnguard's SDPA twins of the same
functions (:mod:`attnguard.fallback`) instead of letting it fail, reach for a hub kernel (or, on
4.54, stop and ask on stdin), or be swapped for transformers' sdpa path (which on several
releases attends across packed sequences). Everything transformers decides stays as it is for
that release; only the kernel changes. Why and when is decided in :mod:`attnguard.kernels`.

How a release wires its flash path is read from the module itself
(:mod:`.wiring`, never from the version number) and confirmed once, at the first
load that needs the twins, by running transformers' own flash path on recording stand-ins of
the twins (:mod:`.probe`). Where either finds something it does not know, the flash
path is not kept and attnguard steps aside: the load fails as it would without attnguard, and
one ``observed`` event (``flash_path_unrecognised``) says what was not recognised — never a
backend that computes different numbers.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from ... import runtime
from ...computing import NOW
from ...fallback import families
from ...fallback.families import Family
from ...kernels import flash_kernel_unusable
from . import twin_calls
from . import wiring as transformers_wiring
from .flash_serving import (
    announce,
    refresh_serving,
    serving,
)
from .flash_state import (
    FA2_REQUEST,
    FLASH_IMPLEMENTATIONS,
    MODULE,
    REQUEST_OF,
    SITE,
    clear_lazy_cache,
    family_of,
    ledger,
    state,
)
from .wiring import GLOBALS, INDEX, IS_FA3, PAD, UNPAD, VARLEN, Unrecognised, Wiring

# --- is the flash path kept? ---------------------------------------------------------------------


def wiring() -> Wiring | None:
    """The recognised wiring of the patched module (None: unread or unrecognised)."""
    return state.wiring


def unrecognised(implementation: Any = FA2_REQUEST) -> str:
    """Why transformers' flash path cannot be kept on the twins of ``implementation``'s family
    (:func:`family_of`) in this process ("" when it can): its wiring is not one attnguard
    recognises, or the probe found its behaviour differs with those twins. flash-attn 2's twins
    are probed first: where the path fails with them, attnguard steps aside for every family."""
    family = family_of(implementation)
    with state.lock:
        if state.wiring is None or state.module is None:
            return state.unrecognised
        if state.probe is None:
            state.probe = state.probes[families.FA2] = _probe(families.FA2)
            refresh_serving()  # the probe may have found an argument not computed
            if not state.probe.ok:  # step aside: the flash path runs as transformers wrote it
                ledger.unpatch_all()
                if state.wiring.layout != GLOBALS:
                    clear_lazy_cache(state.module, state.wiring)
        if not state.probe.ok:
            return state.probe.reason
        if family is families.FA2:
            return ""
        if state.wiring.layout == GLOBALS:  # the globals it binds at import are flash-attn 2's
            return (
                f"it binds flash-attn's functions at import, and attnguard's twins stand in for "
                f"flash-attn 2's only, not for {family}'s"
            )
        unmasked = _no_flash_mask(implementation)
        if unmasked:
            return unmasked
        found = state.probes.get(family)
        if found is None:
            found = state.probes[family] = _probe(family)
            refresh_serving()
        return "" if found.ok else found.reason


def _no_flash_mask(implementation: Any) -> str:
    """Why transformers would build no attention mask for a model loaded as ``implementation``
    ("" where it builds flash's): its mask registry (``ALL_MASK_ATTENTION_FUNCTIONS``) holds
    flash's mask for ``flash_attention_2`` but none for this request (4.54-4.56 for
    ``flash_attention_3``), so a padded batch would reach the flash path unmasked. Read from the
    registry, not the version; a hub kernel's name gets its mask from its loader."""
    import importlib

    name = implementation.split("|", 1)[-1] if isinstance(implementation, str) else None
    if name not in FLASH_IMPLEMENTATIONS:
        return ""
    try:
        masks = importlib.import_module("transformers.masking_utils").ALL_MASK_ATTENTION_FUNCTIONS
        mapping = masks._global_mapping
    except Exception:
        return ""
    if isinstance(mapping, dict) and FA2_REQUEST in mapping and name not in mapping:
        return f"its attention masks have no {name} entry (a padded batch would go unmasked)"
    return ""


def _probe(family: Family) -> Any:
    """The probe's verdict on transformers' flash path handed ``family``'s twins."""
    from . import probe

    assert state.module is not None and state.wiring is not None
    return probe.run(
        state.module,
        state.wiring,
        kernels=functools.partial(kernels_by_role, family),
        swapped=functools.partial(swapped_kernels, family=family),
        implementation=REQUEST_OF[family],
    )


def stepped_aside(implementation: str) -> str:
    """Why a call of ``implementation``'s flash path was left to transformers although its kernel
    cannot run here ("" when it was not: the kernel runs, or the twins serve the path)."""
    if not _kernel_unusable(implementation):
        return ""
    why = unrecognised(implementation)
    if not why:
        return ""
    return (
        "attnguard does not recognise how this transformers release wires its flash code path "
        f"({why}), so it does not compute that path's calls"
    )


def installed_flash_path() -> dict[str, Any]:
    """For ``attnguard doctor``: how a guarded run here would find the installed transformers'
    flash path (its wiring, the window it passes, the probe's verdict). Where attnguard is not
    active in this process, the module is patched for the check and restored after."""
    import importlib

    try:
        importlib.import_module("transformers.modeling_utils")
        module = importlib.import_module(MODULE)
    except Exception as exc:
        return {
            "kept_on_twins": False,
            "why": f"transformers does not import ({type(exc).__name__})",
        }
    ours = state.module is None
    if ours:
        patch(module)
    try:
        why, wired, offset = unrecognised(), state.wiring, _window_offset()
        return {
            "kept_on_twins": not why,
            "why": why,
            "wiring": wired.describe() if wired is not None else None,
            "window_size": None if offset is None else f"(w{offset[0]:+d}, w{offset[1]:+d})",
            "probe_cases": list(getattr(state.probe, "cases", ())),
        }
    finally:
        if ours:
            unpatch()


def covers(model_class: type | None = None, implementation: Any = FA2_REQUEST) -> bool:
    """True when transformers' flash code path can run on the twins (of ``implementation``'s
    family) in this process (for ``model_class``: before 4.54 only models whose attention goes
    through the registry call the patched functions; Qwen2-VL and others bind flash-attn's
    functions in their own module)."""
    if unrecognised(implementation):
        return False
    wired = state.wiring
    if wired is not None and wired.layout == GLOBALS and model_class is not None:
        return bool(getattr(model_class, "_supports_attention_backend", False))
    return True


def flash_window(sliding_window: int) -> tuple[int, int] | None:
    """flash's ``window_size`` that transformers' flash path passes for ``sliding_window``
    (recorded by the probe, else read from the module); None when unknown."""
    offset = _window_offset()
    if offset is None:
        return None
    return sliding_window + offset[0], sliding_window + offset[1]


def _window_offset() -> tuple[int, int] | None:
    """The window convention as (left - w, right - w): recorded by the probe, else read."""
    offset = getattr(state.probe, "window_offset", None)
    return offset if offset is not None else getattr(state.wiring, "window_offset", None)


# --- the twins, and saying so -------------------------------------------------------------------


def _twins(family: Family = families.FA2) -> dict[str, Callable[..., Any] | None]:
    """``family``'s twins by role (a role is the flash-attn name of the function it stands for),
    and the padding helpers."""
    from ... import fallback

    twins = {**families.twins_for(family)}
    twins.update({role: getattr(fallback, role, None) for role in (PAD, UNPAD, INDEX)})
    varlen = twins[VARLEN]
    if varlen is not None:  # noting packed rows for the exit summary's advice
        twins[VARLEN] = twin_calls.recording_varlen(varlen)
    return twins


def _kernel_unusable(implementation: Any) -> bool:
    """The flash-attn kernel behind ``implementation`` cannot run here (probed once). ``None``
    (4.54-4.57 pass no implementation: transformers takes whichever flash-attn is installed)
    means none of flash-attn 2 / 3 can."""
    if implementation is None:
        names: tuple[str, ...] = ("flash_attention_2", "flash_attention_3")
    elif isinstance(implementation, str):
        if implementation.split("|", 1)[-1] in NOW.twin_arguments:
            return True  # the twins serve it (a hub kernel that did not load: .hub)
        names = (implementation.split("|", 1)[-1],)
    else:
        return False
    if not all(n in FLASH_IMPLEMENTATIONS for n in names):
        return False
    settings = runtime.settings()
    return all(flash_kernel_unusable(n, settings) is not None for n in names)


def _first_defined(module: ModuleType, *names: str) -> Any:
    """The first of ``names`` that ``module`` itself defines as a function (its own padding
    helpers, where a release has them), else None."""
    for name in names:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    return None


# --- the lazy layout -------------------------------------------------------------------------


def _implementation(wired: Wiring, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    name, index = wired.implementation_param
    return args[index] if len(args) > index else kwargs.get(name)


def _kernels_for(module: ModuleType, family: Family = families.FA2) -> dict[str, Any]:
    """``family``'s twins by role, signatures included: transformers hands each kernel only the
    keyword arguments its signature declares, so it passes the twins what it would pass that
    family's kernel (no dropout to flash-attn 3's or 4's). pad/unpad: the release's own torch
    helpers where it has them."""
    t = _twins(family)
    return {
        **t,
        PAD: _first_defined(module, "_pad_input", "_fa3_pad_input") or t["pad_input"],
        UNPAD: _first_defined(module, "_unpad_input", "_fa3_unpad_input") or t["unpad_input"],
        IS_FA3: not family.dropout,  # 4.54's flag: True, and it passes no dropout_p
    }


def kernels_by_role(family: Family = families.FA2) -> dict[str, Any]:
    """The functions the flash path is handed for ``family``, by role (the probe records these)."""
    module = state.module
    if module is None:
        raise Unrecognised("the flash path is not patched")
    return {role: fn for role, fn in _kernels_for(module, family).items() if callable(fn)}


def _make_lazy_imports(original: Callable[..., Any], wired: Wiring, module: ModuleType) -> Any:
    @functools.wraps(original)
    def _lazy_imports(*args: Any, **kwargs: Any) -> Any:
        kernels = getattr(state.override, "kernels", None)  # the probe's, on its thread
        if kernels is None:
            implementation = _implementation(wired, args, kwargs)
            try:
                twins = _kernel_unusable(implementation)
            except Exception as exc:  # our probe failed: transformers decides as it would alone
                from ...failopen import report_internal_error

                report_internal_error(SITE, exc)
                twins = False
            if not twins or unrecognised(implementation):  # the first such call runs the probe
                return original(*args, **kwargs)
            chosen = (implementation or "flash_attention_2").split("|", 1)[-1]
            announce(chosen)
            serving(chosen)
            kernels = _kernels_for(module, family_of(implementation))
        return tuple(kernels[role] for role in wired.returns)

    return _lazy_imports


# --- the globals layout ---------------------------------------------------------------------------


def _announcing(twin: Callable[..., Any]) -> Callable[..., Any]:
    """The twin, saying at its first call that it computes the flash path's kernel calls."""
    said = [False]

    @functools.wraps(twin)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        if not said[0]:
            if unrecognised():  # the probe failed: the release's own None global, called
                raise TypeError("'NoneType' object is not callable")
            said[0] = True
            announce("flash_attention_2")
        return twin(*args, **kwargs)

    return kernel


# 4.53 binds FA2's functions under *_2_* / *_fa2 names and the generic ones only when a
# flash-attn is available: those names are bound only where the release declares them
_ONLY_WHERE_DECLARED = ("flash_attn_2_func", "flash_attn_2_varlen_func", "pad_input_fa2")
_ONLY_WHERE_DECLARED += ("unpad_input_fa2",)
_MISSING = object()


def _patch_globals(module: ModuleType, wired: Wiring) -> None:
    """Releases that bind flash-attn's functions at import: bind what is missing (or None) to
    the twins (flash-attn was not available when transformers was imported), and replace
    unguarded copies of flash-attn's functions by the guarded ones (transformers imported
    flash-attn before attnguard was active)."""
    flash = sys.modules.get("flash_attn")
    twins = _twins()
    bound = False
    for name in wired.kernel_globals:
        role = (
            transformers_wiring.KERNEL_GLOBALS.get(name)
            or transformers_wiring.PADDING_GLOBALS[name]
        )
        current = vars(module).get(name, _MISSING)
        if current is _MISSING and name in _ONLY_WHERE_DECLARED:
            continue  # not a name this release uses
        twin = twins[role]
        kernel = name in transformers_wiring.KERNEL_GLOBALS
        if (current is None or current is _MISSING) and twin is not None:
            ledger.patch(module, name, lambda _o, _t=twin, _k=kernel: _announcing(_t) if _k else _t)
            bound = bound or kernel
        elif kernel and current is not _MISSING and flash is not None:
            guarded = getattr(flash, role, None)
            if getattr(guarded, "__attnguard_original__", None) is current:
                ledger.patch(module, name, lambda _o, _g=guarded: _g)
    if bound and not vars(module).get("_flash_supports_window_size"):
        ledger.patch(module, "_flash_supports_window_size", lambda _o: True)
    if bound:
        serving("flash_attention_2")


# --- the probe's hand-in ----------------------------------------------------------------------------


@contextmanager
def swapped_kernels(kernels: dict[str, Any], family: Family = families.FA2) -> Iterator[None]:
    """While open, transformers' flash path on this thread gets ``kernels`` (by role) instead of
    ``family``'s twins: the probe's recording stand-ins (:mod:`.probe`)."""
    module, wired = state.module, state.wiring
    if module is None or wired is None:
        raise Unrecognised("the flash path is not patched")
    with twin_calls.unwatched():
        yield from _swapped(module, wired, kernels, family)


def _swapped(
    module: ModuleType, wired: Wiring, kernels: dict[str, Any], family: Family
) -> Iterator[None]:
    if wired.layout != GLOBALS:
        cached = {n: vars(module).get(n, _MISSING) for n in wired.caches}
        state.override.kernels = {**_kernels_for(module, family), **kernels}
        clear_lazy_cache(module, wired)
        try:
            yield
        finally:
            state.override.kernels = None
            for name, value in cached.items():  # what was resolved before, as it was
                if value is _MISSING:
                    vars(module).pop(name, None)
                else:
                    setattr(module, name, value)
        return
    saved = {
        n: vars(module).get(n, _MISSING)
        for n in (*wired.kernel_globals, "_flash_supports_window_size")
    }
    roles = {**transformers_wiring.KERNEL_GLOBALS, **transformers_wiring.PADDING_GLOBALS}
    try:
        for name in wired.kernel_globals:
            if roles[name] in kernels:
                setattr(module, name, kernels[roles[name]])
        module._flash_supports_window_size = True  # type: ignore[attr-defined]
        yield
    finally:
        for name, value in saved.items():
            if value is _MISSING:
                vars(module).pop(name, None)
            else:
                setattr(module, name, value)


# --- patch / unpatch ----------------------------------------------------------------------------


def patch(module: ModuleType) -> None:
    """Hand transformers' flash code path the twins where flash-attn's kernel cannot run, if its
    wiring is one attnguard recognises (otherwise remember why not)."""
    with state.lock:
        state.module, state.probe = module, None
        state.probes.clear()
        try:
            wired = transformers_wiring.read(module)
        except Unrecognised as exc:
            state.wiring, state.unrecognised = None, str(exc)
            return
        except Exception as exc:  # reading a module we do not know: not recognised, say why
            state.wiring = None
            state.unrecognised = f"reading it failed ({type(exc).__name__})"
            return
        state.wiring, state.unrecognised = wired, ""
    if wired.layout == GLOBALS:
        _patch_globals(module, wired)
        return
    ledger.patch(
        module, transformers_wiring.LAZY_FUNCTION, lambda o: _make_lazy_imports(o, wired, module)
    )
    clear_lazy_cache(module, wired)


def preload(implementation: str) -> None:
    """Resolve the kernels now, as transformers' own gate does (``torch.compile(fullgraph=True)``
    needs them resolved before tracing)."""
    module = sys.modules.get(MODULE)
    load = getattr(module, "lazy_import_flash_attention", None)
    if callable(load):
        load(implementation)


def unpatch() -> None:
    """Restore every original this module replaced; the lazy cache re-resolves unguarded."""
    from . import arguments

    ledger.unpatch_all()
    arguments.unpatch()
    NOW.clear("transformers")
    twin_calls.reset()
    NOW.twin_arguments.clear()
    arguments.TWIN_ASIDE.clear()
    with state.lock:
        module, wired = state.module, state.wiring
        state.module, state.wiring, state.probe = None, None, None
        state.probes.clear()
        state.unrecognised = "transformers' flash code path has not been read"
    if module is not None and wired is not None and wired.layout != GLOBALS:
        clear_lazy_cache(module, wired)
