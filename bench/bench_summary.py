"""Benchmark: ``attnguard summary`` on many entries (CPU): does its time grow with the input, or
with its square?

Files of N distinct entries (each its own process, rank and site under one event and reason:
the shape that once made the merge quadratic) for N = 25,000 and 100,000 (the
command's cap of entries; about 23 MB); each size is summarised in a fresh interpreter,
alternating sizes, medians over ``--runs`` rounds. Linear work gives a time ratio near 4 for
4x the entries, quadratic near 16.

    python bench/bench_summary.py [--runs 3] [--smoke]

``--smoke`` (CI): 250 and 1,000 entries, one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _smoke

SIZES = (25_000, 100_000)


def write_entries(path: Path, n: int) -> None:
    with path.open("w") as fh:
        for i in range(n):
            record = {
                "schema": 1,
                "event": "backend_fallback",
                "level": "warning",
                "pid": 1000 + i,
                "proc": f"{i:016x}",
                "rank": i,
                "mode": "fix",
                "site": f"transformers.load.{i}",
                "reason_code": "package_missing",
                "count": 1,
                "applied": True,
            }
            fh.write(json.dumps(record) + "\n")


def summarise(path: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    start = time.perf_counter()
    res = subprocess.run(
        [sys.executable, "-m", "attnguard", "summary", str(path)],
        env=env,
        capture_output=True,
        text=True,
    )
    took = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(res.stderr[-2000:])
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="CI: small files, one run")
    args = parser.parse_args()
    sizes = (250, 1_000) if args.smoke else SIZES
    if args.smoke:
        args.runs = 1
    with tempfile.TemporaryDirectory() as tmp:
        files = {n: Path(tmp) / f"entries-{n}.jsonl" for n in sizes}
        for n, path in files.items():
            write_entries(path, n)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        for i in range(args.runs):
            for n in sizes if i % 2 == 0 else reversed(sizes):
                times[n].append(summarise(files[n]))
        print("| entries | file | seconds (median) |")
        print("| --- | --- | --- |")
        for n in sizes:
            size = files[n].stat().st_size / 1e6
            print(f"| {n:,} | {size:.1f} MB | {statistics.median(times[n]):.2f} |")
        small, big = (statistics.median(times[n]) for n in sizes)
        print(f"\nratio for {sizes[1] // sizes[0]}x the entries: {big / small:.1f}")
    if args.smoke:
        _smoke.ran(f"attnguard summary over {sizes[0]:,} and {sizes[1]:,} entries")
        raise SystemExit(_smoke.done())


if __name__ == "__main__":
    main()
