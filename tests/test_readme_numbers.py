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
from conftest import PY, REPO, subprocess_env


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


@pytest.mark.parametrize("kind", run_record.KINDS)
def test_the_last_recorded_run_holds_readmes_counts(kind: str) -> None:
    """The run recorded last in this checkout (the previous run of that command)."""
    if run_record.last(kind) is None:
        pytest.skip(f"no {kind} run recorded in {run_record.runs_dir()} yet")
    holds, said = run_record.check(kind)
    assert holds, said
