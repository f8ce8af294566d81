"""One story across ranks: the exit summary of a distributed job and ``attnguard summary FILES``.

Every count is split by what it means: ``applied`` (attnguard changed something),
``would_have`` (a change it reported but did not make: warn or strict mode), ``observed`` (it
looked and changed nothing) and ``internal_errors`` (it failed and ran the original call).

At exit (``events._at_exit`` calls :func:`emit_exit_summary`):

* a single process (``WORLD_SIZE`` 1 or unset) -> this process's own ``summary``
  (``site="process"``);
* a rank of a job under a launcher (``WORLD_SIZE`` > 1) -> one ``summary`` for the whole job
  (``site="job"``) from rank 0, counted over every rank that reported, naming the ones that did
  not; the other ranks emit none. The counts travel through the process group's key-value store
  when a group is up at exit, else through files (a rendezvous directory keyed by the job: the
  ``ATTNGUARD_LOG`` file's directory when one is set, else a per-user temp directory). Rank 0
  waits at most :data:`GATHER_TIMEOUT_S` for the others. When neither can be had (no job
  identity from the launcher, ranks on several nodes without a shared ``ATTNGUARD_LOG``
  directory, an unusable directory or store), rank 0 emits its own process summary saying why,
  and every other rank its own, off the console;
* a helper process (a DataLoader worker, a tool run by a guarded program) -> its own summary only
  when it changed or would have changed something; it never takes part in the job's.

Why not ``all_gather_object``: a collective at exit hangs for the process group's timeout (10-30
minutes) as soon as one rank does not reach it (a rank that crashed, runs without attnguard, or
destroyed its group). Store and file writes never block, and rank 0's wait has a deadline.

``attnguard summary FILES`` (:func:`render_files`) merges the JSON-lines files written with
``ATTNGUARD_LOG=/path/events-{rank}.jsonl`` after the fact: events grouped by (event, reason_code)
across ranks with counts (applied, would have, observed), ranks, sites and what to change in
your own code so the guard has nothing left to do.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

from . import events
from .events import KINDS

GATHER_TIMEOUT_S = 10.0
_STORE_PREFIX = "attnguard/summary/v1/"
# What identifies one run of a job, the same on every rank (torchrun / torch.distributed.run).
JOB_VARS = (
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
)

# --- what to change in your own code ---------------------------------------------------------------
# One hint per reason code lives in attnguard.reasons (the vocabulary); codes it does not know
# (files written by another version of attnguard) get their event's general hint.
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
    from .reasons import hint_for as vocabulary_hint

    return vocabulary_hint(event, reason_code) or EVENT_HINTS.get(event, "")


# --- this process's counts and the cross-rank aggregate ------------------------------------------


def _kinds_of(tally: Mapping[str, Any] | None) -> dict[str, int]:
    out = dict.fromkeys(KINDS, 0)
    for k in KINDS:
        try:
            out[k] = int((tally or {}).get(k, 0) or 0)
        except (TypeError, ValueError):
            pass
    return out


def local_fields() -> dict[str, Any]:
    """``events.summary_fields()`` plus ``keys``: one entry per (event, site, reason_code) with
    its count and how many of those were applied / would_have / observed / internal_errors."""
    fields = events.summary_fields()
    kinds = events.kind_counts()
    fields["keys"] = [
        {"event": e, "site": s, "reason_code": r, "count": n, **_kinds_of(kinds.get((e, s, r)))}
        for (e, s, r), n in sorted(events.counts().items(), key=lambda kv: tuple(map(str, kv[0])))
        if e not in ("activated", "summary")
    ]
    return fields


def aggregate(per_rank: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """Merge per-rank summary fields (as :func:`local_fields` / ``events.summary_fields`` give).

    Returns the kind totals (applied / would_have / observed / internal_errors) and events /
    reasons summed over ranks, sites united, which ranks reported each event (``event_ranks``)
    and reason (``reason_ranks``), every rank's kind totals (``per_rank``), and ``keys`` with a
    count per rank (``ranks``) and kind totals each when the inputs carry keys.
    """
    out: dict[str, Any] = {
        "ranks": sorted(int(r) for r in per_rank),
        **dict.fromkeys(KINDS, 0),
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
        totals = _kinds_of(fields)
        out["per_rank"][str(r)] = totals
        for k in KINDS:
            out[k] += totals[k]
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
                {
                    "event": ident[0],
                    "site": ident[1],
                    "reason_code": ident[2],
                    "count": 0,
                    **dict.fromkeys(KINDS, 0),
                    "ranks": {},
                    "rank_kinds": {},
                },
            )
            n = int(k.get("count", 0) or 0)
            entry["count"] += n
            entry["ranks"][str(r)] = n
            tally = _kinds_of(k)
            entry["rank_kinds"][str(r)] = tally
            for kind in KINDS:
                entry[kind] += tally[kind]
    out["keys"] = list(keys.values())
    return out


# --- the report's words --------------------------------------------------------------------------


def advice(keys: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """What was changed (or would have been), how often, why, and what to change in your own
    code: one row per (event, reason_code), from summary ``keys``; observations without a
    change are left out."""
    rows: dict[tuple[str, Any], dict[str, Any]] = {}
    for k in keys:
        event = k.get("event")
        if not isinstance(event, str) or event == "observed":
            continue
        row = rows.setdefault(
            (event, k.get("reason_code")),
            {"event": event, "reason_code": k.get("reason_code"), "count": 0}
            | dict.fromkeys(KINDS, 0),
        )
        row["count"] += int(k.get("count", 0) or 0)
        for kind, n in _kinds_of(k).items():
            row[kind] += n
    out = []
    for row in sorted(
        rows.values(), key=lambda r: (-r["count"], r["event"], str(r["reason_code"]))
    ):
        row["hint"] = hint_for(row["event"], row["reason_code"])
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
    a, w, o, e = (int(totals.get(k, 0) or 0) for k in KINDS)
    text = f"{a} change(s) applied by attnguard {scope}"
    if w:
        text += f"; {w} more it would have applied in fix mode (not applied)"
    if o:
        text += f"; {o} observation(s) without a change"
    if e:
        text += f"; {e} internal error(s), where the original call ran unguarded"
    return text


def _story(head: str, rows: list[dict[str, Any]]) -> str:
    """The summary's reason: a headline, then each change with its count and the fix."""
    if not rows:
        return head
    parts = [_row_text(r) for r in rows[:5]]
    more = f"; and {len(rows) - 5} more" if len(rows) > 5 else ""
    return f"{head}. To no longer need the guard: " + "; ".join(parts) + more


