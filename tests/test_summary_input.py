"""``attnguard summary`` distrusts its input.

Malformed records are skipped and counted (never a traceback), special files are refused
without blocking, memory stays bounded whatever a line holds, terminal output never fails on
odd characters, and the exit code says when nothing usable was found. Property-based cases
(hypothesis) throw arbitrary JSON at the record checker and arbitrary bytes at the reader.
"""

from __future__ import annotations

import json
import os
import subprocess
import tracemalloc
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import PY, subprocess_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnguard.observability import eventfiles
from attnguard.observability.eventfiles import Malformed

GOOD = {
    "schema": 1,
    "event": "backend_fallback",
    "level": "warning",
    "pid": 10,
    "proc": "0123456789abcdef",
    "rank": 0,
    "mode": "fix",
    "site": "transformers.load",
    "reason_code": "package_missing",
    "count": 1,
    "applied": True,
}


def cli(*args: str, timeout: int = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "attnguard", "summary", *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
    )


# --- hostile records, one by one --------------------------------------------------------------

BAD_LINES = [
    json.dumps({**GOOD, "site": ["a"]}),
    json.dumps({**GOOD, "reason_code": {"x": 1}}),
    json.dumps({**GOOD, "count": 1}).replace('"count": 1', '"count": Infinity'),
    json.dumps({**GOOD, "count": -3}),
    json.dumps({**GOOD, "count": 10**30}),
    json.dumps({**GOOD, "count": 2.5}),
    json.dumps(
        {
            **GOOD,
            "event": "summary",
            "keys": [{"event": "x", "count": 1, "ranks": {"0": 1}, "rank_kinds": {"0": "s"}}],
        }
    ),
    "[" * 100_000 + "]" * 100_000,
    '{"a":' * 100_000 + "1" + "}" * 100_000,
    json.dumps({**GOOD, "rank": "0"}),
    json.dumps({**GOOD, "proc": "../../etc"}),
    json.dumps({**GOOD, "event": "x" * 1000}),
]


def test_malformed_records_are_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    good_surrogate = json.dumps({**GOOD, "site": "site-\ud800-\x1b[31mred"})
    path.write_text("\n".join([*BAD_LINES, json.dumps(GOOD), good_surrogate]) + "\n")
    res = cli("--json", str(path))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["malformed_lines"] == {str(path): len(BAD_LINES)}
    assert report["records"] == 2 and report["rows"][0]["count"] == 2
    text = cli(str(path))
    assert text.returncode == 0 and "Traceback" not in text.stderr
    assert f"skipped {len(BAD_LINES)} malformed line(s)" in text.stdout
    # a lone surrogate and a terminal escape come out escaped, never as a codec error
    assert "site-\\ud800-\\x1b[31mred" in text.stdout and "\x1b" not in text.stdout


