"""The exit summary: this process's own, or one for the whole job from its rank 0.

At exit (``events._at_exit`` calls :func:`emit_exit_summary`, registered by activation):

* a single process (``WORLD_SIZE`` 1 or unset) -> this process's own ``summary``
  (``site="process"``);
* a rank of a job (``WORLD_SIZE`` > 1, from a launcher or set later, as Ray actors do) -> one
  ``summary`` for the whole job (``site="job"``) from rank 0, counted over every rank that
  reported, naming the ones that did not; the other ranks emit none. Each rank's record travels
  through the process group's key-value store when a group is up at exit, else through files in
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
process group is up, a store key), and, when it activates under a launcher, that it is alive
(:func:`announce_alive`: its host and pid, removed at its exit when it has nothing to report).
At exit rank 0 takes every record already there and waits, at most :data:`GATHER_TIMEOUT_S`,
only for ranks that announced events, or that still run on this host and have not finished (a
rank slower to start than rank 0 is to finish may yet have events; one that ended without its
exit handlers, ``os._exit``, is seen gone): when nothing happened anywhere and no rank is still
running, it does not wait at all. Ranks with no record that announced nothing are named as such.

Why not ``all_gather_object``: a collective at exit hangs for the process group's timeout (10-30
minutes) as soon as one rank does not reach it (a rank that crashed, runs without attnguard, or
destroyed its group). Store and file writes never block, and rank 0's wait has a deadline.

Records from other ranks are checked field by field like any file ``attnguard summary`` reads
(:mod:`attnguard.eventfiles`); one that fails is left out and named in the job summary.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import events, launch, safefiles
from .eventfiles import Key, Malformed, clean_keys, is_process_id, parse_line
from .events import KINDS
from .report import EVENT_HINTS, advice, headline, hint_for, kinds_of, level, story

__all__ = ["EVENT_HINTS", "GATHER_TIMEOUT_S", "aggregate", "emit_exit_summary", "hint_for"]

GATHER_TIMEOUT_S = 10.0
_POLL_S = 0.05
_STORE_PREFIX = "attnguard/summary/v2/"
MAX_RECORD = 4 << 20  # bytes of one rank's record
# What identifies one run of a job, the same on every rank (torchrun / torch.distributed.run).
JOB_VARS = (
    "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "TORCHELASTIC_RESTART_COUNT",
)


# --- this process's counts and the cross-rank aggregate ------------------------------------------


def local_fields() -> dict[str, Any]:
    """``events.summary_fields()`` plus ``keys``: one entry per (event, site, reason_code) with
    its count and how many of those were applied / would_have / observed / internal_errors."""
    fields = events.summary_fields()
    kinds = events.kind_counts()
    fields["keys"] = [
        {"event": e, "site": s, "reason_code": r, "count": n, **kinds_of(kinds.get((e, s, r)))}
        for (e, s, r), n in sorted(events.counts().items(), key=lambda kv: tuple(map(str, kv[0])))
        if e not in ("activated", "summary")
    ]
    return fields


@dataclass
class RankRecord:
    """What one rank reported at exit: its process id and its checked keys."""

    proc: str
    keys: list[Key] = field(default_factory=list)


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
    return out


# --- emitting ------------------------------------------------------------------------------------


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
        reason=story(head, rows),
        level=level(fields),
        console=console,
        advice=rows,
        **fields,
    )


@dataclass
class Gathered:
    """What rank 0 collected: records per rank, and what it can say about the others."""

    records: dict[int, RankRecord]
    via: str
    waited_for: list[int] = field(default_factory=list)  # announced ranks it waited for
    ignored: list[str] = field(default_factory=list)  # records left out, and why


def _emit_job(got: Gathered, world_size: int, timeout_s: float) -> None:
    fields = aggregate(got.records)
    missing = [r for r in range(world_size) if r not in got.records]
    late = [r for r in missing if r in got.waited_for]
    silent = [r for r in missing if r not in got.waited_for]
    head = headline(fields, f"over {len(got.records)} of {world_size} ranks")
    if late:
        head += (
            f" (no report from rank(s) {', '.join(map(str, late))} within {timeout_s:g} s, "
            "though they announced events)"
        )
    if silent:
        head += (
            f" (no report from rank(s) {', '.join(map(str, silent))} by rank 0's exit; they "
            "announced no event, so rank 0 did not wait)"
        )
    if got.ignored:
        head += f"; {len(got.ignored)} rank record(s) ignored: {'; '.join(got.ignored[:3])}"
    rows = advice(fields["keys"])
    events.emit(
        "summary",
        site="job",
        reason_code="exit_all_ranks",
        reason=story(head, rows),
        level=level(fields),
        missing_ranks=missing,
        silent_ranks=silent,
        waited_for=sorted(got.waited_for),
        ignored_records=got.ignored,
        gathered_by=got.via,
        advice=rows,
        **fields,
    )


# --- where the ranks meet ------------------------------------------------------------------------


class JobSummaryUnavailable(Exception):
    """Why a job-wide summary cannot be gathered through files (the text is shown to users)."""


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


def _store() -> Any:
    from torch.distributed import distributed_c10d as c10d

    return c10d._get_default_store()


_LOOPBACK = ("localhost", "::1", "0:0:0:0:0:0:0:1")


def _may_span_hosts(env: Mapping[str, str]) -> bool:
    """Whether the job's ranks may run on several hosts: LOCAL_WORLD_SIZE below WORLD_SIZE,
    or, where the launcher did not say, a rendezvous address other than this host's loopback."""
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        if env.get("LOCAL_WORLD_SIZE"):
            return int(env["LOCAL_WORLD_SIZE"]) < world
    except ValueError:
        return False
    addr = env.get("MASTER_ADDR", "")
    return not (addr in _LOOPBACK or addr.startswith("127."))


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _job_place(env: Mapping[str, str], launcher: str | None) -> tuple[str | None, str]:
    """(the directory the job directory is in, or None for this user's private directory;
    the job directory's name). Raises JobSummaryUnavailable when the ranks cannot meet."""
    if not (env.get("TORCHELASTIC_RUN_ID") or env.get("MASTER_PORT")):
        raise JobSummaryUnavailable(
            "no process group at exit and the launcher set neither TORCHELASTIC_RUN_ID nor "
            "MASTER_PORT, which tell this job's ranks apart"
        )
    ident = [env.get(v, "") for v in JOB_VARS]
    if _may_span_hosts(env):
        files = [t for t in events._state.settings.log_targets if t != "stderr"]
        if files:
            base = os.path.dirname(os.path.abspath(files[0]))
            while "{" in base:
                base = os.path.dirname(base)
            uid = os.geteuid() if hasattr(os, "geteuid") else 0
            return base, f".attnguard-job-{uid}-{_digest(*ident)}"
        if env.get("LOCAL_WORLD_SIZE"):
            raise JobSummaryUnavailable(
                "no process group at exit and ranks on several nodes: set ATTNGUARD_LOG to a "
                "file path on a shared file system for a job-wide summary"
            )
    # One host: the ranks one launcher started (two jobs alike in every variable are two
    # launches), in a directory only this user can write to.
    return None, f"job-{_digest(*ident, launcher or launch.launcher_id())}"


