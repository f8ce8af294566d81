"""Which flash implementations attnguard's twins serve in this process (the table of what computes
now: :data:`attnguard.computing.NOW`), the arguments they compute there, and saying so once."""

from __future__ import annotations

import sys
from typing import Any

from ... import kernel_identity, runtime
from ...computing import NOW, subject
from ...kernels import Kernel, Verdict
from . import twin_calls
from .flash_state import FA2_REQUEST, SITE, clear_lazy_cache, family_of, ledger, state
from .wiring import GLOBALS


def announced(implementation: str, reason_code: str, problem: str, change: str) -> None:
    """A load-time ``backend_fallback`` (the plan's ``flash-on-sdpa`` row) said the twins compute
    ``implementation``'s flash path: the table of what computes now records it."""
    NOW.set(
        subject("transformers", implementation),
        Verdict(_identity(implementation), True, "flash-on-sdpa", reason_code, problem, change),
    )


def _identity(implementation: str) -> kernel_identity.KernelId:
    found = kernel_identity.of_request(implementation)
    return found or kernel_identity.KernelId(implementation, kernel_identity.Source.PACKAGE, None)


def announce(implementation: str) -> None:
    """Say once that the flash path's kernels are the twins, unless a load already said so (a
    model loaded before attnguard was active, or switched to flash by hand, arrives here)."""
    from ... import facts
    from ...failopen import report_internal_error
    from ...observability import events

    try:
        if kernel_identity.hub_repo(implementation):  # its loader said so when it failed
            return
        row = subject("transformers", implementation)
        if NOW.get(row) is not None:
            return
        status = facts.current(runtime.settings()).backend(implementation)
        problem = f"{implementation} calls: {status.reason}"
        change = (
            "attnguard's SDPA twins of the flash-attn functions compute transformers' flash "
            "code path (same semantics)"
        )
        NOW.set(
            row,
            Verdict(
                _identity(implementation),
                True,
                "flash-on-sdpa",
                status.reason_code,
                problem,
                change,
            ),
        )
        events.emit(
            "backend_fallback",
            site=SITE,
            reason_code=status.reason_code,
            reason=f"{problem}; {change}",
            requested=implementation,
            selected=Kernel.SDPA_TWIN.value,
            attn_implementation=implementation,
            slower=False,
            applied=True,
        )
    except Exception as exc:
        report_internal_error(SITE, exc)


def computed_for(implementation: Any = FA2_REQUEST) -> frozenset[str]:
    """The keyword arguments of a flash registry call that transformers' flash path computes on
    the twins of ``implementation``'s family (:mod:`.arguments`)."""
    from . import arguments

    family = family_of(implementation)
    with state.lock:
        missed = getattr(state.probes.get(family), "uncomputed", None) or {}
        return arguments.computed_arguments(state.wiring, set(missed), family)


def refresh_serving() -> None:
    """What the twins compute, read again (a probe has run)."""
    from . import arguments

    computed_for()  # flash-attn 2's, the default of arguments.computed_arguments()
    arguments.TWIN_ASIDE.clear()  # judged against the arguments computed before
    for implementation in list(NOW.twin_arguments):
        NOW.twin_arguments[implementation] = computed_for(implementation)


def serving(implementation: str) -> None:
    """The twins serve ``implementation``'s flash path from now on (a flash_attention_N or a hub
    kernel that did not load): its registry calls are checked for arguments the twins would not
    compute (:mod:`.arguments`)."""
    from . import arguments

    families_before = len(arguments._computed)
    NOW.twin_arguments[implementation] = computed_for(implementation)
    if len(arguments._computed) != families_before:  # another family: judged again
        arguments.TWIN_ASIDE.clear()
    watch_masks()


def watch_masks() -> None:
    """Watch whether transformers' own mask code holds packed rows apart (the exit summary's
    advice: :mod:`.twin_calls`), from the first flash request on (its model's module imported the
    mask code; its first forward builds a mask before any flash call)."""
    twin_calls.watch_masks(sys.modules.get(twin_calls.MASKS), ledger)


def stop_serving(implementation: str) -> None:
    """``implementation``'s kernel loaded after all (a hub kernel the library tried again): the
    twins no longer serve it, and the flash path resolves its kernels again at its next call."""
    NOW.twin_arguments.pop(implementation, None)
    module, wired = state.module, state.wiring
    if module is not None and wired is not None and wired.layout != GLOBALS:
        clear_lazy_cache(module, wired)
