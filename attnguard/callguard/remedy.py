"""The remedy path, one for every entry point: align, unify, cast, reroute, recover (in this
order; see :mod:`attnguard.callguard`)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import torch

from .. import kernels
from ..dtypes import HALF_DTYPES, cast_out, choose_dtype, half_dtype_for, module_dtype, name
from ..errors import AttnGuardError
from ..failopen import OriginalCall
from ..fallback.registry import move_tensors
from ..kernels import (
    REGISTRY_KINDS,
    EntryKind,
    Kernel,
    classify_kernel_error,
)
from ..observability import events
from .entry import (
    Entry,
    GuardedCall,
    Tensor,
    decide,
    hold_notes,
    latch,
    latched,
    mask_dtype_ok,
    release_notes,
)
from .refusals import as_made


class _Refused(Exception):
    """A same-call twin refused the call (:attr:`Entry.same_call_twin`)."""


def remedy_call(call_fn: OriginalCall, *args: Any, entry: Entry, **kwargs: Any) -> Any:
    if as_made(entry, args, kwargs) is not None:
        # the caller's own call (a dtype no remedy computes, arguments the kernel refuses):
        # it runs as made, so its answer, error included, is the kernel's own; nothing said
        return call_fn(*args, **kwargs)
    # Events are said once the call they describe has run as they say: where attnguard's own
    # code fails on the way, fail-open runs the original call unchanged and none of them is
    # true (a count of changes that never happened). Not inside a trace: nothing is said there.
    token = None if events.is_compiling() else hold_notes()
    same_call = entry.same_call_twin and entry.in_force.settings.changes_things
    try:
        out = _remedy(call_fn, args, kwargs, entry)
    except AttnGuardError:
        _release(token, say=False)
        raise
    except Exception as exc:
        if same_call:
            # A same-call twin's entry: the library itself judges the call. Where it refuses
            # it (under every kernel), the caller's own call runs as made and its answer
            # stands, with nothing announced.
            _release(token, say=False)
            if isinstance(exc, _Refused) or call_fn.raised is not None:
                return call_fn(*args, **kwargs)
            raise  # attnguard's own: fail-open reports it
        # the remedied call reached the kernel and it raised: what was changed was changed
        _release(token, say=exc is call_fn.raised)
        raise
    _release(token, say=True)
    return out


def _release(token: Any, *, say: bool) -> None:
    if token is not None:
        release_notes(token, say=say)


def _remedy(
    call_fn: OriginalCall, args: tuple[Any, ...], kwargs: dict[str, Any], entry: Entry
) -> Any:
    c = GuardedCall(entry, args, kwargs)
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
    registry = entry.kind in REGISTRY_KINDS
    mask = c.get(entry.mask) if entry.mask else None
    paged = entry.kind == EntryKind.REGISTRY_PAGED or (registry and kwargs.get("cache") is not None)

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
    # only real floating dtypes get here (.refusals: complex, integer and xformers' quantized
    # int32 key/value run as made), so the one dtype chosen is one of them
    mixed = any(d is not dts[0] for d in dts[1:])
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
        and not mask_dtype_ok(mask.dtype, qdt)
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
        fields = {"requested": entry.name, "selected": Kernel.SDPA_TWIN.value}
        fields["slower"] = reason == "output_attentions"
        if decide(settings, "reroute", "backend_rerouted", site, reason, text, **fields):
            if entry.same_call_twin:
                return cast_out(_twin_first(c, entry), back)
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
        out = recover_call(c, entry, site, latch_key, known, exc)
        return cast_out(out, expected if mixed else cast_back)
    return cast_out(out, back)


def _autocast_on(device: torch.device) -> bool:
    from ..dtypes import autocast_dtype

    return autocast_dtype(device.type) is not None


def recover_call(
    c: GuardedCall,
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
    settings = entry.in_force.settings
    early: Any = _NOT_RUN
    if entry.same_call_twin and settings.changes_things and settings.allows("recover"):
        early = _twin_first(c, entry)  # announced below only once it computed the call
    try:
        recover = decide(
            settings,
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
    if early is not _NOT_RUN:
        return early
    _align_for_twin(c, entry)
    return c.invoke(entry.twin)


_NOT_RUN = object()


def _align_for_twin(c: GuardedCall, entry: Entry) -> None:
    """The twin takes one device (the query's) and one dtype for q/k/v."""
    q = c.get(entry.tensors[0])
    dev = q.device
    for n in (*entry.tensors[1:], *((entry.mask,) if entry.mask else ()), *entry.aux):
        value = c.get(n)
        if isinstance(value, Tensor) and value.device != dev:
            c.set(n, value.to(dev))
    for n in entry.tensors[1:]:
        t = c.get(n)
        if t.dtype != q.dtype and t.dtype.is_floating_point:
            c.set(n, t.to(q.dtype))


def _twin_first(c: GuardedCall, entry: Entry) -> Any:
    """This call on a same-call twin (:attr:`Entry.same_call_twin`); :class:`_Refused` where the
    twin raises: the library refuses these inputs under every kernel, which is the call's own
    error, not attnguard's."""
    _align_for_twin(c, entry)
    try:
        return c.invoke(entry.twin)
    except Exception:
        pass
    raise _Refused  # outside the handler: the twin's error is not chained to the caller's


def recover_after_error(
    call_fn: OriginalCall, *args: Any, entry: Entry, error: BaseException, **kwargs: Any
) -> Any:
    """The fast path's kernel raised a known error: recover as the slow path would."""
    c = GuardedCall(entry, args, kwargs)
    known = classify_kernel_error(error)
    paged = entry.kind == EntryKind.REGISTRY_PAGED or (
        entry.kind == EntryKind.REGISTRY_OTHER and kwargs.get("cache") is not None
    )
    if (
        known is None
        or paged
        or as_made(entry, args, kwargs) is not None  # the caller's call: the kernel's answer
    ):
        raise error
    token = None if events.is_compiling() else hold_notes()
    try:
        out = recover_call(c, entry, entry.site_for(c.args), entry.latch_key(args), known, error)
    except _Refused:
        _release(token, say=False)
    except BaseException as exc:
        _release(token, say=exc is error)  # warn mode: the kernel's error, said as it is
        raise
    else:
        _release(token, say=True)
        return out
    raise error  # the kernel's own error is the call's: nothing was remedied before it
