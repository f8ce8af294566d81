"""The opt-in numbers check (``ATTNGUARD_VERIFY``): a sampled call is recomputed by its family's
reference and compared; a kernel that gives other numbers than it promises is said
(``numerics_mismatch``), never changed.

The call guard (:mod:`attnguard.callguard`) hands a call here when the setting is on, outside
``torch.compile`` traces and outside another checked call (one call is checked once, at the
outermost entry point that has a reference: transformers' flash entry, not the flash-attn
function inside it). Here:

1. :mod:`.sampling` counts the call in its bucket and says whether it is checked;
2. the call runs exactly as it would without the check (its output, its errors);
3. a checked call is read (:mod:`.calls`); what computed it (the kernel or attnguard's twin) and
   its reference are :mod:`.references`' table; :mod:`.compare` says whether the output matches
   (the tolerance and its three measures are documented there); :mod:`.report` says a mismatch
   (strict mode raises :class:`attnguard.errors.AttnGuardError`). The reference is computed
   without autograd and autocast, from the call's own arguments, and freed before the call
   returns. Skipped (and counted, :mod:`attnguard.observability.numerics`): a call during CUDA
   graph capture, one with dropout, one whose kernel has no reference or whose arguments the
   reference does not compute, one whose reference would not fit its memory budget. Any error
   of the check itself is attnguard's: one ``internal_error`` event, and the call's output is
   returned.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..computing import NOW, subject
from ..errors import AttnGuardError
from ..kernel_identity import FLASH_FAMILIES, Family, of_request
from ..kernels import EntryKind
from ..observability import numerics
from . import calls, references, report, sampling
from .compare import UNIT_ROUNDOFF, compare, unit_roundoff
from .references import KERNEL

__all__ = ["INSIDE", "call", "reset"]


class _Inside(threading.local):
    on = False  # this thread is inside a call the check handles: nested entries leave it alone
    skip: Any = None  # the entry whose call runs now without a check of its own


INSIDE = _Inside()
_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _Info:
    """What the check knows of an entry point (worked out at its first call)."""

    convention: str
    family: Family | None
    checkable: bool
    layout: sampling.Layout
    kernel: str
    source: str


def call(entry: Any, guarded: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """Run ``guarded(*args, **kwargs)`` (the guarded call, as without the check) and check it
    when it is one the setting samples."""
    settings = entry.in_force.settings
    info: _Info | None = None
    sampled = False
    try:
        info = entry.__dict__.get("verify_info") or _describe(entry)
        sampled = settings.enabled and sampling.take(
            entry, info.layout, settings.verify, args, kwargs
        )
        if sampled and not info.checkable:
            numerics.note_skipped("no_reference")
            sampled = False
        if sampled and _capturing():
            numerics.note_skipped("cuda_graph_capture")
            sampled = False
    except Exception as exc:
        _failed(entry, args, exc)
        sampled = False
    if info is None or not info.checkable:  # an entry inside it may have a reference
        skipped = INSIDE.skip
        INSIDE.skip = entry
        try:
            return guarded(*args, **kwargs)
        finally:
            INSIDE.skip = skipped
    before = INSIDE.on
    INSIDE.on = True
    try:
        out = guarded(*args, **kwargs)
        if sampled:
            _check(entry, info, settings, args, kwargs, out)
        return out
    finally:
        INSIDE.on = before


def _describe(entry: Any) -> _Info:
    convention = calls.convention_of(entry) or ""
    family = references.family_of(entry)
    kernel, source = entry.name, "package"
    if convention == calls.TRANSFORMERS:
        row = NOW.get(subject("transformers", entry.name))
        known = row.requested if row is not None else of_request(entry.name)
        source = known.source.value if known is not None else "user"
    elif convention == calls.DIFFUSERS:
        source = "library" if family is Family.SDPA else "package"
    elif convention == calls.FLASH:
        kernel = f"flash-attn {entry.name}"
    info = _Info(
        convention,
        family,
        references.checkable(entry, convention, family),
        sampling.Layout(entry, convention),
        kernel,
        source,
    )
    entry.verify_info = info
    return info


def _capturing() -> bool:
    """A CUDA graph is being captured on this thread's stream: a reference computed now would
    be captured into it."""
    return torch.cuda.is_available() and bool(torch.cuda.is_current_stream_capturing())


def _check(entry: Any, info: _Info, settings: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Compare a sampled call's output with its reference (never changes ``out``)."""
    try:
        one = calls.read(entry, info.convention, info.family, args, kwargs)
        if one.q.device.type == "meta" or not all(t.dtype in UNIT_ROUNDOFF for t in one.qkv):
            numerics.note_skipped("unsupported")  # no values, or quantized inputs
            return
        one = calls.on_one_device(one)  # a call the guard aligned: its reference on q's device
        if one.dropout > 0:
            numerics.note_skipped("dropout")
            return
        by = references.computed_by(entry, one, args, settings)
        with torch.no_grad(), _no_autocast(one.q.device):
            u = _roundoff(info, one, by)
            found = _reference(entry, info, one, by, u)
            if isinstance(found, str):
                numerics.note_skipped(found)
                return
            ref, allowance, label = found
            vmax = references.finite_max(calls.used_values(one))
            kernel_out = references.first_tensor(out)
            outcome = compare(kernel_out, ref, allowance, u=u, vmax=vmax, keys=one.keys)
            if not outcome.ok and label == "explicit_float64":
                outcome, label = _second_opinion(
                    entry, one, kernel_out, allowance, u, vmax, outcome
                )
            del ref, allowance, found
        numerics.note_checked(not outcome.ok)
        if not outcome.ok:
            report.mismatch(
                entry,
                one,
                outcome,
                site=entry.site_for(args),
                by=by,
                reference=label,
                settings=settings,
                kernel_name=info.kernel,
                source=info.source,
            )
    except AttnGuardError:
        raise
    except Exception as exc:
        numerics.note_skipped("error")
        _failed(entry, args, exc)


