"""Per-call guard shared by every attention entry point: the registry, flash_attn and xformers.

Each entry point gets a plain closure (``functools.wraps``; never a wrapt proxy, which breaks
torch.compile). The closure runs a fast check inline, cheapest first: q/k/v dtypes and devices,
and what the entry's kernel cannot take. Nothing wrong (the common case) -> the original runs,
inside a ``try`` that costs nothing until it raises. Something wrong -> one slow path for every
entry point (:func:`_remedy_call`), where the remedies live, in this order:

* ``align``: q/k/v/mask on different devices -> the query's device (``tensors_aligned``);
* ``unify``: q/k/v (and a float mask or bias) of mixed dtypes -> one dtype (``qkv_unified``;
  the choice is :func:`attnguard.dtypes.choose_dtype`);
* ``cast``: float32 into a half-only flash kernel -> half for the kernel, output cast back;
* ``reroute``: the kernel cannot take this call -> this call on the entry's SDPA twin
  (``backend_rerouted``, counted per call; the reasons are :mod:`attnguard.kernels`'s);
* ``recover``: a known, recoverable kernel error -> the same call re-run once on the twin, and the
  site's later calls sent straight there (``kernel_error_recovered``, then ``backend_rerouted``).
  Unknown errors propagate untouched. An entry whose twin is the library's own call less the
  kernel's restriction (``Entry.same_call_twin``: diffusers' SDPA backends) tries the twin before
  announcing anything: a call the twin refuses is the caller's own, which runs as made.

Which kernel computes a call, and why, is decided in :mod:`attnguard.kernels`; this module only
applies it. With the opt-in numbers check on (``ATTNGUARD_VERIFY``), the closure hands the call
to :mod:`attnguard.verify`, which runs it as above and checks a sample against its reference.
Modes: fix applies remedies; warn emits the same events with ``applied=False`` and changes
nothing; strict raises :class:`AttnGuardError` instead of applying a remedy. Inside a
torch.compile trace nothing is emitted or latched (side effects break ``fullgraph=True``), but the
fixes still land in the graph because they are plain tensor ops decided from static facts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import verify as _verify
from ..config import Settings
from ..failopen import fail_open as _fail_open
from ..failopen import make_picklable
from ..kernels import FLASH_MAX_HEAD_DIM, EntryKind, classify_kernel_error
from ..observability import events
from ..selection.buckets import SELECTED_ENTRIES
from .entry import Entry, Tensor, apply_verdict, decide, latch, latched, note, reset_latches
from .remedy import recover_after_error, remedy_call

_BF16 = torch.bfloat16
_FP16 = torch.float16


__all__ = [
    "Entry",
    "apply_verdict",
    "decide",
    "guard",
    "latch",
    "latched",
    "note",
    "reset_latches",
    "wrap_direct",
]


def guard(
    entry: Entry, check: Callable[[tuple[Any, ...], dict[str, Any]], bool]
) -> Callable[..., Any]:
    """The guarded function: ``check`` (inline, cheap) says whether a remedy may be needed."""
    original = entry.original
    in_force = entry.in_force
    remedy = functools.partial(remedy_call, entry=entry)
    selectable = entry.kind == EntryKind.FLASH_KERNEL and entry.name in SELECTED_ENTRIES
    # flash_attn_func's selection signature holds every fact check() reads: a call served
    # before under fastest passed the check then and passes it now (unless a site is latched)
    presigned = selectable and entry.name == "flash_attn_func"
    name = entry.name
    lat = latched
    ask = _ASK
    checked, inside, compiling = _verify.call, _verify.INSIDE, torch.compiler.is_compiling

    def attnguard_attention(*args: Any, **kwargs: Any) -> Any:
        settings = in_force.settings
        if settings.verify and not compiling() and not inside.on and inside.skip is not entry:
            return checked(entry, attnguard_attention, args, kwargs)  # opt-in: attnguard.verify
        if settings.enabled:
            faster: Any = ask  # a tuple: not served by its signature (ask: not asked yet)
            made = None
            if selectable and settings.kernel == "fastest":  # opt-in: attnguard.selection
                made = _selection[0]
                if made[0] is not settings:
                    made = _select(settings, entry.site)
                if presigned and not lat:
                    # a decided bucket's call, found by its signature (a decode loop's every
                    # call): inline, as below, for a decode loop pays for every call layer here
                    try:  # (served() fails open itself; this costs nothing until it raises)
                        faster = made[3](name, args, kwargs, made[1])
                    except Exception:
                        faster = ()
            # ``faster is ask`` first: torch 2.4's compiler cannot read a tuple's __class__
            if faster is ask or faster.__class__ is tuple:
                try:
                    bad = check(args, kwargs)
                except Exception:
                    bad = True  # an odd input makes a check raise: the slow path, never the user
                if bad:
                    site = entry.site_for(args)
                    return _fail_open(site, original, remedy, args, kwargs)
                if made is None:
                    faster = None
                else:
                    try:
                        if faster is ask:
                            faster = made[3](name, args, kwargs, made[1])
                        if faster.__class__ is tuple:  # described, decided when new: the selection
                            faster = made[4](entry, args, kwargs, made[2], faster)
                    except Exception as exc:
                        faster = _selection_failed(entry, exc)
            if faster is not None:
                try:
                    return faster(args, kwargs)
                except Exception as exc:
                    return _faster_kernel_failed(entry, exc, args, kwargs)
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            if (
                not in_force.settings.enabled
                or events.is_compiling()
                or classify_kernel_error(exc) is None
            ):
                if entry.left_alone is not None and in_force.settings.enabled:
                    entry.left_alone(entry, args)
                raise
            site = entry.site_for(args)
            recover = functools.partial(recover_after_error, entry=entry, error=exc)
            return _fail_open(site, original, recover, args, kwargs, own_error=exc)

    guarded = functools.wraps(original)(attnguard_attention)
    guarded.__attnguard_original__ = original  # type: ignore[attr-defined]
    return make_picklable(guarded, original)


_ASK = (None,)  # the guard's "not asked yet" (a tuple served() never answers)
# (settings, apply, Options, served, serve): what the selection needs for the settings in force
_selection: list[tuple[Any, ...]] = [(None,)]


def _select(settings: Settings, site: str | None = None) -> tuple[Any, ...]:
    """What the selection needs of the settings in force, made once per settings object (the
    selection imported at the first call under fastest: never at start-up)."""
    try:
        from .. import __version__
        from ..selection.decisions import Options, serve
        from ..selection.served import served

        apply = settings.changes_things
        opts = Options(apply=apply, version=__version__, cache_dir=settings.kernel_cache)
        made: tuple[Any, ...] = (settings, apply, opts, served, serve)
    except Exception as exc:  # attnguard's error, reported once: the requested kernel computes
        _selection_failed_at(f"{site or 'selection'}.select", exc)
        made = (settings, False, None, _not_served, _requested)
    _selection[0] = made
    return made


def _not_served(name: str, args: Any, kwargs: Any, apply: bool) -> tuple[Any, ...]:
    return ()


def _requested(entry: Entry, args: Any, kwargs: Any, opts: Any, sig: Any) -> None:
    return None


def _selection_options(settings: Settings) -> Any:
    """The selection's options for the settings in force."""
    made = _selection[0]
    return (made if made[0] is settings else _select(settings))[2]


