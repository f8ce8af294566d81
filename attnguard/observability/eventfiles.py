"""``attnguard summary FILES``: read JSON-lines event files and add their counts up, distrusting
every byte of them.

The files may come from anywhere (a shared directory, another version of attnguard, a truncated
write, someone's mischief), so:

* only regular files are read (a FIFO or a device is refused without being opened), in bounded
  chunks; a line longer than :data:`MAX_LINE` bytes is skipped without being held in memory;
* every field of every record is type-checked (:func:`clean_record`); a record that fails is
  skipped and counted, never fatal (deep nesting, ``Infinity``, a 10**100 count included);
* the table of counts holds at most :data:`MAX_ENTRIES` entries, so memory stays bounded
  whatever the input.

Counts are exact across processes: every event carries its process's id (``proc``, new in each
forked child). Within one process, an event line says its event happened at least ``count``
times and a summary gives the final figures, so per process and (event, site, reason_code) the
largest figure wins, a summary's over an event line's; over processes the figures are added up.
A job summary (rank 0's ``summary`` with ``site="job"``) stands for the rank processes it names
(``rank_procs``). Records of older attnguard versions without ``proc`` are merged per rank as
before (largest figure wins).
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .. import safefiles
from . import workload
from .advice import Facts
from .events import KINDS, OBSERVATIONS
from .report import headline, hint_for, ranks_text

MAX_LINE = 1 << 20  # bytes; a longer line is skipped (events are a few hundred bytes)
_CHUNK = 1 << 16
MAX_COUNT = 10**12  # more occurrences than any process can have: a count beyond is not true
MAX_RANK = 10**7
MAX_TEXT = 300  # characters of a site, reason code, host
MAX_KEYS = 10_000  # keys in one summary
MAX_ENTRIES = 100_000  # (process, event, site, reason_code) entries over all files
_EVENT_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}\Z")
_PROC = re.compile(r"[0-9a-f]{8,64}\Z")
_RANK_KEY = re.compile(r"[0-9]{1,8}\Z")  # ASCII digits: str.isdigit() takes "²", int() not


def is_process_id(value: Any) -> bool:
    """What ``proc`` holds: 8 to 64 lowercase hex digits."""
    return isinstance(value, str) and bool(_PROC.match(value))


class Malformed(ValueError):
    """A record or field that is not what attnguard writes (the text says which)."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _malformed_on_any_error(check: _F) -> _F:
    """Whatever else a check of untrusted input raises is Malformed too: a record no check
    foresaw is named and skipped like any other, never the end of a summary."""

    @functools.wraps(check)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return check(*args, **kwargs)
        except Malformed:
            raise
        except (ValueError, TypeError, LookupError, AttributeError, RecursionError) as exc:
            raise Malformed(f"unreadable ({type(exc).__name__})") from None

    return checked  # type: ignore[return-value]


# --- reading -----------------------------------------------------------------------------------


def iter_lines(fd: int) -> Iterator[bytes | None]:
    """The lines of an open file, read in chunks; ``None`` stands for a line over MAX_LINE
    bytes (never held whole)."""
    buf = b""
    skipping = False
    while True:
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            break
        start = 0
        while True:
            nl = chunk.find(b"\n", start)
            if nl < 0:
                break
            piece = chunk[start:nl]
            if skipping:
                skipping = False
            elif len(buf) + len(piece) > MAX_LINE:
                yield None
            else:
                yield buf + piece
            buf = b""
            start = nl + 1
        rest = chunk[start:]
        if skipping:
            continue
        if len(buf) + len(rest) > MAX_LINE:
            yield None
            buf, skipping = b"", True
        else:
            buf += rest
    if buf and not skipping:
        yield buf


def _reject_constant(name: str) -> Any:
    raise Malformed(f"{name} is not a count")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > 18:
        raise Malformed("a number with too many digits")
    return int(text)


def parse_line(line: bytes) -> dict[str, Any]:
    """One JSON object, or Malformed (with why)."""
    try:
        value = json.loads(
            line.decode("utf-8", "replace"),
            parse_constant=_reject_constant,
            parse_int=_bounded_int,
        )
    except RecursionError:
        raise Malformed("nested too deeply") from None
    except (ValueError, TypeError) as exc:
        raise Malformed(
            "not a JSON object" if not isinstance(exc, Malformed) else str(exc)
        ) from None
    if not isinstance(value, dict):
        raise Malformed("not a JSON object")
    return value


# --- checking every field ------------------------------------------------------------------------


