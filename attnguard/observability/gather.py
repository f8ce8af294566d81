"""Rank 0's side of the job summary: the records ranks post, and gathering them from the job's
store (:mod:`attnguard.observability.jobstore`) and the rendezvous directory (:mod:`attnguard.observability.jobdir`) until
every expected record is there or the deadline passes. Records from other ranks are checked
field by field like any file ``attnguard summary`` reads (:mod:`attnguard.observability.eventfiles`); one that
fails is left out and named. When rank 0 waits, and for whom: :mod:`attnguard.observability.summary`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

from .. import safefiles
from . import events, jobdir, jobstore, numerics, workload
from .eventfiles import Key, Malformed, clean_keys, is_process_id, parse_line

_POLL_S = 0.05
RECORD_VERSION = 3
MAX_RECORD = 4 << 20  # bytes of one rank's record


@dataclass
class RankRecord:
    """What one rank reported at exit: its process id and its checked keys."""

    proc: str
    keys: list[Key] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)  # what its advice depends on (checked)
    numerics: dict[str, Any] = field(default_factory=dict)  # the numbers check's counts


@dataclass
class Gathered:
    """What rank 0 collected: records per rank, and what it can say about the others."""

    records: dict[int, RankRecord]
    via: str
    waited_for: list[int] = field(default_factory=list)  # announced ranks it waited for
    expected: list[int] = field(default_factory=list)  # other ranks it waited for
    ignored: list[str] = field(default_factory=list)  # records left out, and why
    as_of_group_end: list[int] = field(default_factory=list)  # counted from that record
    gone: list[int] = field(default_factory=list)  # announced, then ended without reporting
    waited_s: float = 0.0
    store_error: str | None = None


def record_of(
    rank: int,
    phase: str,
    proc: str,
    keys: list[dict[str, Any]],
    facts: dict[str, Any] | None = None,
    counts: dict[str, Any] | None = None,
) -> bytes:
    """A rank's record as it travels to rank 0 (``keys``, ``facts`` and the numbers check's
    ``counts`` as :func:`local_fields` has them)."""
    record = {"v": RECORD_VERSION, "rank": rank, "proc": proc, "phase": phase, "keys": keys}
    record["facts"] = facts or {}
    if counts:
        record["numerics"] = counts
    return json.dumps(record, default=str).encode()


def parse_record(data: bytes, rank: int) -> tuple[RankRecord, str]:
    """A rank's record checked field by field (Malformed says why), and its phase."""
    if len(data) > MAX_RECORD:
        raise Malformed(f"over {MAX_RECORD} bytes")
    raw = parse_line(data)
    if raw.get("v") != RECORD_VERSION or raw.get("rank") != rank:
        raise Malformed("not a record of this rank")
    proc = raw.get("proc")
    if not is_process_id(proc):
        raise Malformed("no process id")
    phase = raw.get("phase")
    if phase not in ("exit", "group_end"):
        raise Malformed("no phase")
    keys = [k for k, per_rank in clean_keys(raw.get("keys")) if per_rank is None]
    counts = numerics.clean(raw.get("numerics"))
    return RankRecord(proc, keys, workload.clean(raw.get("facts")), counts), phase


