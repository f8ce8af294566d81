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
  Unknown errors propagate untouched.

Which kernel computes a call, and why, is decided in :mod:`attnguard.kernels`; this module only
applies it. Modes: fix applies remedies; warn emits the same events with ``applied=False`` and
changes nothing; strict raises :class:`AttnGuardError` instead of applying a remedy. Inside a
torch.compile trace nothing is emitted or latched (side effects break ``fullgraph=True``), but the
fixes still land in the graph because they are plain tensor ops decided from static facts.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any

import torch

from . import kernels
from ._settings import InForce
from .config import Settings
from .dtypes import HALF_DTYPES, cast_out, choose_dtype, half_dtype_for, module_dtype, name
from .errors import AttnGuardError
from .failopen import OriginalCall, make_picklable
from .failopen import fail_open as _fail_open
from .fallback.registry import move_tensors
from .kernels import (
    FLASH_MAX_HEAD_DIM,
    KNOWN_KERNEL_ERRORS,
    EntryKind,
    Kernel,
    classify_kernel_error,
)
from .observability import events
from .selection.buckets import SELECTED_ENTRIES
from .selection.buckets import UNSERVED as _UNSERVED

__all__ = [
    "KNOWN_KERNEL_ERRORS",
    "Entry",
    "classify_kernel_error",
    "decide",
    "guard",
    "latched",
    "note",
    "reset_latches",
    "wrap_direct",
]

Tensor = torch.Tensor
_BF16 = torch.bfloat16
_FP16 = torch.float16
_FP32 = torch.float32
_BOOL = torch.bool

# latch key -> reason_code of the kernel error that latched it. A latched site skips its kernel
# and goes straight to the twin: a failing kernel is not retried on every call.
latched: dict[Hashable, str] = {}


_REMEDY_TEXT = {
    "unify": "cast q/k/v (and mask/bias) to one dtype",
    "align": "move q/k/v and the mask to the query's device",
    "cast": "run the kernel in a half dtype and cast the output back",
    "reroute": "run this call on torch SDPA",
    "recover": "re-run this call on torch SDPA",
}


# --- modes, events, latches ---------------------------------------------------------------------


def note(event: str, site: str, reason_code: str, reason: str, **fields: Any) -> None:
    """Emit (or count) an event, except inside a torch.compile trace (no side effects there)."""
    if events.is_compiling():
        return
    try:
        events.emit(event, site=site, reason_code=reason_code, reason=reason, **fields)
    except Exception:
        pass  # a logging failure must never fail the user's call


def decide(
    st: Settings, remedy: str, event: str, site: str, reason_code: str, reason: str, **fields: Any
) -> bool:
    """True: apply ``remedy``. False: leave the call alone (warn mode, or the remedy disabled).

    ``st``: the settings in force. Strict mode raises AttnGuardError instead. The event says
    whether the remedy was applied; it is counted on every call and emitted the first time per
    (site, reason).
    """
    if not st.enabled or not st.allows(remedy):
        return False
    if st.mode == "strict":
        raise AttnGuardError(reason_code, reason, _REMEDY_TEXT.get(remedy, remedy))
    apply = st.mode == "fix"
    note(event, site, reason_code, reason, applied=apply, **fields)
    return apply


def latch(key: Hashable, reason_code: str) -> None:
    if not events.is_compiling():
        latched.setdefault(key, reason_code)


def reset_latches() -> None:
    """Forget every latched site (tests; and after deactivate nothing should stay latched)."""
    latched.clear()