def job_dir_path(environ: Mapping[str, str] | None = None, launcher: str | None = None) -> str:
    """Where this job's ranks meet (see :func:`open_job_dir`); ``launcher``: the
    :func:`attnguard.launch.launcher_id` of the ranks (this process's by default). Makes this
    user's private directory when it is the place. Raises JobSummaryUnavailable."""
    env = os.environ if environ is None else environ
    base, name = _job_place(env, launcher)
    if base is None:
        try:
            with safefiles.private_dir(env) as own:
                base = own.path
        except OSError as exc:
            raise JobSummaryUnavailable(str(exc)) from None
    return os.path.join(base, name)


def open_job_dir() -> safefiles.PrivateDir:
    """The rendezvous directory, created if need be and checked (JobSummaryUnavailable).

    The ranks of a job on one host meet in this user's private directory
    (:func:`attnguard.safefiles.private_dir`), under a name made of the job's identity and its
    launcher: another user can neither create it first nor write into it, and another job with
    the same identity has another launcher. Ranks that may run on several hosts meet beside the
    ATTNGUARD_LOG file (a shared file system), under a name made of the job's identity."""
    base, name = _job_place(os.environ, None)
    path = name if base is None else os.path.join(base, name)
    try:
        if base is None:
            with safefiles.private_dir() as own:
                path = os.path.join(own.path, name)
                return own.sub(name)
        return safefiles.PrivateDir(path)
    except safefiles.UnsafeFile as exc:
        raise JobSummaryUnavailable(f"the rendezvous directory is not safe to use: {exc}") from None
    except OSError as exc:
        raise JobSummaryUnavailable(f"cannot create {path}: {exc.strerror or exc}") from None


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
        dist = _live_group()
        if dist is not None and not _announced["store"]:
            _store().set(f"{_STORE_PREFIX}announce/{dist.get_rank()}", "1")
            _announced["store"] = True
        return _announced["store"]
    except Exception:
        return True