def _level(totals: Mapping[str, Any]) -> str:
    """A summary is a warning when it reports applied changes, else info (quiet by default)."""
    return "warning" if int(totals.get("applied", 0) or 0) else "info"


# --- exit: one summary per job -------------------------------------------------------------------


def _emit_local(note: str | None = None, console: bool = True) -> None:
    fields = local_fields()
    if events.is_helper() and not (fields["applied"] or fields["would_have"]):
        return  # a helper that changed nothing stays silent
    rows = advice(fields["keys"])
    head = headline(fields, "in this process")
    if note:
        head += f" ({note})"
    events.emit(
        "summary",
        site="process",
        reason_code="exit",
        reason=_story(head, rows),
        level=_level(fields),
        console=console,
        advice=rows,
        **fields,
    )


def _emit_job(per_rank: Mapping[int, Mapping[str, Any]], world_size: int, via: str) -> None:
    fields = aggregate(per_rank)
    missing = [r for r in range(world_size) if r not in fields["ranks"]]
    head = headline(fields, f"over {len(fields['ranks'])} of {world_size} ranks")
    if missing:
        head += f" (no report from rank(s) {', '.join(map(str, missing))})"
    rows = advice(fields["keys"])
    events.emit(
        "summary",
        site="job",
        reason_code="exit_all_ranks",
        reason=_story(head, rows),
        level=_level(fields),
        missing_ranks=missing,
        gathered_by=via,
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
    an empty dict on other ranks after posting. Raises when the store cannot be used.
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


class JobSummaryUnavailable(Exception):
    """Why a job-wide summary cannot be gathered through files (the text is shown to users)."""


def _user_temp_dir() -> str:
    try:
        user = str(os.getuid())
    except AttributeError:  # no uid on this platform
        import getpass

        user = getpass.getuser()
    base = os.path.join(tempfile.gettempdir(), f"attnguard-{user}")
    os.makedirs(base, mode=0o700, exist_ok=True)
    st = os.lstat(base)
    if not os.path.isdir(base) or os.path.islink(base):
        raise JobSummaryUnavailable(f"{base} is not a directory")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise JobSummaryUnavailable(f"{base} belongs to another user")
    return base


def job_dir(environ: Mapping[str, str] | None = None) -> str:
    """The directory where this job's ranks leave their counts at exit (created here).

    Under the ATTNGUARD_LOG file's directory (the part before any placeholder) when a log file
    is set, else a per-user temp directory (one node only); named after the job's identity.
    """
    env = os.environ if environ is None else environ
    if not (env.get("TORCHELASTIC_RUN_ID") or env.get("MASTER_PORT")):
        raise JobSummaryUnavailable(
            "no process group at exit and the launcher set neither TORCHELASTIC_RUN_ID nor "
            "MASTER_PORT, which tell this job's ranks apart"
        )
    files = [t for t in events._state.settings.log_targets if t != "stderr"]
    if files:
        base = os.path.dirname(os.path.abspath(files[0]))
        while "{" in base:
            base = os.path.dirname(base)
    else:
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            local = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
        except ValueError:
            world = local = 1
        if local < world:
            raise JobSummaryUnavailable(
                "no process group at exit and ranks on several nodes: set ATTNGUARD_LOG to a "
                "file path on a shared file system for a job-wide summary"
            )
        base = _user_temp_dir()
    ident = "\0".join(env.get(v, "") for v in JOB_VARS)
    path = os.path.join(base, ".attnguard-job-" + hashlib.sha256(ident.encode()).hexdigest()[:16])
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise JobSummaryUnavailable(f"cannot create {path}: {exc.strerror or exc}") from None
    return path


def gather_over_files(
    rank: int, world: int, fields: Mapping[str, Any], timeout_s: float | None = None
) -> dict[int, dict[str, Any]]:
    """Ranks other than 0 leave their fields in :func:`job_dir` (atomically) and get ``{}``;
    rank 0 collects every rank's (its own included), waiting at most ``timeout_s``, and removes
    what it read. Files older than this process (a previous run of the same job) are ignored.
    Raises JobSummaryUnavailable when the directory cannot be used."""
    path = job_dir()
    if rank != 0:
        tmp = os.path.join(path, f".rank-{rank}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(dict(fields), fh, default=str)
            os.replace(tmp, os.path.join(path, f"rank-{rank}.json"))
        except OSError as exc:
            raise JobSummaryUnavailable(f"cannot write to {path}: {exc.strerror or exc}") from None
        return {}
    got: dict[int, dict[str, Any]] = {0: dict(fields)}
    deadline = time.monotonic() + (GATHER_TIMEOUT_S if timeout_s is None else timeout_s)
    fresh_after = events.STARTED - 2.0  # file times may be coarse
    while True:
        for r in range(1, world):
            if r in got:
                continue
            name = os.path.join(path, f"rank-{r}.json")
            try:
                if os.stat(name).st_mtime < fresh_after:
                    os.remove(name)  # left by an earlier run of the same job
                    continue
                with open(name, encoding="utf-8") as fh:
                    got[r] = json.load(fh)
                os.remove(name)
            except (OSError, ValueError):
                continue
        if len(got) == world or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    try:
        os.rmdir(path)
    except OSError:
        pass  # a late rank's file stays; the next run of this job ignores it
    return got


def emit_exit_summary(timeout_s: float | None = None) -> None:
    """The exit report: one for the job from rank 0 under a launcher, else this process's own."""
    if events.is_helper():
        _emit_local()
        return
    ctx = events.launch_context()
    if ctx["world_size"] <= 1:
        _emit_local()
        return
    dist = _live_group()
    if dist is not None:
        rank, world, via = dist.get_rank(), dist.get_world_size(), "process_group"
        try:
            got = gather_over_store(dist, local_fields(), timeout_s)
        except Exception as exc:
            why = f"no job-wide summary: the process group's store failed ({type(exc).__name__})"
            _emit_local(note=why, console=rank == 0)
            return
    else:
        rank, world, via = ctx["rank"], ctx["world_size"], "files"
        try:
            got = gather_over_files(rank, world, local_fields(), timeout_s)
        except JobSummaryUnavailable as exc:
            _emit_local(note=f"no job-wide summary: {exc}", console=rank == 0)
            return
    if got:
        _emit_job(got, world, via)
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


def _line_kinds(rec: Mapping[str, Any], n: int) -> dict[str, int]:
    """Kinds of an event line, which carries its first occurrence's ``applied`` flag."""
    out = dict.fromkeys(KINDS, 0)
    event, applied = rec.get("event"), rec.get("applied")
    if event == "internal_error":
        out["internal_errors"] = n
    elif event in events.OBSERVATIONS:
        out["observed"] = n
    elif isinstance(applied, bool):
        out["applied" if applied else "would_have"] = n
    else:
        out["applied" if rec.get("mode", "fix") == "fix" else "would_have"] = n
    return out


def merge_records(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts per (event, reason_code) over ranks, from event lines and summaries.

    An event line says the event happened at least ``count`` times in its process; a summary
    (a rank's own, or rank 0's job summary with per-rank keys) gives the final counts and how
    many were applied / would have been / observed. Per rank (helper processes apart) and
    (event, site, reason_code) the largest figure wins, so nothing is counted twice.
    """
    per_key: dict[tuple[Any, ...], tuple[int, dict[str, int]]] = {}
    ranks_seen: set[int] = set()
    summaries = 0
    job_summaries: list[dict[str, Any]] = []

    def bump(proc: Any, event: str, site: Any, reason: Any, n: Any, kinds: Any) -> None:
        try:
            n = int(n)
        except (TypeError, ValueError):
            n = 1
        key = (proc, event, site, reason)
        if key not in per_key or n > per_key[key][0]:
            per_key[key] = (n, kinds)

    for rec in records:
        rank = _rank_of(rec)
        if rank is not None:
            ranks_seen.add(rank)
        # a helper process (DataLoader worker, ...) counts beside its rank's main process
        proc = (rank, rec.get("pid") if rec.get("helper") else None)
        event = rec["event"]
        if event == "summary":
            summaries += 1
            for k in rec.get("keys") or []:
                if not isinstance(k, dict) or not isinstance(k.get("event"), str):
                    continue
                by_rank = k.get("ranks")
                if isinstance(by_rank, dict):  # a job summary: per-rank counts inside
                    rank_kinds = (
                        k.get("rank_kinds") if isinstance(k.get("rank_kinds"), dict) else {}
                    )
                    for r, n in by_rank.items():
                        try:
                            ranks_seen.add(int(r))
                            kinds = rank_kinds.get(r)
                            bump(
                                (int(r), None),
                                k["event"],
                                k.get("site"),
                                k.get("reason_code"),
                                n,
                                _kinds_of(kinds) if kinds else _line_kinds(k, int(n)),
                            )
                        except (TypeError, ValueError):
                            continue
                else:
                    has_kinds = any(kind in k for kind in KINDS)
                    try:
                        n = int(k.get("count", 1))
                    except (TypeError, ValueError):
                        n = 1
                    kinds = _kinds_of(k) if has_kinds else _line_kinds({**rec, **k}, n)
                    bump(proc, k["event"], k.get("site"), k.get("reason_code"), n, kinds)
            if rec.get("site") == "job":
                job_summaries.append(dict(rec))
            continue
        if event == "activated":
            continue
        try:
            n = int(rec.get("count", 1))
        except (TypeError, ValueError):
            n = 1
        bump(proc, event, rec.get("site"), rec.get("reason_code"), n, _line_kinds(rec, n))

    rows: dict[tuple[str, Any], dict[str, Any]] = {}
    for (proc, event, site, reason), (n, kinds) in per_key.items():
        row = rows.setdefault(
            (event, reason),
            {"event": event, "reason_code": reason, "count": 0}
            | dict.fromkeys(KINDS, 0)
            | {"ranks": [], "sites": []},
        )
        row["count"] += n
        for kind in KINDS:
            row[kind] += int(kinds.get(kind, 0))
        rank = proc[0]
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
        **{kind: sum(r[kind] for r in out_rows) for kind in KINDS},
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
    """``attnguard summary FILES``: one report over per-rank JSON-lines event files.

    Raises ValueError when none of the files can be read.
    """
    paths = list(paths)
    parsed = read_files(paths)
    if paths and len(parsed["unreadable"]) == len(set(paths)):
        why = "; ".join(f"{p}: {w}" for p, w in parsed["unreadable"].items())
        raise ValueError(f"attnguard summary: no readable input ({why})")
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
        f"ranks {_ranks_text(merged['ranks'])}: {headline(merged, 'in these files')}"
    ]
    for path, n in parsed["malformed"].items():
        lines.append(f"  skipped {n} malformed line(s) in {path}")
    for path, why in parsed["unreadable"].items():
        lines.append(f"  could not read {path}: {why}")
    if not merged["rows"]:
        lines.append("no events besides activation and summaries: nothing to change")
        return "\n".join(lines)
    header = ("event", "reason_code", "count", "applied", "would_have", "ranks", "sites")
    table = [
        (
            r["event"],
            str(r["reason_code"] or "-"),
            str(r["count"]),
            str(r["applied"]),
            str(r["would_have"]),
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
    hints = [
        (r["event"], r["reason_code"], r["hint"])
        for r in merged["rows"]
        if r["hint"] and r["event"] != "observed"
    ]
    if hints:
        lines.append("")
        lines.append("what to change in your own code:")
        for event, reason, hint in hints:
            lines.append(f"  {reason or event}: {hint}")
    return "\n".join(lines)
