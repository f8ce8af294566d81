"""Reading captured events: the schema's fixed fields, the names in order, (event, reason_code)."""

from __future__ import annotations

from typing import Any

# Every event's fixed fields, in order: the schema as users read it (spelled out, not imported
# from attnguard, so a change there has to change this too).
FIXED = [
    "schema",
    "event",
    "level",
    "ts",
    "pid",
    "proc",
    "host",
    "rank",
    "local_rank",
    "world_size",
    "mode",
    "site",
    "reason_code",
    "reason",
    "count",
]


def names(evts: list[dict[str, Any]], *, skip: tuple[str, ...] = ("activated",)) -> list[str]:
    """Event names in order, without bookkeeping events."""
    return [e["event"] for e in evts if e["event"] not in skip]


def reasons(evts: list[dict[str, Any]], *, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(event, reason_code) of each event in order, without the events named in ``skip``."""
    return [(e["event"], e["reason_code"]) for e in evts if e["event"] not in skip]


def only(evts: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    """The events named ``name``, in order."""
    return [e for e in evts if e["event"] == name]
