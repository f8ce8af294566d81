"""The words of a summary: what to change in your own code, the headline and the story.

Shared by the exit summary (:mod:`attnguard.observability.summary`) and ``attnguard summary FILES``
(:mod:`attnguard.observability.eventfiles`). Pure functions of counts; nothing here reads or writes files.

Every count is split by what it means: ``applied`` (attnguard changed something),
``would_have`` (a change it reported but did not make: warn or strict mode), ``observed`` (it
looked and changed nothing) and ``internal_errors`` (it failed and ran the original call).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .advice import Facts
from .events import KINDS

# One hint per reason code lives in attnguard.observability.reasons (the vocabulary); codes it does not know
# (files written by another version of attnguard) get their event's general hint.
EVENT_HINTS: dict[str, str] = {
    "backend_fallback": "request an attention backend this machine can run (attnguard doctor)",
    "backend_rerouted": "this call cannot use the requested kernel here (attnguard doctor says why)",
    "model_cast": "load the model in the half dtype the kernel needs (dtype=torch.bfloat16)",
    "model_placed": 'load with device_map={"": local_rank}',
    "device_map_rewritten": 'under torchrun load with device_map={"": local_rank}',
    "qkv_unified": "give q, k, v (and the bias) one dtype before the attention call",
    "tensors_aligned": "keep the module's inputs and buffers on one device",
    "kernel_error_recovered": "the kernel fails here: reinstall it for this torch and GPU, or "
    "request a backend this machine can run (attnguard doctor)",
    "plan_mismatch": "report it (attnguard's plan and the loaded model disagree)",
    "internal_error": "report it: attnguard failed and ran your original call",
    "observed": "nothing to change (attnguard only looked)",
}


def hint_for(event: str, reason_code: str | None, facts: Facts | None = None) -> str:
    """What to change in your own code so this event does not happen again, for what happened
    (``facts``: :mod:`attnguard.observability.advice`; None: what holds on any machine)."""
    from .reasons import hint_for as vocabulary_hint

    return vocabulary_hint(event, reason_code, facts) or EVENT_HINTS.get(event, "")


def kinds_of(tally: Mapping[str, Any] | None) -> dict[str, int]:
    """The four kind counts of a tally (missing or unreadable ones are 0)."""
    out = dict.fromkeys(KINDS, 0)
    for k in KINDS:
        value = (tally or {}).get(k, 0)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[k] = value
    return out


def advice(keys: Iterable[Mapping[str, Any]], facts: Facts | None = None) -> list[dict[str, Any]]:
    """What was changed (or would have been), how often, why, and what to change in your own
    code (for what happened: ``facts``): one row per (event, reason_code), from summary
    ``keys``; observations without a change are left out."""
    rows: dict[tuple[str, Any], dict[str, Any]] = {}
    sites: dict[tuple[str, Any], set[Any]] = {}
    for k in keys:
        event = k.get("event")
        if not isinstance(event, str) or event == "observed":
            continue
        row = rows.setdefault(
            (event, k.get("reason_code")),
            {"event": event, "reason_code": k.get("reason_code"), "count": 0}
            | dict.fromkeys(KINDS, 0),
        )
        sites.setdefault((event, k.get("reason_code")), set()).add(k.get("site"))
        row["count"] += int(k.get("count", 0) or 0)
        for kind, n in kinds_of(k).items():
            row[kind] += n
    out = []
    for key, row in sorted(
        rows.items(), key=lambda kv: (-kv[1]["count"], kv[1]["event"], str(kv[1]["reason_code"]))
    ):
        # the words of the library that made these requests (transformers' or diffusers')
        row["hint"] = hint_for(
            row["event"], row["reason_code"], (facts or Facts()).for_sites(sites[key])
        )
        out.append(row)
    return out


def _row_text(row: Mapping[str, Any]) -> str:
    applied, would = row["applied"], row["would_have"]
    if applied and would:
        what = f"x{applied} applied, x{would} not applied"
    elif would:
        what = f"x{would} not applied"
    else:
        what = f"x{row['count']}"
    return f"{row['event']} {what} ({row['reason_code']}): {row['hint']}"


def headline(totals: Mapping[str, Any], scope: str) -> str:
    """One sentence with the kind totals: what was applied, what only would have been."""
    a, w, o, e = (kinds_of(totals)[k] for k in KINDS)
    text = f"{a} change(s) applied by attnguard {scope}"
    if w:
        text += f"; {w} more it would have applied in fix mode (not applied)"
    if o:
        text += f"; {o} observation(s) without a change"
    if e:
        text += f"; {e} internal error(s), where the original call ran unguarded"
    return text


def story(head: str, rows: list[dict[str, Any]]) -> str:
    """The summary's reason: a headline, then each change with its count and the fix."""
    if not rows:
        return head
    parts = [_row_text(r) for r in rows[:5]]
    more = f"; and {len(rows) - 5} more" if len(rows) > 5 else ""
    return f"{head}. To no longer need the guard: " + "; ".join(parts) + more


def level(totals: Mapping[str, Any]) -> str:
    """A summary is a warning when it reports applied changes, else info (quiet by default)."""
    return "warning" if kinds_of(totals)["applied"] else "info"


def ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    if not ranks:
        return "-"
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
