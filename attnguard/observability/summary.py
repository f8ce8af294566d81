"""The exit summary: this process's own, or one for the whole job from its rank 0.

At exit (``events._at_exit`` calls :func:`emit_exit_summary`, registered by activation):

* a single process (``WORLD_SIZE`` 1 or unset) -> this process's own ``summary``
  (``site="process"``);
* a rank of a job (``WORLD_SIZE`` > 1, from a launcher or set later, as Ray actors do) -> one
  ``summary`` for the whole job (``site="job"``) from rank 0, counted over every rank that
  reported, naming the ones that did not; the other ranks emit none. Each rank's record travels
  through the job's key-value store (:mod:`attnguard.observability.jobstore`: the process group's, kept past
  ``destroy_process_group()``) when the job had a process group, else through files in
  a private rendezvous directory (:func:`open_job_dir`: for a job on one host, in this user's
  private directory, named after the job's identity and its launcher, so that two jobs alike in
  every variable never meet; the rules are :class:`attnguard.safefiles.PrivateDir`'s). When
  neither can be had (no job identity from the launcher, ranks on several nodes without a shared
  ``ATTNGUARD_LOG`` directory, a rendezvous directory that is not safe to use), every rank emits
  its own process summary saying why (rank 0's on the console);
* a helper process (a DataLoader worker, a tool run by a guarded program) -> its own summary
  only when it changed or would have changed something; it never takes part in the job's.

How long rank 0 waits: a rank announces that it will have something to report when it first
records an event (:func:`announce_first_event`: a marker in the rendezvous directory and, once a
process group is up, an entry in the store's ``announced`` roll; a rank whose events came before
its group announces when the group is made, :func:`on_group_start`), and, when it activates
under a launcher, that it is alive (:func:`announce_alive`: its host and pid, removed at its exit
when it has nothing to report). A rank that destroys its process group posts its record as it
stands then (:func:`on_group_end`), and again at exit unless nothing changed since and it had
announced nothing; a rank whose exit record is posted already (``attnguard.finish()`` before
the destroy) posts nothing more: its exit record stands. At exit rank 0 takes every record already there and waits, at most
:data:`GATHER_TIMEOUT_S`, only for ranks that announced events and have not posted their exit
record, or that joined the process group (the store's ``joined`` roll, :func:`on_group_start`)
or still run on this host, with no record (and, meeting in torchrun's store with no process
group on several hosts, for ranks it has no sign of here: they may still run elsewhere) (a rank slower to start than rank 0 is to
finish may yet have events; one that ended without its exit handlers, ``os._exit``, is seen
gone): when nothing happened anywhere and no rank is still running, it does not wait at all. A
rank it waited for in vain is counted from the record it posted when it destroyed its group,
if any, and the summary says so; ranks it heard nothing from are named as such.

Why not ``all_gather_object``: a collective at exit hangs for the process group's timeout (10-30
minutes) as soon as one rank does not reach it (a rank that crashed, runs without attnguard, or
destroyed its group). A rank only writes its own keys and files, every store call is bounded
(:mod:`attnguard.observability.jobstore`), and rank 0's wait has a deadline.

Records from other ranks are checked field by field like any file ``attnguard summary`` reads
(:mod:`attnguard.observability.eventfiles`); one that fails is left out and named in the job summary.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from . import events, jobdir, jobstore, numerics, workload
from .advice import Facts
from .eventfiles import clean_keys
from .events import KINDS
from .gather import Channels, Gathered, RankRecord, gather, record_of
from .jobdir import JOB_VARS, JobSummaryUnavailable, job_dir_path, open_job_dir
from .report import EVENT_HINTS, advice, headline, hint_for, kinds_of, level, story

__all__ = [
    "EVENT_HINTS",
    "GATHER_TIMEOUT_S",
    "JOB_VARS",
    "JobSummaryUnavailable",
    "aggregate",
    "emit_exit_summary",
    "hint_for",
    "job_dir_path",
    "open_job_dir",
]

GATHER_TIMEOUT_S = 10.0


# --- this process's counts and the cross-rank aggregate ------------------------------------------


def local_fields() -> dict[str, Any]:
    """``events.summary_fields()`` plus ``keys``: one entry per (event, site, reason_code) with
    its count and how many of those were applied / would_have / observed / internal_errors, and
    ``facts``: what the advice depends on (:mod:`attnguard.observability.workload`)."""
    fields = events.summary_fields()
    fields["facts"] = workload.snapshot()
    counts = numerics.snapshot()
    if counts:
        fields["numerics"] = counts  # the opt-in numbers check (ATTNGUARD_VERIFY)
    kinds = events.kind_counts()
    fields["keys"] = [
        {"event": e, "site": s, "reason_code": r, "count": n, **kinds_of(kinds.get((e, s, r)))}
        for (e, s, r), n in sorted(events.counts().items(), key=lambda kv: tuple(map(str, kv[0])))
        if e not in ("activated", "summary")
    ]
    return fields


def aggregate(per_rank: Mapping[int, RankRecord]) -> dict[str, Any]:
    """Merge per-rank records: the kind totals (applied / would_have / observed /
    internal_errors), events and reasons summed over ranks, sites united, which ranks reported
    each event (``event_ranks``) and reason (``reason_ranks``), every rank's kind totals
    (``per_rank``) and process id (``rank_procs``), and ``keys`` with a count per rank
    (``ranks``) and kind totals each (``rank_kinds``)."""
    out: dict[str, Any] = {
        "ranks": sorted(per_rank),
        **dict.fromkeys(KINDS, 0),
        "events": {},
        "reasons": {},
        "sites": {},
        "event_ranks": {},
        "reason_ranks": {},
        "per_rank": {},
        "rank_procs": {},
        "keys": [],
        "facts": workload.merge(record.facts for record in per_rank.values()),
    }
    keys: dict[tuple[str, Any, Any], dict[str, Any]] = {}
    sites: dict[str, dict[str, None]] = {}
    for r in sorted(per_rank):
        record = per_rank[r]
        out["rank_procs"][str(r)] = record.proc
        totals = dict.fromkeys(KINDS, 0)
        for k in record.keys:
            for kind in KINDS:
                totals[kind] += k.kinds.get(kind, 0)
            for name, table, ranks, ident in (
                ("events", out["events"], out["event_ranks"], k.event),
                ("reasons", out["reasons"], out["reason_ranks"], f"{k.event}:{k.reason_code}"),
            ):
                if name == "reasons" and not k.reason_code:
                    continue
                table[ident] = table.get(ident, 0) + k.count
                seen = ranks.setdefault(ident, [])
                if not seen or seen[-1] != r:  # ranks come in order: one look, not a search
                    seen.append(r)
            if k.site:
                sites.setdefault(k.event, {})[k.site] = None  # ordered and unique
            entry = keys.setdefault(
                (k.event, k.site, k.reason_code),
                {
                    "event": k.event,
                    "site": k.site,
                    "reason_code": k.reason_code,
                    "count": 0,
                    **dict.fromkeys(KINDS, 0),
                    "ranks": {},
                    "rank_kinds": {},
                },
            )
            entry["count"] += k.count
            entry["ranks"][str(r)] = k.count
            entry["rank_kinds"][str(r)] = dict(k.kinds)
            for kind in KINDS:
                entry[kind] += k.kinds.get(kind, 0)
        out["per_rank"][str(r)] = totals
        for kind in KINDS:
            out[kind] += totals[kind]
    out["sites"] = {event: list(names) for event, names in sites.items()}
    out["keys"] = list(keys.values())
    counts = numerics.merge((r, per_rank[r].numerics) for r in sorted(per_rank))
    if counts:
        out["numerics"] = counts  # checked / mismatched / skipped, in total and per rank
    return out


# --- emitting ------------------------------------------------------------------------------------


def _emit_local(note: str | None = None, console: bool = True) -> None:
    fields = local_fields()
    if events.is_helper() and not (fields["applied"] or fields["would_have"]):
        return  # a helper that changed nothing stays silent
    rows = advice(fields["keys"], Facts.of(fields["facts"]))
    head = _with_numerics(headline(fields, "in this process"), fields)
    if note:
        head += f" ({note})"
    events.emit(
        "summary",
        site="process",
        reason_code="exit",
        reason=story(head, rows),
        level=_level(fields),
        console=console,
        advice=rows,
        **fields,
    )


def _ranks(ranks: list[int]) -> str:
    return f"rank(s) {', '.join(map(str, ranks))}"


def _emit_job(got: Gathered, world_size: int, timeout_s: float) -> None:
    fields = aggregate(got.records)
    missing = [r for r in range(world_size) if r not in got.records]
    late = [r for r in missing if r in got.waited_for and r not in got.gone]
    gone = [r for r in missing if r in got.gone]
    expected = [r for r in missing if r in got.expected and r not in got.waited_for]
    silent = [
        r for r in missing if r not in got.waited_for and r not in got.expected and r not in gone
    ]
    head = headline(fields, f"over {len(got.records)} of {world_size} ranks")
    if late:
        head += f" ({_ranks(late)}: no report within {timeout_s:g} s, though they announced events)"
    if expected:
        head += f" ({_ranks(expected)}: no report within {timeout_s:g} s)"
    if gone:
        head += (
            f" ({_ranks(gone)}: their process ended without reporting (killed?), though they "
            "announced events)"
        )
    if got.as_of_group_end:
        head += (
            f" ({_ranks(got.as_of_group_end)} counted as of their destroy_process_group(): no "
            f"exit report within {timeout_s:g} s, though they announced events)"
        )
    if silent:
        head += (
            f" ({_ranks(silent)}: no report reached rank 0, nor word of any event, so it did not "
            "wait for them)"
        )
    if got.store_error and missing:
        head += f"; {got.store_error}"
    if got.ignored:
        head += f"; {len(got.ignored)} rank record(s) ignored: {'; '.join(got.ignored[:3])}"
    rows = advice(fields["keys"], Facts.of(fields["facts"]))
    head = _with_numerics(head, fields)
    events.emit(
        "summary",
        site="job",
        reason_code="exit_all_ranks",
        reason=story(head, rows),
        level=_level(fields),
        missing_ranks=missing,
        silent_ranks=silent,
        waited_for=sorted(got.waited_for),
        waited_s=round(got.waited_s, 3),
        as_of_group_end=got.as_of_group_end,
        gone_ranks=got.gone,
        ignored_records=got.ignored,
        gathered_by=got.via,
        advice=rows,
        **fields,
    )


def _with_numerics(head: str, fields: dict[str, Any]) -> str:
    said = numerics.headline(fields.get("numerics") or {})
    return f"{head}; {said}" if said else head


def _level(fields: dict[str, Any]) -> str:
    """A warning when it reports applied changes or numbers that did not match, else info."""
    mismatched = (fields.get("numerics") or {}).get("mismatched")
    return "warning" if mismatched else level(fields)


_announced = {"files": False, "store": False}


def announce_first_event() -> bool:
    """Called when this process first records an event: a rank other than 0 tells rank 0 it
    will have something to report. True when nothing is left to do (then it is not called
    again). Never raises."""
    try:
        if events.is_helper():
            return False  # may yet become a rank (Ray)
        ctx = events.launch_context()
        if ctx["world_size"] <= 1:
            return False  # a Ray actor may set its rank later
        rank = ctx["rank"]
        if rank == 0:
            return True
        if not _announced["files"]:
            _announced["files"] = True
            try:
                with open_job_dir() as d:
                    d.write(f"announce-{rank}", b"")
            except Exception:
                pass  # no files: the store (or nothing) carries it
        return _announce_in_store()
    except Exception:
        return True


def _announce_in_store() -> bool:
    """Enrol this rank in the store's ``announced`` roll, once; True when done."""
    if not _announced["store"]:
        store = jobstore.job_store()
        if store is None:
            return False
        if store.rank != 0:
            store.enrol("announced", store.rank)
        _announced["store"] = True
    return True