def test_a_file_of_nothing_usable_fails(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text("\n".join(BAD_LINES) + "\n")
    res = cli(str(path))
    assert res.returncode == 1
    assert res.stdout.rstrip().endswith("no attnguard events found in these files")


def test_a_rank_key_of_other_digits_is_malformed_not_fatal(tmp_path: Path) -> None:
    """ "²" passes str.isdigit() and fails int(). The record is named and
    skipped like any malformed one; the good file beside it still counts."""
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text(json.dumps(GOOD) + "\n")
    key = {"event": "backend_fallback", "count": 1, "applied": 1, "ranks": {"²": 1}}
    bad.write_text(json.dumps({**GOOD, "event": "summary", "site": "job", "keys": [key]}) + "\n")
    res = cli(str(good), str(bad))
    assert res.returncode == 0, res.stderr
    assert "1 change(s) applied" in res.stdout
    assert f"skipped 1 malformed line(s) in {bad}" in res.stdout


class CountingSite(str):
    """A site name that counts how often it is compared: a merge that searches a list of the
    names seen so far compares each new one with all of them (quadratic in the entries)."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        CountingSite.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_merging_is_linear_in_the_entries() -> None:
    """100,000 entries (12 MB, within the cap) took 135 s. Every entry here
    has its own process, rank and site under one (event, reason): the merge may compare a site
    with others only on a hash collision, never with every site seen before (n * n / 2 = 2
    million comparisons at n = 2000). Time itself is measured in bench/bench_summary.py."""
    n = 2000
    records = [
        {**GOOD, "proc": f"{i:016x}", "rank": i, "site": CountingSite(f"site-{i}")}
        for i in range(n)
    ]
    CountingSite.compared = 0
    result = eventfiles.merge_records(records)
    (row,) = result["rows"]
    assert row["count"] == n and len(row["sites"]) == n and row["ranks"] == list(range(n))
    assert CountingSite.compared <= n, CountingSite.compared


# --- special files -------------------------------------------------------------------------------


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "events.fifo"
    os.mkfifo(fifo)
    res = cli(str(fifo))  # a blocking open would outlive the timeout
    assert res.returncode == 2
    assert "a FIFO, not a regular file" in res.stderr


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_device_is_refused(device: str) -> None:
    if not os.path.exists(device):
        pytest.skip(f"no {device} here")
    res = cli(device)
    assert res.returncode == 2 and "a character device, not a regular file" in res.stderr


def test_a_huge_line_is_skipped_within_a_fixed_memory_bound(tmp_path: Path) -> None:
    path = tmp_path / "big.jsonl"
    with path.open("wb") as fh:
        fh.write(b'{"event": "backend_fallback", "site": "')
        fh.truncate(256 << 20)  # 256 MiB of one line (sparse: zeros), no newline in it
    with path.open("ab") as fh:
        fh.write(b'"}\n' + json.dumps(GOOD).encode() + b"\n")
    tracemalloc.start()
    try:
        result = eventfiles.summarise_files([str(path)], as_json=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    report = json.loads(result.text)
    assert report["records"] == 1 and report["malformed_lines"] == {str(path): 1}
    assert peak < 8 << 20, f"peak {peak} bytes"  # a line of at most 1 MiB, a chunk of 64 KiB


# --- properties ----------------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
fields = st.sampled_from(
    ["event", "site", "reason_code", "count", "rank", "proc", "pid", "helper", "applied", "mode"]
    + ["keys", "rank_procs", "applied", "would_have", "observed", "internal_errors"]
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from(["backend_fallback", "summary", "activated", "internal_error"]),
    changes=st.dictionaries(fields, json_values, max_size=4),
    key_changes=st.dictionaries(
        st.sampled_from(["event", "count", "ranks", "rank_kinds", "site", *eventfiles.KINDS]),
        json_values,
        max_size=3,
    ),
)
def test_any_record_is_checked_or_refused_never_crashes(
    base: str, changes: dict[str, Any], key_changes: dict[str, Any]
) -> None:
    raw: dict[str, Any] = {**GOOD, "event": base}
    if base == "summary":
        key = {"event": "backend_fallback", "count": 3, "applied": 3, "ranks": {"0": 3}}
        raw["keys"] = [{**key, **key_changes}]
    raw.update(changes)
    try:
        rec = eventfiles.clean_record(raw)
    except Malformed:
        return
    merger = eventfiles.Merger()
    merger.add(rec)
    merger.add(rec)  # the same process twice: never counted twice
    result = merger.result()
    for row in result["rows"]:
        assert isinstance(row["count"], int) and 0 <= row["count"] <= eventfiles.MAX_COUNT
        for kind in eventfiles.KINDS:
            assert isinstance(row[kind], int) and 0 <= row[kind] <= row["count"]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=4000), lines=st.lists(json_values, max_size=5))
def test_any_bytes_are_read_without_an_exception(tmp_path: Path, data: bytes, lines: list) -> None:
    path = tmp_path / "fuzz.jsonl"
    body = data + b"\n" + b"\n".join(json.dumps(v).encode() for v in lines)
    path.write_bytes(body)
    result = eventfiles.summarise_files([str(path)], as_json=False)
    assert result.text.startswith("attnguard summary: 1 file(s)")
    result.text.encode("utf-8")  # printable: no lone surrogate left in it
