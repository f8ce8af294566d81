"""The kernel-decision cache under ``XDG_CACHE_HOME`` planted or corrupted (``ATTNGUARD_KERNEL=
fastest``): whatever a file of this user's holds, reading it never raises, and numbers that reach
events are finite (a JSON line with NaN is not JSON to most readers). The reading code runs on a
CPU; tests/gpu/test_selection_gpu.py plants the same files under a real fastest process.
"""

from __future__ import annotations

import json
import math

import pytest
from helpers.selection import FP, ignored, write_file

from attnguard.observability.sinks import render_json
from attnguard.selection import cache, decisions

HUGE = int("9" * 400)  # valid JSON; too large for a float


def _good(call):
    record = cache.record(
        call, decisions.Decision("sdpa", {"sdpa": "x"}, {"sdpa": {"ms": 1.0}}), FP[1]
    )
    return json.loads(record.decode())


@pytest.mark.parametrize(
    "change",
    [
        {"cost": {"race_s": HUGE, "warm_up_s": 0.5}},
        {"measured": {"sdpa": {"ms": HUGE, "out_diff": 0.0}}},
        {"measured": {"sdpa": {"ms": math.nan, "out_diff": math.inf, "extra": [1] * 5}}},
        {"measured": {"sdpa": {"ms": "fast", "error": {"nested": True}}}},
    ],
)
def test_planted_numbers_never_raise_nor_reach_events_unfinite(disk, change):
    """An integer too large for a float raised OverflowError out of the read (the requested
    kernel then ran with an internal error at every call, the file read again each time)."""
    write_file(disk.path, json.dumps({**_good(disk.call), **change}))
    found = disk.cache.read(disk.call)
    assert found is not None and found.winner == "sdpa"
    assert math.isfinite(found.call_ms())
    line = render_json({"candidates": found.measured, "cost": found.cost})
    json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in an event line"))
    for entry in found.measured.values():
        assert set(entry) <= {"ms", "out_diff", "grad_diff", "error"}
        assert all(v is None or isinstance(v, (float, str)) for v in entry.values())
    assert not ignored(disk.events)


def test_write_first_over_a_planted_file_never_raises(disk):
    write_file(disk.path, json.dumps({**_good(disk.call), "cost": {"race_s": HUGE}}))
    mine = decisions.Decision("requested", {}, {"requested": {"ms": 1.0}})
    on_disk = disk.cache.write_first(disk.call, mine)
    assert on_disk is not None and on_disk.winner == "sdpa" and on_disk.cost == {}
