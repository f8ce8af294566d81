"""What the README's test commands took, recorded by the test run itself and checked against the
README, so its numbers stay those of a real run.

* Recording (tests/conftest.py's hooks): a session that is one of the README's two commands
  writes ``<checkout>/.test-runs/<kind>.json`` at its end: ``full`` (``bash scripts/test.sh``:
  pytest on its ``testpaths``, no ``-m`` / ``-k`` / file arguments, no ``TEST_ZOO=all``) and
  ``smoke`` (``bash scripts/test.sh -m smoke``), with the counts, the minutes, the date, the CPUs
  it had, the transformers it ran and the test command's set-up before pytest started
  (``TEST_SETUP_SECONDS``, from scripts/test.sh). Other sessions record nothing.
* Checking (``python tests/run_record.py``, run by scripts/test.sh after such a session):
  README states each command's time (set-up included) and counts as ranges ("How long it takes: 18 to 30 minutes on a 2-core machine ... (1,150
  to 1,300 passed, 300 to 360 skipped", the same for "How long the smoke suite takes:"); a
  recorded run must fall inside them, so the README
  changes when the suite does, not at every run. Counts outside their range fail the check
  (the suite changed: README must follow); minutes outside theirs, on as many CPUs as README
  names, are said but do not fail it (a machine shared with other work is slower; a larger one
  is faster), for whoever updates README.

Not a test module (no ``test_`` prefix): imported by tests/conftest.py and the tests.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
KINDS = ("full", "smoke")


def runs_dir() -> Path:
    return Path(os.environ.get("TEST_RUNS_DIR") or REPO / ".test-runs")


@dataclass(frozen=True)
class Run:
    kind: str
    passed: int
    skipped: int
    failed: int
    errors: int
    minutes: float
    cpus: int
    date: str
    transformers: str
    setup_minutes: float = 0.0  # the test command's set-up before pytest (records before: none)


def run_kind(config: Any) -> str | None:
    """Which README command this pytest session is ("full", "smoke"), or None."""
    option = config.option
    if getattr(option, "collectonly", False) or getattr(option, "keyword", ""):
        return None
    if getattr(option, "lf", False) or getattr(option, "deselect", None):
        return None
    source = getattr(config, "args_source", None)
    if source is None or source.name != "TESTPATHS":  # file or directory arguments were given
        return None
    if os.environ.get("TEST_ZOO") == "all":
        return None
    mark = (getattr(option, "markexpr", "") or "").strip()
    return {"": "full", "smoke": "smoke"}.get(mark)


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 0


def record(kind: str, stats: dict[str, list[Any]], seconds: float) -> Path:
    """Write this session's run (``stats``: the terminal reporter's, by outcome)."""
    import datetime

    try:
        from importlib.metadata import version

        transformers = version("transformers")
    except Exception:
        transformers = "?"
    run = Run(
        kind=kind,
        passed=len(stats.get("passed", [])),
        skipped=len(stats.get("skipped", [])),
        failed=len(stats.get("failed", [])),
        errors=len(stats.get("error", [])),
        minutes=round(seconds / 60, 1),
        cpus=cpus(),
        date=datetime.date.today().isoformat(),
        transformers=transformers,
        setup_minutes=round(float(os.environ.get("TEST_SETUP_SECONDS") or 0) / 60, 1),
    )
    where = runs_dir()
    where.mkdir(parents=True, exist_ok=True)
    path = where / f"{kind}.json"
    path.write_text(json.dumps(asdict(run), indent=1) + "\n")
    return path


def last(kind: str) -> Run | None:
    path = runs_dir() / f"{kind}.json"
    try:
        return Run(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


# --- what README says -------------------------------------------------------------------------

_NUMBER = r"(\d{1,3}(?:,\d{3})*)"
# README's sentence for each command: "<label> A to B minutes on a N-core machine ... (P0 to P1
# passed, S0 to S1 skipped"
_LABELS = {"full": "How long it takes:", "smoke": "How long the smoke suite takes:"}
_CLAIM = (
    r"\s+(\d+(?:\.\d+)?)\s+to\s+(\d+(?:\.\d+)?)\s+minutes\s+on\s+a\s+(\d+)-core\s+machine.{0,400}?"
    rf"\({_NUMBER}\s+to\s+{_NUMBER}\s+passed,\s+{_NUMBER}\s+to\s+{_NUMBER}\s+skipped"
)


@dataclass(frozen=True)
class Claim:
    minutes: tuple[float, float]
    cpus: int
    passed: tuple[int, int]
    skipped: tuple[int, int]


def claims(text: str) -> dict[str, Claim]:
    """README's ranges for each command."""
    out = {}
    for kind, label in _LABELS.items():
        found = re.search(re.escape(label) + _CLAIM, text, re.S)
        if found is None:
            raise ValueError(f"README no longer states the {kind} command's time and counts")
        m0, m1 = float(found.group(1)), float(found.group(2))
        n, p0, p1, s0, s1 = (int(g.replace(",", "")) for g in found.groups()[2:])
        out[kind] = Claim((m0, m1), n, (p0, p1), (s0, s1))
    return out


def mismatches(run: Run, claim: Claim) -> list[str]:
    """What in ``run``'s counts contradicts the README (empty: they hold)."""
    out = []
    if run.failed or run.errors:
        out.append(f"{run.failed} failed, {run.errors} errors: not a run README's numbers describe")
    for what, value, (low, high) in (
        ("passed", run.passed, claim.passed),
        ("skipped", run.skipped, claim.skipped),
    ):
        if not low <= value <= high:
            out.append(f"{value} {what}, README says {low:,} to {high:,}")
    return out


def slower_or_faster(run: Run, claim: Claim) -> str:
    """Where a run on the README's number of CPUs took minutes outside its range, what to say
    ("" otherwise). Not a failure: a machine shared with other work is slower, and the counts
    are what the README's range must follow; the line says it, for whoever updates README."""
    low, high = claim.minutes
    minutes = round(run.minutes + run.setup_minutes, 1)
    if run.cpus != claim.cpus or low <= minutes <= high:
        return ""
    return f"{minutes} minutes on {run.cpus} CPUs, README says {low:g} to {high:g}"


def check(kind: str, text: str | None = None) -> tuple[bool, str]:
    """(holds, one line) for the last recorded run of ``kind``."""
    run = last(kind)
    if run is None:
        return True, f"no {kind} run recorded in {runs_dir()}"
    claim = claims(README.read_text() if text is None else text)[kind]
    found = mismatches(run, claim)
    said = (
        f"{run.kind} run of {run.date} ({run.passed} passed, {run.skipped} skipped, "
        f"{run.minutes} min of tests and {run.setup_minutes} min of set-up on {run.cpus} CPUs, "
        f"transformers {run.transformers})"
    )
    if found:
        return False, f"README's numbers do not hold for the {said}: {'; '.join(found)}"
    minutes = slower_or_faster(run, claim)
    if minutes:
        return True, f"README's counts hold for the {said}; its time does not: {minutes}"
    return True, f"README's numbers hold for the {said}"


if __name__ == "__main__":  # python tests/run_record.py [full|smoke]...
    results = [check(kind) for kind in (sys.argv[1:] or KINDS)]
    for _, line in results:
        print(line)
    sys.exit(0 if all(ok for ok, _ in results) else 1)
