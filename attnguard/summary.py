"""One story across ranks: the exit summary of a distributed job and ``attnguard summary FILES``.

At exit (``events._at_exit`` calls :func:`emit_exit_summary`):

* not distributed, or the process group is gone (``destroy_process_group`` ran first: atexit
  handlers run after the user's code) -> this process's own ``summary`` (``site="process"``);
* torch.distributed initialised with world size > 1 -> every rank posts its counts to the process
  group's key-value store; rank 0 waits (at most :data:`GATHER_TIMEOUT_S`) and emits one
  ``summary`` with ``site="job"`` aggregated over all ranks (counts per event and reason, which
  ranks). Ranks other than 0 emit nothing once their counts are posted: the job's story appears
  once. A rank that cannot post, or rank 0 when the store fails, falls back to its own summary.

Why the store and not ``all_gather_object``: a collective at exit hangs for the process group's
timeout (10-30 minutes) as soon as one rank does not reach it (a rank that crashed, runs without
attnguard, or destroyed its group). Store writes never block and rank 0's wait has a deadline.

``attnguard summary FILES`` (:func:`render_files`) merges the JSON-lines files written with
``ATTNGUARD_LOG=/path/events-{rank}.jsonl`` after the fact: events grouped by (event, reason_code)
across ranks with counts, ranks, sites and what to change in your own code so the guard has
nothing left to do.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from . import events

GATHER_TIMEOUT_S = 10.0
_STORE_PREFIX = "attnguard/summary/v1/"

# --- what to change in your own code, per reason_code (data; `attnguard summary` prints it) ------
# Exact reason codes first; then (substring, hint) rules; then a default per event.
_SDPA = 'request attn_implementation="sdpa"'
HINTS: dict[str, str] = {
    # load time: why a flash backend could not run (attnguard.facts / attnguard.plan)
    "package_missing": f"install flash-attn for this torch and GPU, or {_SDPA}",
    "extension_broken": (
        "flash-attn's CUDA extension does not import (built for another torch?): reinstall it "
        f"against this torch, or {_SDPA}"
    ),
    "no_cuda": f"flash kernels need a CUDA GPU: on this machine {_SDPA}",
    "capability_too_low": f"flash-attn 2 needs an Ampere (sm80) or newer GPU: {_SDPA}",
    "version_too_old": f"upgrade flash-attn to a version transformers accepts, or {_SDPA}",
    "torch_too_old": "upgrade torch, or request a backend this torch offers",
    "probe_failed": f"flash-attn is installed but a tiny call failed on this GPU: {_SDPA}",
    "model_unsupported": f"this model class has no flash-attention support: {_SDPA}",
    "flash_needs_half": "load with dtype=torch.bfloat16 (torch_dtype= before transformers 4.56)",
    "no_native_bf16": "this GPU has no native bf16: load with dtype=torch.float16",
    "flash_needs_gpu": 'load with device_map={"": local_rank} (the model was built on the CPU)',
    "plan_mismatch": "report it: attnguard's plan and the loaded model disagree",
    # several processes (attnguard.multigpu)
    "device_map_per_rank": 'under torchrun load with device_map={"": local_rank}',
    "device_map_shared_gpus": (
        'more ranks than GPUs: load with device_map={"": local_rank % torch.cuda.device_count()}'
    ),
    "device_map_gpu_slice": (
        "give each rank its own GPUs: device_map='auto' with max_memory covering only "
        "that rank's GPUs"
    ),
    "rotary_device_mismatch": (
        "keep the rotary embedding on its inputs' device (one GPU per replica: "
        'device_map={"": local_rank}), or upgrade transformers'
    ),
    # call time (attnguard.callguard)
    "mixed_dtypes": "cast q, k, v to one dtype before the attention call",
    "mask_dtype": "build the attention mask in the dtype of q, k, v",
    "bias_dtype": "build the attention bias in the dtype of q, k, v",
    "fp32_into_flash": "run the model in bf16/fp16 (or autocast) where it calls a flash kernel",
    "device_mismatch": "compute q, k, v and the mask on one device",
    "cpu_tensors": "move the model to the GPU before calling a flash kernel, or use sdpa on CPU",
    "mask_4d": f"flash kernels take a 2D padding mask only: {_SDPA} for custom masks",
    "head_dim_unsupported": f"flash kernels take head_dim <= 256: {_SDPA}",
    "output_attentions": 'output_attentions=True needs attn_implementation="eager"',
    "fp32_input": "load the model in bf16/fp16, or keep ATTNGUARD_FP32_POLICY=fallback",
    "gpu_too_old": f"this GPU cannot run the kernel: {_SDPA}",
    "dtype_unsupported": "run the kernel in bf16/fp16 (load with dtype=torch.bfloat16)",
    "no_sdpa_kernel": "no fused SDPA kernel takes these inputs: check dtype, mask and head_dim",
    "xformers_no_operator": (
        "xformers has no working operator here (built for another torch?): reinstall xformers "
        "for this torch, or call torch.nn.functional.scaled_dot_product_attention"
    ),
    "cpu_backend": "the kernel has no CPU implementation: run on the GPU, or use sdpa on CPU",
    "no_kernel_image": "the kernel was not built for this GPU: reinstall it for this GPU",
}
HINT_RULES: tuple[tuple[str, str], ...] = (
    ("fp32", "load with dtype=torch.bfloat16 (torch_dtype= before transformers 4.56)"),
    ("float32", "load with dtype=torch.bfloat16 (torch_dtype= before transformers 4.56)"),
    ("capability", 'this GPU cannot run the kernel: request attn_implementation="sdpa"'),
    ("ampere", 'this GPU cannot run the kernel: request attn_implementation="sdpa"'),
    ("flash_attn", 'install a working flash-attn or request attn_implementation="sdpa"'),
    ("xformers", "install xformers built for this torch, or call torch's scaled_dot_product"),
    ("device_map", 'under torchrun load with device_map={"": local_rank}'),
    ("dtype", "give q, k, v one dtype (load the model in bf16/fp16)"),
    ("device", "keep the attention inputs on one device"),
)
EVENT_HINTS: dict[str, str] = {
    "backend_fallback": "request an attention backend this machine can run (attnguard doctor)",
    "backend_rerouted": 'this call cannot use the requested kernel: attn_implementation="sdpa"',
    "model_cast": "load the model in the half dtype the kernel needs (dtype=torch.bfloat16)",
    "model_placed": 'load with device_map={"": local_rank}',
    "device_map_rewritten": 'under torchrun load with device_map={"": local_rank}',
    "qkv_unified": "give q, k, v (and the bias) one dtype before the attention call",
    "tensors_aligned": "keep the module's inputs and buffers on one device",
    "kernel_error_recovered": 'the kernel fails here: request attn_implementation="sdpa"',
    "plan_mismatch": "report it (attnguard's plan and the loaded model disagree)",
    "internal_error": "report it: attnguard failed and ran your original call",
    "observed": "nothing to change (attnguard only looked)",
}


def hint_for(event: str, reason_code: str | None) -> str:
    """What to change in your own code so this event does not happen again."""
    if reason_code and reason_code in HINTS:
        return HINTS[reason_code]
    low = (reason_code or "").lower()
    for needle, hint in HINT_RULES:
        if needle in low:
            return hint
    return EVENT_HINTS.get(event, "")


# --- this process's counts and the cross-rank aggregate ------------------------------------------


def local_fields() -> dict[str, Any]:
    """``events.summary_fields()`` plus ``keys``: one entry per (event, site, reason_code)."""
    fields = events.summary_fields()
    fields["keys"] = [
        {"event": e, "site": s, "reason_code": r, "count": n}
        for (e, s, r), n in sorted(events.counts().items(), key=lambda kv: tuple(map(str, kv[0])))
        if e not in ("activated", "summary")
    ]
    return fields


def aggregate(per_rank: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Merge per-rank summary fields (as :func:`local_fields` / ``events.summary_fields`` give).

    Returns interventions / events / reasons summed over ranks, sites united, which ranks
    reported each event (``event_ranks``) and reason (``reason_ranks``), every rank's
    intervention count (``per_rank``), and ``keys`` with a per-rank count each when the inputs
    carry keys.
    """
    out: dict[str, Any] = {
        "ranks": sorted(int(r) for r in per_rank),
        "interventions": 0,
        "events": {},
        "reasons": {},
        "sites": {},
        "event_ranks": {},
        "reason_ranks": {},
        "per_rank": {},
        "keys": [],
    }
    keys: dict[tuple[str, Any, Any], dict[str, Any]] = {}
    for rank in sorted(per_rank, key=int):
        fields = per_rank[rank] or {}
        r = int(rank)
        out["interventions"] += int(fields.get("interventions", 0) or 0)
        out["per_rank"][str(r)] = int(fields.get("interventions", 0) or 0)
        for name, table, ranks in (
            ("events", out["events"], out["event_ranks"]),
            ("reasons", out["reasons"], out["reason_ranks"]),
        ):
            for key, n in (fields.get(name) or {}).items():
                table[key] = table.get(key, 0) + int(n)
                if r not in ranks.setdefault(key, []):
                    ranks[key].append(r)
        for event, sites in (fields.get("sites") or {}).items():
            merged = out["sites"].setdefault(event, [])
            merged.extend(s for s in sites if s not in merged)
        for k in fields.get("keys") or []:
            ident = (k.get("event"), k.get("site"), k.get("reason_code"))
            entry = keys.setdefault(
                ident,
                {"event": ident[0], "site": ident[1], "reason_code": ident[2], "count": 0},
            )
            entry["count"] += int(k.get("count", 0) or 0)
            entry.setdefault("ranks", {})[str(r)] = int(k.get("count", 0) or 0)
    out["keys"] = list(keys.values())
    return out


