"""What the guard knows about an entry point (:class:`Entry`), one call's arguments
(:class:`GuardedCall`), the modes (:func:`decide`) and the latched sites."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from contextvars import ContextVar, Token
from typing import TYPE_CHECKING, Any

import torch

from .._settings import InForce
from ..computing import NOW
from ..config import Settings
from ..errors import AttnGuardError
from ..observability import events

if TYPE_CHECKING:
    from ..kernel_identity import Family
    from ..kernels import Verdict

Tensor = torch.Tensor


_BF16 = torch.bfloat16


_FP16 = torch.float16


_FP32 = torch.float32


_BOOL = torch.bool


# latch key -> reason_code of the kernel error that latched it (the table of what computes now,
# its per-call view). A latched site skips its kernel and goes straight to the twin: a failing
# kernel is not retried on every call.
latched: dict[Hashable, str] = NOW.latched


_REMEDY_TEXT = {
    "unify": "cast q/k/v (and mask/bias) to one dtype",
    "align": "move q/k/v and the mask to the query's device",
    "cast": "run the kernel in a half dtype and cast the output back",
    "reroute": "run this call on torch SDPA",
    "recover": "re-run this call on torch SDPA",
}


# events of a call still being remedied, said only once it succeeds (:func:`hold_notes`)
_held: ContextVar[list[tuple[str, str, str, str, dict[str, Any]]] | None] = ContextVar(
    "attnguard_held_notes", default=None
)


def hold_notes() -> Token[Any]:
    """From now on in this context, :func:`note` keeps events back until
    :func:`release_notes`."""
    return _held.set([])


def release_notes(token: Token[Any], *, say: bool) -> None:
    """Stop keeping events back: emit the kept ones (``say``: the call they describe
    succeeded) or drop them (it did not, and its own answer stands)."""
    kept = _held.get() or []
    _held.reset(token)
    for event, site, reason_code, reason, fields in kept if say else ():
        note(event, site, reason_code, reason, **fields)


def note(event: str, site: str, reason_code: str, reason: str, **fields: Any) -> None:
    """Emit (or count) an event, except inside a torch.compile trace (no side effects there)."""
    if events.is_compiling():
        return
    kept = _held.get()
    if kept is not None:
        kept.append((event, site, reason_code, reason, fields))
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


def apply_verdict(
    st: Settings | None, verdict: Verdict, site: str, subject: str, **fields: Any
) -> bool:
    """Apply ``verdict`` (:func:`attnguard.kernels.verdict`) to ``subject`` (a row of
    :data:`attnguard.computing.NOW`): the one place that owns fix / warn / strict / off for what
    computes a kernel's calls. True: the twins compute them from now on (fix mode; one
    ``backend_fallback`` event). False: the kernel itself computes them (nothing wrong: nothing
    said), or its own error stands and one event says why — attnguard steps aside
    (``observed``), the fallback remedy is switched off (``observed``, saying so), warn mode
    (what fix mode would do), the guard is off (nothing). Strict mode raises AttnGuardError.
    The row written says which."""
    from dataclasses import replace

    if not verdict.problem:  # the kernel computes its calls: recorded, nothing said
        NOW.set(subject, verdict)
        return False
    if not verdict.twins:
        NOW.set(subject, verdict)
        note("observed", site, verdict.reason_code, verdict.reason, **fields)
        return False
    if st is None or not st.enabled:
        return False
    left = replace(verdict, twins=False)
    if not st.allows("fallback"):  # said, as any remedy ATTNGUARD_DISABLE switches off
        left = replace(left, change="left as is (ATTNGUARD_DISABLE names fallback)")
        NOW.set(subject, left)
        note("observed", site, verdict.reason_code, left.reason, **fields)
        return False
    from ..kernels import Kernel

    applied = decide(
        st,
        "fallback",
        "backend_fallback",
        site,
        verdict.reason_code,
        verdict.reason,
        selected=Kernel.SDPA_TWIN.value,
        **fields,
    )
    NOW.set(subject, verdict if applied else left)
    return applied


def latch(key: Hashable, reason_code: str) -> None:
    if not events.is_compiling():
        latched.setdefault(key, reason_code)


def reset_latches() -> None:
    """Forget every latched site (tests; and after deactivate nothing should stay latched)."""
    NOW.latched.clear()


def mask_dtype_ok(mask_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    return (
        mask_dtype is dtype
        or mask_dtype is _BOOL
        or mask_dtype is _FP32
        or not mask_dtype.is_floating_point
    )


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
    None), ``left_alone(entry, args)`` (said when the kernel's own error is not one the guard
    recovers from), ``same_call_twin`` (the twin is the library's own call less the kernel's
    restriction, as SDPA free to choose its kernel for a backend forced to one: an error it
    raises is the call's own, its inputs refused under every kernel, so the kernel's own error
    stands and no change is announced), ``family`` (what the kernel behind it is) and
    ``convention`` (how it is called, where its kind does not say: ``"diffusers"``), which the
    numbers check (:mod:`attnguard.verify`) reads.
    """

    # No ``__slots__`` here, nor on GuardedCall and InForce: these objects are read on the traced
    # path, and torch.compile of torch 2.4 cannot follow a slot (each read is opaque to it: a
    # method held in one cannot be called, a list in one cannot be changed, its truth is
    # unknown), which breaks the graph there, and fails ``fullgraph=True``.

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
        same_call_twin: bool = False,
        family: Family | None = None,
        convention: str = "",
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
        self.same_call_twin = same_call_twin
        # what the kernel behind it is, and how it is called: the numbers check's reference
        # (attnguard.verify; "" convention: the one its kind implies)
        self.family = family
        self.convention = convention
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


class GuardedCall:
    """One call's arguments, as the caller passed them: read, replaced, and invoked again
    (no ``__slots__``: see :class:`Entry`)."""

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