def _rank_of_job() -> bool:
    return not events.is_helper() and events.launch_context()["world_size"] > 1


def on_group_start() -> None:
    """Just after the default process group was made: keep its store for the exit summary,
    enrol in the store's ``joined`` roll (rank 0 then waits at exit for this rank's record), and
    announce events recorded before the group existed. Never raises."""
    try:
        jobstore.keep_default_store()
        if not _rank_of_job():
            return
        store = jobstore.job_store()
        if store is not None and store.rank != 0:
            store.enrol("joined", store.rank)
        if _has_events():
            _announce_in_store()
    except Exception:
        pass


# the record this rank posted when it destroyed its group; whether it handed its exit record on
_posted: dict[str, Any] = {"at_group_end": b"", "exit": False}


def on_group_end() -> None:
    """Just before the default process group is destroyed: keep its store, and post this rank's
    record as it stands (rank 0 counts it if no exit record comes), unless its exit record is
    posted already (``attnguard.finish()`` came first): that one stands. Never raises."""
    try:
        jobstore.keep_default_store()
        store = jobstore.job_store()
        if store is None or not _rank_of_job() or _posted["exit"]:
            return
        if _has_events():
            _announce_in_store()
        if store.rank != 0:
            record = _record(store.rank, "group_end")
            _post(store, record)
            _posted["at_group_end"] = record
    except Exception:
        pass


