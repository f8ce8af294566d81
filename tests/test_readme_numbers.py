"""README's numbers about its test commands come from the runs themselves (tests/run_record.py):
the full suite and the smoke suite record their counts and minutes, and README's ranges are
checked against the last recorded run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import run_record
from helpers.processes import PY, REPO, subprocess_env


def test_readme_states_each_commands_time_and_counts_as_ranges() -> None:
    claims = run_record.claims(run_record.README.read_text())
    assert set(claims) == {"full", "smoke"}
    for claim in claims.values():
        assert claim.cpus == 2
        assert claim.minutes[0] < claim.minutes[1]
        assert claim.passed[0] < claim.passed[1] and claim.skipped[0] < claim.skipped[1]
    # the quick command beside the full one is the one that records the smoke run
    assert "bash scripts/test.sh -m smoke" in run_record.README.read_text()


def _run(**changes: Any) -> run_record.Run:
    base = dict(
        kind="full",
        passed=1200,
        skipped=320,
        failed=0,
        errors=0,
        minutes=20.0,
        cpus=2,
        date="2026-11-28",
        transformers="5.24.0",
    )
    return run_record.Run(**{**base, **changes})


def test_counts_outside_the_range_contradict_readme_minutes_are_said() -> None:
    claim = run_record.Claim((18, 30), 2, (1150, 1300), (300, 360))
    assert run_record.mismatches(_run(), claim) == []
    assert run_record.mismatches(_run(passed=1083, skipped=322), claim) == [
        "1083 passed, README says 1,150 to 1,300"
    ]
    assert run_record.mismatches(_run(failed=2), claim)[0].startswith("2 failed")
    assert run_record.slower_or_faster(_run(minutes=41.0), claim) == (
        "41.0 minutes on 2 CPUs, README says 18 to 30"
    )
    assert run_record.slower_or_faster(_run(minutes=6.0, cpus=16), claim) == ""  # another machine
    # README's time includes the test command's set-up
    assert run_record.slower_or_faster(_run(minutes=29.0, setup_minutes=2.0), claim) == (
        "31.0 minutes on 2 CPUs, README says 18 to 30"
    )


def _config(mark: str = "", source: str = "TESTPATHS", **option: Any) -> Any:
    option = {"markexpr": mark, "keyword": "", "collectonly": False, **option}
    return SimpleNamespace(
        option=SimpleNamespace(**option), args_source=SimpleNamespace(name=source)
    )


def test_only_the_readme_commands_record(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TEST_ZOO", raising=False)
    assert run_record.run_kind(_config()) == "full"
    assert run_record.run_kind(_config("smoke")) == "smoke"
    assert run_record.run_kind(_config("not once")) is None
    assert run_record.run_kind(_config(source="ARGS")) is None  # files named
    assert run_record.run_kind(_config(keyword="advice")) is None
    assert run_record.run_kind(_config(collectonly=True)) is None
    monkeypatch.setenv("TEST_ZOO", "all")
    assert run_record.run_kind(_config()) is None


def test_a_smoke_session_records_itself(tmp_path: Path) -> None:
    """A pytest session run as README's quick command (``-m smoke`` over the testpaths) writes
    its record through tests/conftest.py's hooks, and the check reads it."""
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "test_a.py").write_text(
        "import pytest\n"
        "@pytest.mark.smoke\ndef test_one(): pass\n"
        "@pytest.mark.smoke\ndef test_two(): pytest.skip('not here')\n"
        "def test_three(): pass\n"
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\ntestpaths = t\nmarkers = smoke: s\n")
    runs = tmp_path / "runs"
    env = subprocess_env(TEST_RUNS_DIR=str(runs))
    env.pop("TEST_ZOO", None)  # CI's newest lane sets it (a whole-zoo session is not recorded)
    env["PYTHONPATH"] = f"{REPO / 'tests'}:{env['PYTHONPATH']}"
    res = subprocess.run(
        [PY, "-m", "pytest", "-p", "conftest", "-m", "smoke", "-q", "-p", "no:cacheprovider"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    recorded = json.loads((runs / "smoke.json").read_text())
    assert (recorded["passed"], recorded["skipped"], recorded["failed"]) == (1, 1, 0)
    assert recorded["cpus"] == run_record.cpus() and recorded["kind"] == "smoke"
    assert not (runs / "full.json").exists()


# the tests each README command runs, counted at collection (module skips: one each, as in a run)
COUNTER = """
import json, os

def pytest_collection_finish(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", []))
    smoke = sum(1 for item in session.items if item.get_closest_marker("smoke"))
    counts = {"full": len(session.items) + skipped, "smoke": smoke + skipped}
    with open(os.environ["COUNTS_TO"], "w") as out:
        json.dump(counts, out)
"""


def test_the_suite_holds_readmes_counts(tmp_path: Path) -> None:
    """The tests each README command runs (its marker over the testpaths, collected as the command
    collects them, in this environment) number within README's passed + skipped range: a suite
    that grows or shrinks out of README's numbers fails here, not only in a recorded run."""
    (tmp_path / "readme_counts.py").write_text(COUNTER)
    env = subprocess_env(COUNTS_TO=str(tmp_path / "counts.json"))
    for var in ("TEST_ZOO", "TEST_ZOO_SELECT"):  # README's commands enumerate the zoo's sample
        env.pop(var, None)
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    res = subprocess.run(
        [
            PY,
            "-m",
            "pytest",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "readme_counts",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    counts = json.loads((tmp_path / "counts.json").read_text())
    for kind, claim in run_record.claims(run_record.README.read_text()).items():
        low, high = claim.passed[0] + claim.skipped[0], claim.passed[1] + claim.skipped[1]
        assert low <= counts[kind] <= high, (
            f"the {kind} command runs {counts[kind]} tests; README says {claim.passed[0]:,} to "
            f"{claim.passed[1]:,} passed and {claim.skipped[0]:,} to {claim.skipped[1]:,} skipped"
        )