# --- exit: one summary per job -------------------------------------------------------------------


def advice(reasons: Mapping[str, int]) -> list[dict[str, Any]]:
    """What was changed, how often, why, and what to change in your own code: one row each.

    ``reasons`` maps "event:reason_code" to a count (the summary's ``reasons`` field).
    """
    rows = []
    for key, count in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        event, _, code = key.partition(":")
        if event == "observed":
            continue
        rows.append(
            {"event": event, "reason_code": code, "count": count, "hint": hint_for(event, code)}
        )
    return rows


def _story(head: str, rows: list[dict[str, Any]]) -> str:
    """The summary's reason: a headline, then each change with its count and the fix."""
    if not rows:
        return head
    parts = [f"{r['event']} x{r['count']} ({r['reason_code']}): {r['hint']}" for r in rows[:5]]
    more = f"; and {len(rows) - 5} more" if len(rows) > 5 else ""
    return f"{head}. To no longer need the guard: " + "; ".join(parts) + more


def _emit_local() -> None:
    fields = local_fields()
    n = fields["interventions"]
    rows = advice(fields["reasons"])
    head = f"{n} intervention(s) by attnguard in this process" if n else "no interventions"
    events.emit(
        "summary",
        site="process",
        reason_code="exit",
        reason=_story(head, rows),
        advice=rows,
        **fields,
    )