def _post(store: jobstore.JobStore, record: bytes) -> None:
    store.set(f"rank/{store.rank}", record)
    store.enrol("posted", store.rank)


def _after_fork_in_child() -> None:
    _announced.update(files=False, store=False)
    _posted.update(at_group_end=b"", exit=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _has_events() -> bool:
    return any(key[0] not in ("activated", "summary") for key in events.counts())


def _record(rank: int, phase: str = "exit") -> bytes:
    """This rank's record: its process id and keys, posted at ``phase`` ("exit", or "group_end"
    when it destroys its process group)."""
    fields = local_fields()
    return record_of(
        rank, phase, events.process_id(), fields["keys"], fields["facts"], fields.get("numerics")
    )


def emit_exit_summary(timeout_s: float | None = None) -> None:
    """The exit report: one for the job from rank 0 of a job, else this process's own."""
    if events.is_helper():
        _emit_local()
        return
    ctx = events.launch_context()
    if ctx["world_size"] <= 1:
        _emit_local()
        return
    timeout = GATHER_TIMEOUT_S if timeout_s is None else timeout_s
    store = jobstore.job_store()
    rank, world = (store.rank, store.world) if store else (ctx["rank"], ctx["world_size"])
    store_note = None
    if store is not None and rank != 0:
        record = _record(rank)
        try:
            if not _unchanged_since_group_end(record):
                _post(store, record)
            _posted["exit"] = True
            jobdir.retire_alive(rank, None)
            return  # posted: rank 0 tells the story once
        except jobstore.StoreUnavailable as exc:
            store, store_note = None, f"no job-wide summary: {exc}"
    if rank != 0 and store is None and not _has_events():
        jobdir.retire_alive(rank, None)
        return  # nothing to report, and rank 0 does not wait for it: no file left behind
    directory = None
    try:
        directory = open_job_dir()
    except JobSummaryUnavailable as exc:
        if store is None:
            _emit_local(note=store_note or f"no job-wide summary: {exc}", console=rank == 0)
            return
    if rank != 0 and directory is not None:
        try:
            directory.write(f"rank-{rank}.json", _record(rank))
            _posted["exit"] = True
            jobdir.retire_alive(rank, directory)
        except OSError as exc:
            why = f"cannot write to {directory.path}: {exc.strerror or exc}"
            _emit_local(note=f"no job-wide summary: {why}", console=False)
        finally:
            directory.close()
        return
    channels = Channels(store, directory)
    got = Gathered({}, "")
    try:
        mine = local_fields()
        own = RankRecord(
            events.process_id(),
            [k for k, _ in clean_keys(mine["keys"])],
            mine["facts"],
            mine.get("numerics") or {},
        )
        got = gather(world, own, channels, timeout)
    finally:
        channels.clean_up(list(got.records))
        if directory is not None:
            directory.close()
    _emit_job(got, world, timeout)


def _unchanged_since_group_end(record: bytes) -> bool:
    """True when this rank's counts are those it posted as it destroyed its group and it
    announced no event: rank 0 has its whole story (and may be gone: no call to a store nobody
    reads any more)."""
    before = _posted["at_group_end"]
    if not before or _announced["store"]:
        return False
    return _counts_of(before) == _counts_of(record)


def _counts_of(raw: bytes) -> Any:
    record = json.loads(raw)
    return record.get("keys"), record.get("numerics")
