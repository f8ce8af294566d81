"""Reading captured events: the schema's fixed fields, the names in order, (event, reason_code)."""

from __future__ import annotations

import json
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


# One event of each level (nested fields too): (event, the level it must have, its OpenTelemetry
# severity text, the fields passed to emit)
OTEL_CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    (
        "backend_fallback",
        "warning",
        "WARN",
        {
            "site": "transformers.load",
            "reason_code": "package_missing",
            "reason": "flash-attn is not installed; loading Qwen2ForCausalLM with sdpa",
            "model": "Qwen2ForCausalLM",
            "requested": "flash_attention_2",
            "selected": "sdpa",
            "applied": True,
        },
    ),
    (
        "observed",
        "info",
        "INFO",
        {
            "site": "transformers.load",
            "reason_code": "zero3_init",
            "reason": "model built under ZeRO-3 init; observing only",
            "model": "LlamaForCausalLM",
            "applied": False,
        },
    ),
    (
        "internal_error",
        "error",
        "ERROR",
        {
            "site": "flash_attn.flash_attn_func",
            "reason_code": "KeyError",
            "reason": "attnguard failed internally and ran the original call unguarded: 'q'",
            "exception": "KeyError",
        },
    ),
    (  # nested fields: lists and dicts (OTel log attributes take them since SDK 1.33)
        "tensors_aligned",
        "warning",
        "WARN",
        {
            "site": "rotary:LlamaRotaryEmbedding",
            "reason_code": "rotary_device_mismatch",
            "reason": "LlamaRotaryEmbedding got inputs on cuda:1 but inv_freq on cuda:0; moved",
            "moved": ["inv_freq", "position_ids"],
            "before": {"inv_freq": "cuda:0", "position_ids": "cuda:0"},
            "applied": True,
        },
    ),
]


def json_lines(text: str) -> list[dict[str, Any]]:
    """attnguard's records among a stream's lines (the JSON objects of schema 1)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("schema") == 1:
                out.append(rec)
    return out