def _emit_job(per_rank: Mapping[int, Mapping[str, Any]], world_size: int) -> None:
    fields = aggregate(per_rank)
    missing = [r for r in range(world_size) if r not in fields["ranks"]]
    n = fields["interventions"]
    reason = (
        f"{n} intervention(s) by attnguard over {len(fields['ranks'])} of {world_size} ranks"
        if n
        else f"no interventions on {len(fields['ranks'])} of {world_size} ranks"
    )
    if missing:
        reason += f" (no report from rank(s) {', '.join(map(str, missing))})"
    rows = advice(fields["reasons"])
    events.emit(
        "summary",
        site="job",
        reason_code="exit_all_ranks",
        reason=_story(reason, rows),
        missing_ranks=missing,
        advice=rows,
        **fields,
    )


def _live_group() -> Any:
    """torch.distributed's module when a default process group is up (never imports torch)."""
    if "torch" not in sys.modules:
        return None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist
    except Exception:
        pass
    return None


def gather_over_store(
    dist: Any, fields: Mapping[str, Any], timeout_s: float | None = None
) -> dict[int, dict[str, Any]] | None:
    """Post this rank's fields to the default group's store; on rank 0 collect every rank's.

    Returns the per-rank dict on rank 0 (ranks that did not post within ``timeout_s`` are absent),
    an empty dict on other ranks after posting, None when the store cannot be used.
    """
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"{_STORE_PREFIX}{rank}", json.dumps(dict(fields), default=str))
    if rank != 0:
        return {}
    deadline = time.monotonic() + (GATHER_TIMEOUT_S if timeout_s is None else timeout_s)
    got: dict[int, dict[str, Any]] = {}
    for r in range(world):
        key = f"{_STORE_PREFIX}{r}"
        left = deadline - time.monotonic()
        try:
            store.wait([key], timedelta(seconds=max(left, 0.001)))
            got[r] = json.loads(store.get(key))
        except Exception:
            continue  # this rank did not report in time: named as missing in the summary
    return got