def _mask_dtype_ok(mask_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    return (
        mask_dtype is dtype
        or mask_dtype is _BOOL
        or mask_dtype is _FP32
        or not mask_dtype.is_floating_point
    )


# --- entry points ---------------------------------------------------------------------------------


class Entry:
    """What the guard needs to know about one entry point.

    ``slots`` maps each argument the guard reads or replaces (the tensors, the mask or bias) to
    its (positional index, keyword name) in the entry's own calling convention, so a call is
    changed in place and re-invoked exactly as the caller made it.

    What is specific to the library the entry point belongs to, its integration hands over
    here: ``in_force`` (the settings in force, read at every call), ``head_axis`` (where the
    head dimension sits in the query), ``site_for(args)`` (the event site of a call, where
    ``site`` is per call rather than fixed), ``uncomputed(entry, site, args, kwargs)`` (the
    error a call that passes something the twin does not compute meets without attnguard, or
    None) and ``left_alone(entry, args)`` (said when the kernel's own error is not one the guard
    recovers from).
    """

    __slots__ = (
        "aux",
        "head_axis",
        "in_force",
        "kind",
        "left_alone",
        "mask",
        "name",
        "original",
        "params",
        "site",
        "site_for_call",
        "slots",
        "tensors",
        "twin",
        "uncomputed",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        original: Callable[..., Any],
        *,
        tensors: tuple[str, ...],
        twin: Callable[..., Any] | None,
        mask: str | None = None,
        site: str | None = None,
        in_force: InForce,
        positions: dict[str, int] | None = None,
        aux: tuple[str, ...] = (),
        head_axis: int = -1,
        site_for: Callable[[tuple[Any, ...]], str] | None = None,
        uncomputed: Callable[..., BaseException | None] | None = None,
        left_alone: Callable[[Entry, tuple[Any, ...]], None] | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.original = original
        self.twin = twin
        self.tensors = tensors
        self.mask = mask
        self.aux = aux
        self.site = site  # None: per call, named by site_for (per module type for the registry)
        self.site_for_call = site_for
        self.in_force = in_force
        self.head_axis = head_axis
        self.uncomputed = uncomputed
        self.left_alone = left_alone
        try:
            sig = inspect.signature(original)
        except (TypeError, ValueError):
            sig = inspect.signature(twin) if twin is not None else None
        self.params = tuple(
            n
            for n, p in (sig.parameters.items() if sig is not None else ())
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )
        roles = [*tensors, *((mask,) if mask else ()), *aux]
        self.slots = {
            role: ((positions or {}).get(role, _index(self.params, role)), role) for role in roles
        }

    def site_for(self, args: tuple[Any, ...] | list[Any]) -> str:
        """The event site of a call with these arguments."""
        if self.site is not None or self.site_for_call is None:
            return self.site or self.name
        return self.site_for_call(tuple(args))

    def latch_key(self, args: tuple[Any, ...]) -> Hashable:
        return self.site if self.site is not None else (self.name, type(args[0]))


def _index(params: tuple[str, ...], role: str) -> int | None:
    return params.index(role) if role in params else None


class _Call:
    """One call's arguments, as the caller passed them: read, replaced, and invoked again."""

    __slots__ = ("args", "entry", "kwargs")

    def __init__(self, entry: Entry, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.entry = entry
        self.args = list(args)
        self.kwargs = dict(kwargs)

    def get(self, role: str, default: Any = None) -> Any:
        index, key = self.entry.slots[role]
        if index is not None and index < len(self.args):
            return self.args[index]
        return self.kwargs.get(key, default)

    def set(self, role: str, value: Any) -> None:
        index, key = self.entry.slots[role]
        if index is not None and index < len(self.args):
            self.args[index] = value
        elif key in self.kwargs or value is not None:
            self.kwargs[key] = value

    def invoke(self, fn: Callable[..., Any]) -> Any:
        return fn(*self.args, **self.kwargs)


# --- the closures ---------------------------------------------------------------------------------


def guard(
    entry: Entry, check: Callable[[tuple[Any, ...], dict[str, Any]], bool]
) -> Callable[..., Any]:
    """The guarded function: ``check`` (inline, cheap) says whether a remedy may be needed."""
    original = entry.original
    in_force = entry.in_force
    remedy = functools.partial(_remedy_call, entry=entry)
    selectable = entry.kind == EntryKind.FLASH_KERNEL and entry.name in SELECTED_ENTRIES
    # flash_attn_func's selection signature holds every fact check() reads: a call served
    # before under fastest passed the check then and passes it now (unless a site is latched)
    presigned = selectable and entry.name == "flash_attn_func"
    name = entry.name
    lat = latched

    def attnguard_attention(*args: Any, **kwargs: Any) -> Any:
        settings = in_force.settings
        if settings.enabled:
            fastest = selectable and settings.kernel == "fastest"  # opt-in: attnguard.selection
            faster = _UNSERVED
            made = _options
            if fastest and presigned and not lat and made is not None and made[0] is settings:
                served = _serve[1]
                try:  # a decided bucket, found by signature: a decode loop's every call
                    faster = served(name, args, kwargs, made[1].apply) if served else faster
                except Exception:
                    faster = _UNSERVED
            if faster is _UNSERVED:
                try:
                    bad = check(args, kwargs)
                except Exception:
                    bad = True  # an odd input makes a check raise: the slow path, never the user
                if bad:
                    site = entry.site_for(args)
                    return _fail_open(site, original, remedy, args, kwargs)
                faster = None
                if fastest:
                    # inline: a decode loop pays for every call layer here (docs/benchmarks.md)
                    serve = _serve[0]
                    if serve is not None and made is not None and made[0] is settings:
                        try:
                            faster = serve(entry, args, kwargs, made[1])
                        except Exception as exc:
                            faster = _selection_failed(entry, exc)
                    else:
                        faster = _faster_kernel(entry, settings, args, kwargs)
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
            recover = functools.partial(_recover, entry=entry, error=exc)
            return _fail_open(site, original, recover, args, kwargs, own_error=exc)

    guarded = functools.wraps(original)(attnguard_attention)
    guarded.__attnguard_original__ = original  # type: ignore[attr-defined]
    return make_picklable(guarded, original)


def _faster_kernel(
    entry: Entry, settings: Settings, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The kernel that serves this call under ATTNGUARD_KERNEL=fastest (None: the requested)."""
    try:
        serve = _serve[0]
        if serve is None:  # imported once: an import statement costs a decode step's budget
            from .selection.decisions import serve, served

            _serve[:] = [serve, served]
        return serve(entry, args, kwargs, _selection_options(settings))
    except Exception as exc:
        return _selection_failed(entry, exc)


def _selection_failed(entry: Entry, exc: Exception) -> None:
    """The selection raised: attnguard's error, reported once; the requested kernel computes."""
    if not events.is_compiling():
        from .failopen import report_internal_error

        report_internal_error(f"{entry.site}.select", exc)


_options: tuple[Settings, Any] | None = None  # the settings in force and their Options
_serve: list[Any] = [None, None]  # selection.decisions' serve and served, once imported


def _selection_options(settings: Settings) -> Any:
    """What the selection needs of the settings in force (made once per settings object)."""
    global _options
    made = _options
    if made is None or made[0] is not settings:
        from . import __version__
        from .selection.decisions import Options

        made = _options = (
            settings,
            Options(
                apply=settings.changes_things,
                version=__version__,
                cache_dir=settings.kernel_cache,
            ),
        )
    return made[1]


def _faster_kernel_failed(
    entry: Entry, exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    """The selected kernel failed (a call unlike the ones it was measured on): attnguard's
    error, reported once, and the requested kernel computes the call."""
    if events.is_compiling():
        raise exc
    from .failopen import report_internal_error

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


# --- the slow path: one for every entry point ----------------------------------------------------


def _remedy_call(call_fn: OriginalCall, *args: Any, entry: Entry, **kwargs: Any) -> Any:
    c = _Call(entry, args, kwargs)
    site = entry.site_for(c.args)
    settings = entry.in_force.settings
    if entry.uncomputed is not None:
        error = entry.uncomputed(entry, site, args, kwargs)
        if error is not None:
            call_fn.raised = error  # the call's own error without attnguard: fail_open lets it go
            raise error
    names = entry.tensors
    query = c.get(names[0])
    dev = query.device
    registry = entry.kind in (
        EntryKind.REGISTRY_FLASH,
        EntryKind.REGISTRY_SDPA,
        EntryKind.REGISTRY_OTHER,
    )
    mask = c.get(entry.mask) if entry.mask else None
    paged = registry and kwargs.get("cache") is not None

    # (1) devices first: the dtype decision below must look at tensors on one device.
    strays = {
        n: str(t.device)
        for n in (*names[1:], *((entry.mask,) if entry.mask else ()))
        if isinstance(t := c.get(n), Tensor) and t.device != dev
    }
    if strays and decide(
        settings,
        "align",
        "tensors_aligned",
        site,
        "device_mismatch",
        f"attention inputs on different devices; moved to the query's device {dev}",
        moved=strays,
        to=str(dev),
    ):
        for n in (*names[1:], *((entry.mask,) if entry.mask else ()), *entry.aux):
            value = c.get(n)
            if isinstance(value, Tensor) and value.device != dev:
                c.set(n, value.to(dev))
        mask = c.get(entry.mask) if entry.mask else None

    # (2) the kernel, unless routing says this call goes to the twin
    latch_key = entry.latch_key(args)
    reason = latched.get(latch_key)
    if reason is None and not paged:
        head_dim = query.shape[entry.head_axis] if entry.kind == EntryKind.FLASH_KERNEL else 0
        reason = kernels.reroute_reason(entry.kind, query, head_dim, mask, kwargs)

    # (3) one dtype for q/k/v (and a float mask or bias)
    autocast_on = registry and _autocast_on(dev)
    wanted = module_dtype(c.args[0]) if registry and c.args else None
    expected = None if autocast_on else wanted  # the dtype the caller's next layer takes
    ts = [c.get(n) for n in names]
    dts = tuple(t.dtype for t in ts)
    quantized_kv = entry.kind == EntryKind.XFORMERS and dts[1] == dts[2] == torch.int32
    mixed = any(d is not dts[0] for d in dts[1:]) and not quantized_kv
    half_only = entry.kind == EntryKind.FLASH_KERNEL and reason is None
    if mixed:
        target = choose_dtype(
            dts, dev, preferred=wanted, half_only=half_only, dtype_setting=settings.dtype
        )
        if decide(
            settings,
            "unify",
            "qkv_unified",
            site,
            "mixed_dtypes",
            f"q/k/v dtypes differ; unified to {name(target)}",
            **{
                "from": {n: name(t.dtype) for n, t in zip(names, ts, strict=True)},
                "to": name(target),
            },
        ):
            for n in names:
                c.set(n, c.get(n).to(target))
    qdt = c.get(names[0]).dtype
    if (
        isinstance(mask, Tensor)
        and mask.dtype.is_floating_point
        and not _mask_dtype_ok(mask.dtype, qdt)
    ):
        code = "bias_dtype" if entry.kind == EntryKind.XFORMERS else "mask_dtype"
        what = "attn_bias" if entry.kind == EntryKind.XFORMERS else "float attention mask"
        if decide(
            settings,
            "unify",
            "qkv_unified",
            site,
            code,
            f"{what} dtype differs from the query's; cast to {name(qdt)}",
            **{"from": {entry.mask: name(mask.dtype)}, "to": name(qdt)},
        ):
            c.set(entry.mask, mask.to(qdt))

    # (4) float32 into a half-only flash kernel: half for the kernel, output cast back
    precast = {n: c.get(n) for n in names}
    cast_back = None
    if half_only and qdt not in HALF_DTYPES:
        if settings.fp32_policy == "fallback":
            reason = "fp32_input"
        else:
            half = half_dtype_for(dev, settings.dtype)
            if decide(
                settings,
                "cast",
                "qkv_unified",
                site,
                "fp32_into_flash",
                f"{name(qdt)} inputs into half-only flash-attn; run in {name(half)}, "
                f"output cast back to {name(qdt)}",
                **{"from": {names[0]: name(qdt)}, "to": name(half)},
            ):
                cast_back = qdt
                for n in names:
                    c.set(n, c.get(n).to(half))

    back = cast_back if cast_back is not None else (expected if mixed else None)
    # (5) this call on the twin
    if reason is not None and entry.twin is not None:
        text = kernels.REROUTE_REASONS.get(reason) or (
            f"{entry.name} failed here before ({reason}); this call goes straight to sdpa"
        )
        if decide(
            settings,
            "reroute",
            "backend_rerouted",
            site,
            reason,
            text,
            requested=entry.name,
            selected=Kernel.SDPA_TWIN.value,
            slower=reason == "output_attentions",
        ):
            return cast_out(c.invoke(entry.twin), back)

    # (6) the kernel; a known error -> the twin, once, and the site latched
    try:
        out = c.invoke(call_fn)
    except Exception as exc:
        known = classify_kernel_error(exc)
        if known is None or paged:
            raise
        for n, t in precast.items():
            c.set(n, t)
        out = _recover_call(c, entry, site, latch_key, known, exc)
        return cast_out(out, expected if mixed else cast_back)
    return cast_out(out, back)


def _autocast_on(device: torch.device) -> bool:
    from .dtypes import autocast_dtype

    return autocast_dtype(device.type) is not None


def _recover_call(
    c: _Call,
    entry: Entry,
    site: str,
    latch_key: Hashable,
    known: tuple[str, str],
    exc: BaseException,
) -> Any:
    """The kernel raised a known error: re-run on the twin (or, for an entry without one, only a
    device mismatch by aligning), or re-raise."""
    code, first = known
    if entry.twin is None and code != "device_mismatch":
        raise exc
    try:
        recover = decide(
            entry.in_force.settings,
            "recover",
            "kernel_error_recovered",
            site,
            code,
            f"{entry.name} raised: {first}; re-ran the call on "
            + (
                "sdpa"
                if entry.twin is not None
                else f"one device ({c.get(entry.tensors[0]).device})"
            ),
            error=first,
            requested=entry.name,
            selected=Kernel.SDPA_TWIN.value if entry.twin is not None else entry.name,
        )
    except AttnGuardError as strict:
        raise strict from exc
    if not recover:
        raise exc
    dev = c.get(entry.tensors[0]).device
    if entry.twin is None:  # device mismatch inside a kernel we cannot replace: align, re-run
        c.args = [move_tensors(a, dev) for a in c.args]
        c.kwargs = {k: move_tensors(v, dev) for k, v in c.kwargs.items()}
        return c.invoke(entry.original)
    latch(latch_key, code)
    q = c.get(entry.tensors[0])
    for n in (*entry.tensors[1:], *((entry.mask,) if entry.mask else ()), *entry.aux):
        value = c.get(n)
        if isinstance(value, Tensor) and value.device != dev:
            c.set(n, value.to(dev))
    for n in entry.tensors[1:]:
        t = c.get(n)
        if t.dtype != q.dtype and t.dtype.is_floating_point:
            c.set(n, t.to(q.dtype))
    return c.invoke(entry.twin)


def _recover(
    call_fn: OriginalCall, *args: Any, entry: Entry, error: BaseException, **kwargs: Any
) -> Any:
    """The fast path's kernel raised a known error: recover as the slow path would."""
    c = _Call(entry, args, kwargs)
    known = classify_kernel_error(error)
    paged = entry.kind == EntryKind.REGISTRY_OTHER and kwargs.get("cache") is not None
    if (
        known is None
        or paged
        or (entry.kind == EntryKind.REGISTRY_OTHER and "paged" in entry.name.lower())
    ):
        raise error
    return _recover_call(c, entry, entry.site_for(c.args), entry.latch_key(args), known, error)
