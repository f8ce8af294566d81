"""The full suite's test files in parts of about equal seconds, for .ci/run's two workers.

    python3 scripts/ci_parts.py split N TIMES.json OUT      # writes OUT-1 ... OUT-N (a file a line)
    python3 scripts/ci_parts.py record TIMES.json PART.json...  # the parts' seconds into TIMES.json

TIMES.json holds the seconds each test file took in the last run (tests/conftest.py writes a
session's to $TEST_FILE_TIMES); a file it does not know weighs its size at the known files' seconds
per byte (all of them by size on a machine's first run).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_files() -> list[str]:
    return sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py"))


def load(path: str) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(Path(path).read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def split(n: int, times_path: str, out: str) -> None:
    files, times = test_files(), load(times_path)
    size = {f: (REPO / f).stat().st_size for f in files}
    known = [f for f in files if f in times]
    rate = sum(times[f] for f in known) / max(1, sum(size[f] for f in known)) if known else 1e-3
    weight = {f: times.get(f, size[f] * rate) for f in files}
    parts: list[list[str]] = [[] for _ in range(n)]
    load_of = [0.0] * n
    for f in sorted(files, key=lambda f: -weight[f]):  # the longest first, to the lightest part
        i = load_of.index(min(load_of))
        parts[i].append(f)
        load_of[i] += weight[f]
    for i, part in enumerate(parts, 1):
        Path(f"{out}-{i}").write_text("".join(f"{f}\n" for f in sorted(part)))
    said = ", ".join(f"{len(p)} files ~{s:.0f} s" for p, s in zip(parts, load_of, strict=True))
    how = "last run's seconds" if known else "file sizes (no run recorded yet)"
    print(f"{Path(out).name}: {n} parts by {how}: {said}", file=sys.stderr)


def record(times_path: str, parts: list[str]) -> None:
    merged = load(times_path)
    for part in parts:
        merged.update(load(part))
    if merged:
        Path(times_path).write_text(json.dumps(merged, indent=0, sort_keys=True) + "\n")


if __name__ == "__main__":
    if sys.argv[1] == "split":
        split(int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        record(sys.argv[2], sys.argv[3:])