def _alive_name(rank: int) -> str:
    return f"alive-{rank}"


def announce_alive() -> None:
    """Called when a rank other than 0 activates under a launcher: its host and pid in the
    rendezvous directory, so that rank 0 waits for it while it runs. Never raises."""
    try:
        ctx = events.launch_context()
        if events.is_helper() or ctx["world_size"] <= 1:
            return
        launch.launcher_id()  # read now: the launcher may end before this rank does
        if ctx["rank"] == 0:
            return
        with open_job_dir() as d:
            d.write(_alive_name(ctx["rank"]), f"{socket.gethostname()} {os.getpid()}".encode())
    except Exception:
        pass


def _retire_alive(rank: int, directory: safefiles.PrivateDir | None) -> None:
    """At a rank's exit: it no longer runs, whatever it reports."""
    try:
        if directory is not None:
            directory.remove(_alive_name(rank))
        else:
            with open_job_dir() as d:
                d.remove(_alive_name(rank))
    except Exception:
        pass


def _runs_here(pid: int) -> bool:
    """Process ``pid`` of this host exists and has not ended (a zombie waiting for its parent to
    reap it has ended)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def _after_fork_in_child() -> None:
    _announced.update(files=False, store=False)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _has_events() -> bool:
    return any(key[0] not in ("activated", "summary") for key in events.counts())


def _record(rank: int) -> bytes:
    return json.dumps(
        {"v": 2, "rank": rank, "proc": events.process_id(), "keys": local_fields()["keys"]},
        default=str,
    ).encode()


def _parse_record(data: bytes, rank: int) -> RankRecord:
    """A rank's record checked field by field (Malformed says why)."""
    if len(data) > MAX_RECORD:
        raise Malformed(f"over {MAX_RECORD} bytes")
    raw = parse_line(data)
    if raw.get("v") != 2 or raw.get("rank") != rank:
        raise Malformed("not a record of this rank")
    proc = raw.get("proc")
    if not is_process_id(proc):
        raise Malformed("no process id")
    keys = [k for k, per_rank in clean_keys(raw.get("keys")) if per_rank is None]
    return RankRecord(proc, keys)


