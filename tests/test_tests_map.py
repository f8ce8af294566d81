"""tests/README.md is the map of the tests: every module of the package has its row, naming test
files that exist; every helper module it describes exists and every one that exists is
described; and no file in tests/ is over 600 lines."""

from __future__ import annotations

import re

from helpers.processes import REPO, TESTS

README = TESTS / "README.md"
ROW = re.compile(r"^\| `(attnguard/[\w/]+\.py)` \| (.+) \|$", re.M)


def _rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for module, tests in ROW.findall(README.read_text()):
        assert module not in rows, f"{module} has two rows"
        rows[module] = re.findall(r"`([^`]+)`", tests)
    return rows


def test_every_module_of_the_package_has_a_row_and_no_row_is_stale() -> None:
    modules = {str(p.relative_to(REPO)) for p in (REPO / "attnguard").rglob("*.py")}
    rows = _rows()
    assert sorted(modules - set(rows)) == [], "modules without a row in tests/README.md"
    assert sorted(set(rows) - modules) == [], "rows of modules that are gone"


def test_every_test_file_named_exists() -> None:
    for module, tests in _rows().items():
        assert tests, f"{module}: no test named"
        for name in tests:
            assert re.fullmatch(r"(gpu/)?test_\w+\.py", name), (module, name)
            assert (TESTS / name).is_file(), f"{module}: {name} is not in tests/"


def test_the_helpers_described_are_the_helpers_there() -> None:
    text = README.read_text()
    there = {p.name for p in (TESTS / "helpers").glob("*.py")} - {"__init__.py"}
    section = text.split("- `helpers/`", 1)[1].split("- `workers/`", 1)[0]
    described = set(re.findall(r"`(\w+\.py)`", section))
    assert sorted(there - described) == [], "helper modules tests/README.md does not describe"
    assert sorted(described - there) == [], "helper modules tests/README.md names that are gone"


def test_no_file_in_tests_is_over_600_lines() -> None:
    long = {
        str(p.relative_to(TESTS)): n
        for p in TESTS.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 600
    }
    assert long == {}