def emit_exit_summary(timeout_s: float | None = None) -> None:
    """The exit report: aggregated on rank 0 of a live process group, else this process's own."""
    dist = _live_group()
    if dist is None:
        _emit_local()
        return
    try:
        got = gather_over_store(dist, local_fields(), timeout_s)
    except Exception:
        got = None
    if got is None:
        _emit_local()
    elif got:
        _emit_job(got, dist.get_world_size())
    # other ranks: posted to rank 0, which tells the story once


# --- `attnguard summary FILES` -------------------------------------------------------------------


def _rank_of(record: Mapping[str, Any]) -> int | None:
    try:
        return int(record["rank"])
    except (KeyError, TypeError, ValueError):
        return None


def read_files(paths: Iterable[str]) -> dict[str, Any]:
    """Parse JSON-lines event files; malformed lines are counted per file, never fatal."""
    records: list[dict[str, Any]] = []
    malformed: dict[str, int] = {}
    unreadable: dict[str, str] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        rec = None
                    if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
                        malformed[path] = malformed.get(path, 0) + 1
                        continue
                    records.append(rec)
        except OSError as exc:
            unreadable[path] = f"{type(exc).__name__}: {exc.strerror or exc}"
    return {"records": records, "malformed": malformed, "unreadable": unreadable}