def _selection_failed(entry: Entry, exc: Exception) -> None:
    """The selection raised: attnguard's error, reported once; the requested kernel computes."""
    _selection_failed_at(f"{entry.site}.select", exc)


def _selection_failed_at(site: str, exc: Exception) -> None:
    if not events.is_compiling():
        from ..failopen import report_internal_error

        report_internal_error(site, exc)


def _faster_kernel_failed(
    entry: Entry, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The selected kernel failed (a call unlike the ones it was measured on): attnguard's
    error, reported once, and the requested kernel computes the call."""
    if events.is_compiling():
        raise exc
    from ..failopen import report_internal_error

    report_internal_error(f"{entry.site}.selected", exc)
    return entry.original(*args, **kwargs)


def wrap_direct(entry: Entry) -> Callable[..., Any]:
    """A guarded closure for a flash_attn function or xformers' memory_efficient_attention."""
    n = len(entry.tensors)
    flash = entry.kind == EntryKind.FLASH_KERNEL
    head_axis = entry.head_axis
    site = entry.site
    lat = latched
    bf16, fp16 = _BF16, _FP16

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if len(args) < n:
            return True
        q = args[0]
        k = args[1] if n > 1 else q
        v = args[2] if n > 2 else q
        dt = q.dtype
        dev = q.get_device()
        if k.dtype is not dt or v.dtype is not dt or q.is_cpu:
            return True
        if k.get_device() != dev or v.get_device() != dev:
            return True
        if lat and site in lat:
            return True
        if flash:
            return (dt is not bf16 and dt is not fp16) or q.shape[head_axis] > FLASH_MAX_HEAD_DIM
        return _xformers_bias_off(args, kwargs, dt, dev)

    return guard(entry, check)


def _xformers_bias_off(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, device: int
) -> bool:
    """True when a tensor attn_bias has another float dtype or device than the query."""
    bias = args[3] if len(args) > 3 else kwargs.get("attn_bias")
    if bias is None or not isinstance(bias, Tensor):
        return False
    return bias.get_device() != device or (bias.dtype is not dtype and bias.dtype.is_floating_point)
