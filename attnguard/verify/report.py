"""What a mismatch says: one ``numerics_mismatch`` event per call site and reason (repeats counted),
and in strict mode an :class:`attnguard.errors.AttnGuardError` (the call's result is never
changed: in fix and warn mode the kernel's output is returned as it is)."""

from __future__ import annotations

from typing import Any

from ..errors import AttnGuardError
from ..observability import events
from .calls import Call
from .compare import Outcome
from .references import TWIN


def mismatch(
    entry: Any,
    call: Call,
    outcome: Outcome,
    *,
    site: str,
    by: str,
    reference: str,
    settings: Any,
    kernel_name: str,
    source: str,
) -> None:
    """Say that ``call``'s output is not what its family's reference computes."""
    code = "twin_numbers_differ" if by == TWIN else "kernel_numbers_differ"
    who = "attnguard's SDPA twin" if by == TWIN else kernel_name
    family = call.family.value if call.family is not None else None
    reason = (
        f"{who} gave other numbers than the {family} reference ({reference}) on a sampled "
        f"{call.name} call: max error {outcome.max_error:.3g} "
        f"({outcome.ratio:.3g}x the tolerance), relative norm {outcome.rel_norm:.3g}"
        + (f", correlation {outcome.correlation:.4f}" if outcome.correlation is not None else "")
        + f"; failed: {', '.join(outcome.failed)}; the call's output is returned unchanged"
    )
    q = call.named.get("q", call.named.get("qkv", call.named.get("query")))
    fields: dict[str, Any] = {
        "kernel": kernel_name,
        "family": family,
        "source": source,
        "computed_by": by,
        "reference": reference,
        "function": call.name,
        "dtype": str(getattr(q, "dtype", call.q.dtype)).removeprefix("torch."),
        "device": str(call.q.device),
        "shapes": {
            "q": list(call.q.shape),
            "k": list(call.k.shape),
            "v": list(call.v.shape),
        },
        "arguments": call.matters,
        **outcome.fields(),
    }
    try:
        events.emit("numerics_mismatch", site=site, reason_code=code, reason=reason, **fields)
    except Exception:
        pass  # a logging failure must never fail the user's call
    if settings.mode == "strict":
        raise AttnGuardError(code, reason, "say it and return the kernel's output as it is")