def merge_records(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts per (event, reason_code) over ranks, from event lines and summaries.

    An event line says the event happened at least ``count`` times on its rank; a summary (a
    rank's own, or rank 0's job summary with per-rank keys) gives the final counts. Per rank and
    (event, site, reason_code) the largest figure wins, so nothing is counted twice.
    """
    per_key: dict[tuple[int | None, str, Any, Any], int] = {}
    ranks_seen: set[int] = set()
    summaries = 0
    job_summaries: list[dict[str, Any]] = []

    def bump(rank: int | None, event: str, site: Any, reason: Any, n: Any) -> None:
        try:
            n = int(n)
        except (TypeError, ValueError):
            n = 1
        key = (rank, event, site, reason)
        per_key[key] = max(per_key.get(key, 0), n)

    for rec in records:
        rank = _rank_of(rec)
        if rank is not None:
            ranks_seen.add(rank)
        event = rec["event"]
        if event == "summary":
            summaries += 1
            for k in rec.get("keys") or []:
                if not isinstance(k, dict) or not isinstance(k.get("event"), str):
                    continue
                by_rank = k.get("ranks")
                if isinstance(by_rank, dict):  # a job summary: per-rank counts inside
                    for r, n in by_rank.items():
                        try:
                            ranks_seen.add(int(r))
                            bump(int(r), k["event"], k.get("site"), k.get("reason_code"), n)
                        except (TypeError, ValueError):
                            continue
                else:
                    bump(rank, k["event"], k.get("site"), k.get("reason_code"), k.get("count"))
            if rec.get("site") == "job":
                job_summaries.append(dict(rec))
            continue
        if event == "activated":
            continue
        bump(rank, event, rec.get("site"), rec.get("reason_code"), rec.get("count", 1))

    rows: dict[tuple[str, Any], dict[str, Any]] = {}
    for (rank, event, site, reason), n in per_key.items():
        row = rows.setdefault(
            (event, reason),
            {"event": event, "reason_code": reason, "count": 0, "ranks": [], "sites": []},
        )
        row["count"] += n
        if rank is not None and rank not in row["ranks"]:
            row["ranks"].append(rank)
        if site is not None and site not in row["sites"]:
            row["sites"].append(site)
    out_rows = []
    for row in sorted(rows.values(), key=lambda r: (r["event"], str(r["reason_code"]))):
        row["ranks"].sort()
        row["hint"] = hint_for(row["event"], row["reason_code"])
        out_rows.append(row)
    return {
        "ranks": sorted(ranks_seen),
        "rows": out_rows,
        "interventions": sum(r["count"] for r in out_rows if r["event"] != "observed"),
        "summaries": summaries,
        "job_summaries": len(job_summaries),
    }


def _ranks_text(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    spans: list[list[int]] = []
    for r in ranks:
        if spans and r == spans[-1][1] + 1:
            spans[-1][1] = r
        else:
            spans.append([r, r])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def render_files(paths: Iterable[str], as_json: bool) -> str:
    """``attnguard summary FILES``: one report over per-rank JSON-lines event files."""
    paths = list(paths)
    parsed = read_files(paths)
    merged = merge_records(parsed["records"])
    report = {
        "files": paths,
        "records": len(parsed["records"]),
        "malformed_lines": parsed["malformed"],
        "unreadable_files": parsed["unreadable"],
        **merged,
    }
    if as_json:
        return json.dumps(report, indent=2, default=str)
    lines = [
        f"attnguard summary: {len(paths)} file(s), {len(parsed['records'])} event(s), "
        f"ranks {_ranks_text(merged['ranks'])}, {merged['interventions']} intervention(s)"
    ]
    for path, n in parsed["malformed"].items():
        lines.append(f"  skipped {n} malformed line(s) in {path}")
    for path, why in parsed["unreadable"].items():
        lines.append(f"  could not read {path}: {why}")
    if not merged["rows"]:
        lines.append("no events besides activation and summaries: nothing to change")
        return "\n".join(lines)
    header = ("event", "reason_code", "count", "ranks", "sites")
    table = [
        (
            r["event"],
            str(r["reason_code"] or "-"),
            str(r["count"]),
            _ranks_text(r["ranks"]),
            ", ".join(map(str, r["sites"])) or "-",
        )
        for r in merged["rows"]
    ]
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    lines.append("")
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip())
    lines.append("  ".join("-" * w for w in widths))
    for t in table:
        lines.append("  ".join(c.ljust(w) for c, w in zip(t, widths, strict=True)).rstrip())
    hints = [(r["event"], r["reason_code"], r["hint"]) for r in merged["rows"] if r["hint"]]
    if hints:
        lines.append("")
        lines.append("what to change in your own code:")
        for event, reason, hint in hints:
            lines.append(f"  {reason or event}: {hint}")
    return "\n".join(lines)