class Channels:
    """Rank 0's view of the job's store and the rendezvous directory while it gathers."""

    def __init__(
        self, store: jobstore.JobStore | None, directory: safefiles.PrivateDir | None
    ) -> None:
        self.store = store
        self.dir = directory
        self.fresh_after = events.STARTED - 2.0  # file times may be coarse
        self.seen_files: list[str] = []
        self.names: set[str] = set()
        self.posted = jobstore.Roll("posted")
        self.announced_roll = jobstore.Roll("announced")
        self.joined_roll = jobstore.Roll("joined")
        self.heard: set[int] = set()  # ranks that announced events through the store
        self.joined: set[int] = set()  # ranks that made their process group
        # torchrun's store, ranks on several hosts and no group: ranks elsewhere say nothing
        # before their exit, so rank 0 waits for those it has no file of (bounded)
        self.unseen_elsewhere = (
            store is not None
            and store.how == "launcher_store"
            and jobdir.may_span_hosts(os.environ)
        )
        self.error: str | None = None

    def from_store(self) -> list[tuple[int, bytes]]:
        """(rank, record) for each record posted since the last look; enrolments heard."""
        if self.store is None or self.error is not None:
            return []
        out = []
        try:
            self.heard.update(self.announced_roll.new(self.store))
            self.joined.update(self.joined_roll.new(self.store))
            for r in self.posted.new(self.store):
                data = self.store.get(f"rank/{r}")
                if data is not None:
                    out.append((r, data))
        except jobstore.StoreUnavailable as exc:
            self.error = str(exc)
        return out

    def look(self) -> None:
        """List the directory once per look: a rank's files are read only when listed."""
        if self.dir is not None:
            try:
                self.names = set(self.dir.names())
            except OSError:
                self.names = set()

    def _file(self, name: str) -> bytes | None:
        if self.dir is None or name not in self.names:
            raise FileNotFoundError(name)
        data, mtime = self.dir.read(name, MAX_RECORD)  # FileNotFoundError: not there
        self.seen_files.append(name)
        if mtime < self.fresh_after:
            self.dir.remove(name)  # left by an earlier run of the same job
            return None
        return data

    def _runs(self, rank: int) -> bool | None:
        """Whether the process that announced it runs this rank on this host still does; None
        where it did not say so (no ``alive-<rank>``, or another host's)."""
        try:
            data = self._file(jobdir.alive_name(rank))
        except OSError:
            return None
        try:
            host, pid = (data or b"").decode("ascii").split()
            return jobdir.runs_here(int(pid)) if host == socket.gethostname() else None
        except (ValueError, UnicodeDecodeError):
            return None

    def alive(self, rank: int) -> bool:
        """The rank announced it runs on this host, and its process still does."""
        return bool(self._runs(rank))

    def gone(self, rank: int) -> bool:
        """The rank's process on this host ended without its exit handlers (killed,
        ``os._exit``): its alive file is still there, its process is not."""
        return self._runs(rank) is False

    def expected(self, rank: int) -> bool:
        """Rank 0 has reason to think this rank's record is on its way."""
        runs = self._runs(rank)
        if runs is False:
            return False  # its process here ended without its exit handlers
        if rank in self.joined or runs:
            return True
        return self.unseen_elsewhere and jobdir.alive_name(rank) not in self.names

    def announced(self, rank: int) -> bool:
        if rank in self.heard:
            return True
        try:
            return self._file(f"announce-{rank}") is not None
        except OSError:
            return False

    def record(self, rank: int) -> tuple[bytes | None, str | None]:
        """(data, None), (None, why it is not to be trusted) or (None, None) when absent."""
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
            taken = [n for r in reported for n in (f"announce-{r}", jobdir.alive_name(r))]
            for name in self.seen_files + taken:
                self.dir.remove(name)
            self.dir.remove_dir()


def gather(world: int, own: RankRecord, channels: Channels, timeout_s: float) -> Gathered:
    """Rank 0: take every record there; wait (until ``timeout_s``) only for ranks that
    announced events and have not posted their exit record, or that still run on this host
    with no record."""
    via = "files" if channels.store is None else channels.store.how
    got = Gathered({0: own}, "process_group" if via == "kept" else via)
    start = time.monotonic()
    deadline = start + timeout_s
    pending = set(range(1, world))
    at_group_end: dict[int, RankRecord] = {}
    waited: set[int] = set()
    expected: set[int] = set()
    gone: set[int] = set()

    def take(r: int, data: bytes) -> None:
        try:
            record, phase = parse_record(data, r)
        except Malformed as exc:
            got.ignored.append(f"rank {r}: {exc}")
            pending.discard(r)
            return
        if phase == "exit":
            got.records[r] = record
            pending.discard(r)
            at_group_end.pop(r, None)
        else:
            at_group_end[r] = record

    while True:
        for r, data in channels.from_store():
            if r in pending:
                take(r, data)
        channels.look()
        wanted: set[int] = set()  # ranks worth waiting for now
        for r in sorted(pending):
            data, untrusted = channels.record(r)
            if untrusted is not None:
                got.ignored.append(f"rank {r}: {untrusted}")
                pending.discard(r)
            elif data is not None:
                take(r, data)
            elif channels.announced(r):
                if channels.gone(r):  # killed: no record will come
                    gone.add(r)
                    continue
                wanted.add(r)
                waited.add(r)
            elif r not in at_group_end and channels.expected(r):
                wanted.add(r)  # still running, or its record is on its way
                expected.add(r)
        if not wanted or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)
    for r in sorted(at_group_end):
        if r in pending:
            got.records[r] = at_group_end[r]
            if r in waited:
                got.as_of_group_end.append(r)
    got.gone = sorted(gone - set(got.records))
    got.waited_for = sorted(waited - set(got.as_of_group_end) - set(got.gone))
    got.expected = sorted(expected)
    got.waited_s = time.monotonic() - start
    got.store_error = channels.error
    return got