class _Channels:
    """Rank 0's view of the store and the rendezvous directory while it gathers."""

    def __init__(self, store: Any, directory: safefiles.PrivateDir | None) -> None:
        self.store = store
        self.dir = directory
        self.fresh_after = events.STARTED - 2.0  # file times may be coarse
        self.seen_files: list[str] = []

    def _store_get(self, key: str) -> bytes | None:
        if self.store is None:
            return None
        try:
            if not self.store.check([key]):
                return None
            return self.store.get(key)
        except Exception:
            return None

    def _file(self, name: str) -> bytes | None:
        if self.dir is None:
            return None
        data, mtime = self.dir.read(name, MAX_RECORD)  # FileNotFoundError: not there
        self.seen_files.append(name)
        if mtime < self.fresh_after:
            self.dir.remove(name)  # left by an earlier run of the same job
            return None
        return data

    def alive(self, rank: int) -> bool:
        """The rank announced it runs on this host, and its process still does."""
        try:
            data = self._file(_alive_name(rank))
        except OSError:
            return False
        try:
            host, pid = (data or b"").decode("ascii").split()
            return host == socket.gethostname() and _runs_here(int(pid))
        except (ValueError, UnicodeDecodeError):
            return False

    def announced(self, rank: int) -> bool:
        if self._store_get(f"{_STORE_PREFIX}announce/{rank}") is not None:
            return True
        try:
            return self._file(f"announce-{rank}") is not None
        except (FileNotFoundError, safefiles.UnsafeFile):
            return False
        except OSError:
            return False

    def record(self, rank: int) -> tuple[bytes | None, str | None]:
        """(data, None), (None, why it is not to be trusted) or (None, None) when absent."""
        data = self._store_get(f"{_STORE_PREFIX}rank/{rank}")
        if data is not None:
            return data, None
        try:
            return self._file(f"rank-{rank}.json"), None
        except FileNotFoundError:
            return None, None
        except safefiles.UnsafeFile as exc:
            return None, str(exc)
        except OSError as exc:
            return None, f"rank-{rank}.json: {exc.strerror or exc}"

    def clean_up(self, reported: list[int]) -> None:
        """Remove what was read, and the announcements of ranks whose report was taken."""
        if self.dir is not None:
            taken = [n for r in reported for n in (f"announce-{r}", _alive_name(r))]
            for name in self.seen_files + taken:
                self.dir.remove(name)
            self.dir.remove_dir()


def _gather(world: int, own: RankRecord, channels: _Channels, timeout_s: float) -> Gathered:
    """Rank 0: take every record there, wait (until ``timeout_s``) only for announced ranks."""
    got = Gathered({0: own}, "process_group" if channels.store is not None else "files")
    deadline = time.monotonic() + timeout_s
    pending = set(range(1, world))
    waited: set[int] = set()
    while True:
        wanted: set[int] = set()  # ranks worth waiting for now
        for r in sorted(pending):
            data, untrusted = channels.record(r)
            if untrusted is not None:
                got.ignored.append(f"rank {r}: {untrusted}")
                pending.discard(r)
                continue
            if data is None:
                if channels.announced(r):
                    wanted.add(r)
                    waited.add(r)
                elif channels.alive(r):
                    wanted.add(r)  # still running: it may yet have events
                continue
            pending.discard(r)
            try:
                got.records[r] = _parse_record(data, r)
            except Malformed as exc:
                got.ignored.append(f"rank {r}: {exc}")
        if not wanted or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    got.waited_for = sorted(waited)
    return got


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
    dist = _live_group()
    rank, world = (
        (dist.get_rank(), dist.get_world_size()) if dist else (ctx["rank"], ctx["world_size"])
    )
    store = None
    if dist is not None:
        try:
            store = _store()
            if rank != 0:
                store.set(f"{_STORE_PREFIX}rank/{rank}", _record(rank))
                _retire_alive(rank, None)
                return  # posted: rank 0 tells the story once
        except Exception as exc:
            why = f"no job-wide summary: the process group's store failed ({type(exc).__name__})"
            _emit_local(note=why, console=rank == 0)
            return
    if rank != 0 and store is None and not _has_events():
        _retire_alive(rank, None)
        return  # nothing to report, and rank 0 does not wait for it: no file left behind
    directory = None
    try:
        directory = open_job_dir()
    except JobSummaryUnavailable as exc:
        if store is None:
            _emit_local(note=f"no job-wide summary: {exc}", console=rank == 0)
            return
    if rank != 0 and directory is not None:
        try:
            directory.write(f"rank-{rank}.json", _record(rank))
            _retire_alive(rank, directory)
        except OSError as exc:
            why = f"cannot write to {directory.path}: {exc.strerror or exc}"
            _emit_local(note=f"no job-wide summary: {why}", console=False)
        finally:
            directory.close()
        return
    channels = _Channels(store, directory)
    got = Gathered({}, "")
    try:
        own = RankRecord(events.process_id(), [k for k, _ in clean_keys(local_fields()["keys"])])
        got = _gather(world, own, channels, timeout)
    finally:
        channels.clean_up(list(got.records))
        if directory is not None:
            directory.close()
    _emit_job(got, world, timeout)