def _second_opinion(
    entry: Any,
    one: calls.Call,
    kernel_out: torch.Tensor,
    allowance: torch.Tensor | None,
    u: float,
    vmax: float,
    outcome: Any,
) -> tuple[Any, str]:
    """transformers' sdpa entry whose output the explicit reference rejects: its own function,
    run in float64 (the semantics of this very release: which calls it makes causal has changed
    between releases), decides. The mismatch stands only where both references reject it."""
    if entry.kind != EntryKind.REGISTRY_SDPA or not references.within_budget(one, torch.float64):
        return outcome, "explicit_float64"
    ref = references.run_twin(entry.original, one, torch.float64)
    again = compare(kernel_out, ref, allowance, u=u, vmax=vmax, keys=one.keys)
    return (again, "library_float64") if again.ok else (outcome, "explicit_float64")


def _roundoff(info: _Info, one: calls.Call, by: str) -> float:
    """``u`` of the precision the call was computed in: a flash-attn family's kernel computes in
    a half dtype whatever it is handed (float32 inputs are cast for it), else the least precise
    of q, k and v."""
    if by == KERNEL and info.family in FLASH_FAMILIES and one.q.dtype not in _HALF:
        return UNIT_ROUNDOFF[torch.bfloat16]
    # q/k/v of mixed dtypes are unified before the kernel: the least precise one bounds it
    return max(unit_roundoff(t.dtype, one.q.device) for t in one.qkv)


def _reference(
    entry: Any, info: _Info, one: calls.Call, by: str, u: float
) -> tuple[torch.Tensor, torch.Tensor | None, str] | str:
    """(reference, allowance, its label), or the reason the call is skipped."""
    twin = references.twin_of(entry, info.convention, info.family)
    explicit = references.explicit_of(entry, info.convention)
    dtype = references.reference_dtype(one.q.device)
    what = "flash_entry_on_sdpa" if entry.kind == EntryKind.REGISTRY_FLASH else "twin"
    fits = by == KERNEL and twin is not None and not one.unsupported
    if fits and references.within_budget(one, dtype):
        label = f"{what}_{str(dtype).removeprefix('torch.')}"
        return references.run_twin(twin, one, dtype), None, label
    if explicit is not None:
        found = explicit(one, u)
        if found is not None:
            return found[0], found[1], "explicit_float64"
    if one.unsupported:
        return "unsupported"
    fallback, label = twin, f"{what}_float64"
    if fallback is None and entry.kind == EntryKind.REGISTRY_SDPA:
        fallback, label = entry.original, "library_float64"
    if fallback is None:
        return "no_reference"
    if not references.within_budget(one, torch.float64):
        return "too_large"
    return references.run_twin(fallback, one, torch.float64), None, label


@contextlib.contextmanager
def _no_autocast(device: torch.device) -> Any:
    """The reference in its own precision, whatever autocast region the call ran in."""
    try:
        ctx = torch.autocast(device_type=device.type, enabled=False)
    except Exception:
        ctx = contextlib.nullcontext()
    with ctx:
        yield


def _failed(entry: Any, args: tuple, exc: BaseException) -> None:
    from ..failopen import report_internal_error

    try:
        site = entry.site_for(args)
    except Exception:
        site = entry.name
    report_internal_error(f"{site}.verify", exc)


def reset() -> None:
    """Forget the sampling counters and the counts (tests)."""
    sampling.reset()
    numerics.reset()