def _count(value: Any, what: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise Malformed(f"{what} is not an integer")
    if not low <= value <= MAX_COUNT:
        raise Malformed(f"{what} is out of range")
    return value


def _text(value: Any, what: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise Malformed(f"{what} is not a short string")
    return value


def _rank(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RANK:
        raise Malformed("rank is not a rank")
    return value


def _rank_key(value: Any) -> int:
    if not isinstance(value, str) or not _RANK_KEY.match(value):
        raise Malformed("a per-rank key is not a rank")
    return _rank(int(value)) or 0


def _kinds(value: Any, count: int) -> dict[str, int] | None:
    """The kind counts of a tally (None when it has none); they add up to at most ``count``."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise Malformed("a kind tally is not an object")
    out = {k: _count(value.get(k, 0), k) for k in KINDS}
    if sum(out.values()) > count:
        raise Malformed("kind counts exceed the count")
    return out


def _line_kinds(event: str, applied: Any, mode: Any, n: int) -> dict[str, int]:
    """Kinds of an event line, which carries its first occurrence's ``applied`` flag."""
    out = dict.fromkeys(KINDS, 0)
    if event == "internal_error":
        out["internal_errors"] = n
    elif event in OBSERVATIONS:
        out["observed"] = n
    elif isinstance(applied, bool):
        out["applied" if applied else "would_have"] = n
    else:
        out["applied" if mode in (None, "fix") else "would_have"] = n
    return out


@dataclass(frozen=True)
class Key:
    """One (event, site, reason_code) with its count and kinds, for one process or rank."""

    event: str
    site: str | None
    reason_code: str | None
    count: int
    kinds: dict[str, int]


def clean_key(raw: Any, mode: Any = None) -> tuple[Key, dict[str, Any] | None]:
    """A summary key checked field by field -> (key, its per-rank part or None)."""
    if not isinstance(raw, Mapping):
        raise Malformed("a summary key is not an object")
    event = raw.get("event")
    if not isinstance(event, str) or not _EVENT_NAME.match(event):
        raise Malformed("event is not an event name")
    site = _text(raw.get("site"), "site")
    reason = _text(raw.get("reason_code"), "reason_code")
    count = _count(raw.get("count", 0), "count")
    has_kinds = any(k in raw for k in KINDS)
    kinds = _kinds(raw, count) if has_kinds else None
    if kinds is None:
        kinds = _line_kinds(event, raw.get("applied"), mode, count)
    per_rank = None
    if "ranks" in raw:
        ranks, rank_kinds = raw.get("ranks"), raw.get("rank_kinds") or {}
        if not isinstance(ranks, Mapping) or not isinstance(rank_kinds, Mapping):
            raise Malformed("per-rank counts are not objects")
        if len(ranks) > MAX_KEYS:
            raise Malformed("too many ranks")
        per_rank = {}
        for r, n in ranks.items():
            n = _count(n, "a per-rank count")
            tally = _kinds(rank_kinds.get(r), n)
            per_rank[_rank_key(r)] = Key(
                event, site, reason, n, tally or _line_kinds(event, None, mode, n)
            )
    return Key(event, site, reason, count, kinds), per_rank


@_malformed_on_any_error
def clean_keys(raw: Any, mode: Any = None) -> list[tuple[Key, dict[str, Any] | None]]:
    """A summary's ``keys``, each checked (Malformed at the first bad one)."""
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_KEYS:
        raise Malformed("keys is not a list of summary keys")
    return [clean_key(k, mode) for k in raw]


@dataclass
class Record:
    """One checked event record."""

    event: str
    site: str | None
    reason_code: str | None
    count: int
    rank: int | None
    proc: str | None
    pid: int | None
    helper: bool
    kinds: dict[str, int]
    keys: list[tuple[Key, dict[str, Any] | None]] = field(default_factory=list)
    rank_procs: dict[int, str] = field(default_factory=dict)
    facts: dict[str, Any] = field(default_factory=dict)  # a summary's: what its advice reads


@_malformed_on_any_error
def clean_record(raw: Mapping[str, Any]) -> Record:
    """Check every field attnguard reads; Malformed (with why) at the first that is wrong."""
    event = raw.get("event")
    if not isinstance(event, str) or not _EVENT_NAME.match(event):
        raise Malformed("event is not an event name")
    proc = raw.get("proc")
    if proc is not None and not is_process_id(proc):
        raise Malformed("proc is not a process id")
    pid = raw.get("pid")
    if pid is not None and (isinstance(pid, bool) or not isinstance(pid, int) or pid < 0):
        raise Malformed("pid is not a process id")
    helper = raw.get("helper", False)
    if not isinstance(helper, bool):
        raise Malformed("helper is not true or false")
    mode = _text(raw.get("mode"), "mode")
    count = _count(raw.get("count", 1), "count", low=1 if event != "summary" else 0)
    rec = Record(
        event=event,
        site=_text(raw.get("site"), "site"),
        reason_code=_text(raw.get("reason_code"), "reason_code"),
        count=count,
        rank=_rank(raw.get("rank")),
        proc=proc,
        pid=pid,
        helper=helper,
        kinds=_line_kinds(event, raw.get("applied"), mode, count),
    )
    if event == "summary":
        rec.keys = clean_keys(raw.get("keys"), mode)
        rec.facts = workload.clean(raw.get("facts"))
        procs = raw.get("rank_procs") or {}
        if not isinstance(procs, Mapping) or len(procs) > MAX_KEYS:
            raise Malformed("rank_procs is not an object")
        for r, p in procs.items():
            if not is_process_id(p):
                raise Malformed("rank_procs holds something other than process ids")
            rec.rank_procs[_rank_key(r)] = p
    return rec


# --- adding up -----------------------------------------------------------------------------------


class Merger:
    """Counts over processes (see the module docstring), fed one record at a time."""

    def __init__(self) -> None:
        # process -> (event, site, reason) -> (grade: 1 summary / 0 event line, key, rank)
        self.entries: dict[tuple[Any, ...], dict[tuple[Any, ...], tuple[int, Key, Any]]] = {}
        self.n_entries = 0
        self.over_limit = 0
        self.ranks: set[int] = set()
        self.records = 0
        self.summaries = 0
        self.job_summaries = 0
        self.facts: list[dict[str, Any]] = []  # each summary's facts (their advice reads them)

    @staticmethod
    def _process(rec: Record) -> tuple[Any, ...]:
        if rec.proc is not None:
            return ("proc", rec.proc)
        return ("rank", rec.rank, rec.pid if rec.helper else None)  # older files

    def _offer(self, proc: tuple[Any, ...], key: Key, grade: int, rank: int | None) -> None:
        table = self.entries.get(proc)
        ident = (key.event, key.site, key.reason_code)
        old = table.get(ident) if table is not None else None
        if old is None:
            if self.n_entries >= MAX_ENTRIES:
                self.over_limit += 1
                return
            self.n_entries += 1
            if table is None:
                table = self.entries[proc] = {}
        elif (old[0], old[1].count) >= (grade, key.count):
            return
        table[ident] = (grade, key, rank)

    def add(self, rec: Record) -> None:
        self.records += 1
        if rec.rank is not None:
            self.ranks.add(rec.rank)
        if rec.event == "activated":
            return
        if rec.event != "summary":
            key = Key(rec.event, rec.site, rec.reason_code, rec.count, rec.kinds)
            self._offer(self._process(rec), key, 0, rec.rank)
            return
        self.summaries += 1
        if rec.facts and len(self.facts) < MAX_KEYS:
            self.facts.append(rec.facts)
        if rec.site == "job":
            self.job_summaries += 1
        for key, per_rank in rec.keys:
            if key.event in ("activated", "summary"):
                continue
            if per_rank is None:
                self._offer(self._process(rec), key, 1, rec.rank)
                continue
            for r, rank_key in per_rank.items():
                self.ranks.add(r)
                p = rec.rank_procs.get(r)
                proc = ("proc", p) if p is not None else ("rank", r, None)
                self._offer(proc, rank_key, 1, r)

    def result(self) -> dict[str, Any]:
        merged_facts = workload.merge(self.facts)
        facts = Facts.of(merged_facts)
        rows: dict[tuple[str, Any], dict[str, Any]] = {}
        for table in self.entries.values():
            for (event, site, reason), (_grade, key, rank) in table.items():
                row = rows.setdefault(
                    (event, reason),
                    {"event": event, "reason_code": reason, "count": 0}
                    | dict.fromkeys(KINDS, 0)
                    | {"ranks": set(), "sites": {}},  # a dict keeps the sites' order
                )
                row["count"] += key.count
                for kind in KINDS:
                    row[kind] += key.kinds.get(kind, 0)
                if rank is not None:
                    row["ranks"].add(rank)
                if site is not None:
                    row["sites"][site] = None
        out_rows = []
        for row in sorted(rows.values(), key=lambda r: (r["event"], str(r["reason_code"]))):
            row["ranks"] = sorted(row["ranks"])
            row["sites"] = list(row["sites"])
            row["hint"] = hint_for(row["event"], row["reason_code"], facts)
            out_rows.append(row)
        return {
            "ranks": sorted(self.ranks),
            "processes": len(self.entries),
            "rows": out_rows,
            **{kind: sum(r[kind] for r in out_rows) for kind in KINDS},
            "summaries": self.summaries,
            "job_summaries": self.job_summaries,
            "facts": merged_facts,
        }


def merge_records(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Counts per (event, reason_code) over processes, from event records (dicts as parsed);
    malformed ones are skipped."""
    merger = Merger()
    for raw in records:
        try:
            merger.add(clean_record(raw))
        except Malformed:
            continue
    return merger.result()


# --- the command -------------------------------------------------------------------------------


def read_into(paths: Iterable[str], merger: Merger) -> dict[str, Any]:
    """Feed every record of ``paths`` to ``merger``; what was skipped, per file."""
    malformed: dict[str, int] = {}
    unreadable: dict[str, str] = {}
    for path in paths:
        try:
            fd = safefiles.open_regular(path)
        except safefiles.UnsafeFile as exc:
            unreadable[path] = str(exc)
            continue
        except OSError as exc:
            unreadable[path] = f"{type(exc).__name__}: {exc.strerror or exc}"
            continue
        try:
            for line in iter_lines(fd):
                if line is not None and not line.strip():
                    continue
                try:
                    if line is None:
                        raise Malformed(f"a line over {MAX_LINE} bytes")
                    merger.add(clean_record(parse_line(line)))
                except Malformed:
                    malformed[path] = malformed.get(path, 0) + 1
        except OSError as exc:
            unreadable[path] = f"{type(exc).__name__}: {exc.strerror or exc}"
        finally:
            os.close(fd)
    return {"malformed": malformed, "unreadable": unreadable}


def printable(value: Any) -> str:
    """Text from a file, safe for a terminal: control characters and lone surrogates escaped."""
    text = str(value)
    if text.isprintable():
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return (
        "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
        .encode("utf-8", "backslashreplace")
        .decode("utf-8")
    )


@dataclass
class Summary:
    """The command's output and whether the files held any attnguard record at all."""

    text: str
    usable: bool


def summarise_files(paths: Iterable[str], as_json: bool) -> Summary:
    """``attnguard summary FILES``: one report over JSON-lines event files.

    Raises ValueError when none of the files can be read; ``usable`` is False when they held
    no attnguard record.
    """
    paths = list(paths)
    merger = Merger()
    skipped = read_into(paths, merger)
    if paths and len(skipped["unreadable"]) == len(set(paths)):
        why = "; ".join(f"{printable(p)}: {w}" for p, w in skipped["unreadable"].items())
        raise ValueError(f"attnguard summary: no readable input ({why})")
    merged = merger.result()
    usable = merger.records > 0
    if as_json:
        report = {
            "files": paths,
            "records": merger.records,
            "malformed_lines": skipped["malformed"],
            "unreadable_files": skipped["unreadable"],
            "entries_over_limit": merger.over_limit,
            **merged,
        }
        return Summary(json.dumps(report, indent=2, default=str), usable)
    lines = [
        f"attnguard summary: {len(paths)} file(s), {merger.records} event(s), "
        f"ranks {ranks_text(merged['ranks'])}: {headline(merged, 'in these files')}"
    ]
    for path, n in skipped["malformed"].items():
        lines.append(f"  skipped {n} malformed line(s) in {printable(path)}")
    for path, why in skipped["unreadable"].items():
        lines.append(f"  could not read {printable(path)}: {printable(why)}")
    if merger.over_limit:
        lines.append(f"  left out {merger.over_limit} count(s) beyond {MAX_ENTRIES} entries")
    if not usable:
        lines.append("no attnguard events found in these files")
        return Summary("\n".join(lines), False)
    if not merged["rows"]:
        lines.append("no events besides activation and summaries: nothing to change")
        return Summary("\n".join(lines), True)
    header = ("event", "reason_code", "count", "applied", "would_have", "ranks", "sites")
    table = [
        (
            r["event"],
            printable(r["reason_code"] or "-"),
            str(r["count"]),
            str(r["applied"]),
            str(r["would_have"]),
            ranks_text(r["ranks"]),
            ", ".join(printable(s) for s in r["sites"]) or "-",
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
            lines.append(f"  {printable(reason or event)}: {hint}")
    return Summary("\n".join(lines), True)


def render_files(paths: Iterable[str], as_json: bool) -> str:
    """The text of :func:`summarise_files`."""
    return summarise_files(paths, as_json).text
