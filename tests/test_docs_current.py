"""Words of the docs that describe the code, kept true by the code itself: the libraries
attnguard patches (SECURITY.md, docs/how-it-works.md) from the integrations' registry, their
version windows from each integration's declaration, and docs/broken-flash-attn.md's tables up to
the newest transformers release a test run uses (attnguard/support.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from helpers.processes import PY, subprocess_env

from attnguard import support
from attnguard.integrations import REGISTRY, LibraryIntegration

REPO = Path(__file__).resolve().parent.parent


def _patched_names() -> list[str]:
    """What each integration patches, as the docs name it: the library's distribution, or the
    module where that is part of a larger library (torch.distributed)."""
    names = []
    for integration in REGISTRY:
        triggers = {part.trigger for part in integration.parts}
        if integration.distribution == "torch":
            (trigger,) = triggers
            names.append(trigger)
        else:
            names.append(integration.distribution)
    return names


def _listed(text: str) -> list[str]:
    return [n.strip() for n in re.split(r",\s+|\s+and\s+", text.replace("\n", " ")) if n.strip()]


def test_security_names_every_library_attnguard_patches() -> None:
    text = (REPO / "SECURITY.md").read_text()
    said = re.search(r"and patches (.+?) when\s+they are imported", text, re.S)
    assert said, "SECURITY.md no longer says what the start-up hook patches"
    assert _listed(said.group(1)) == _patched_names()


def test_how_it_works_names_every_window_and_where_it_is_declared() -> None:
    text = (REPO / "docs" / "how-it-works.md").read_text()
    said = re.search(
        r"declares its supported\s+versions once, in its own package \((.+?)\): (.+?);", text, re.S
    )
    assert said, "docs/how-it-works.md no longer says where the version windows are declared"
    where, windows = said.groups()
    assert "`attnguard/integrations/<library>/__init__.py`" in where
    libraries = [i for i in REGISTRY if isinstance(i, LibraryIntegration) and i.high is not None]
    expected = [f"{i.distribution} {i.window()}" for i in libraries]
    assert _listed(windows) == expected
    for integration in libraries:  # the file named is the one that declares it
        package = REPO / "attnguard" / "integrations" / integration.name / "__init__.py"
        assert "LibraryIntegration(" in package.read_text(), package


def _releases(cell: str) -> list[tuple[int, int]]:
    """The transformers minors a table row's first cell names: "5.1-5.24", "4.51"."""
    found = re.fullmatch(r"(\d+)\.(\d+)(?:-(\d+)\.(\d+))?", cell.strip())
    if not found:
        return []
    a, b, c, d = found.groups()
    return [(int(a), int(b)), (int(c or a), int(d or b))]


def test_broken_flash_attn_tables_reach_the_newest_tested_release() -> None:
    """Every table of docs/broken-flash-attn.md, one row per range of transformers releases,
    reaches the newest release the test runs use (a table that stops before it says nothing
    about the release users install)."""
    newest = tuple(int(p) for p in support.TRANSFORMERS_NEWEST.split(".")[:2])
    text = (REPO / "docs" / "broken-flash-attn.md").read_text()
    tables = re.findall(r"(?:^\| transformers \|.*\n)(?:^\|.*\n)+", text, re.M)
    assert len(tables) == 3
    for table in tables:
        reached = max(
            (r[-1] for line in table.splitlines() if (r := _releases(line.split("|")[1]))),
            default=None,
        )
        assert reached is not None and reached >= newest, (table.splitlines()[0], reached)


# --- README's words about where things go, checked by doing it ----------------------------------

_EMIT = (
    "import attnguard\n"
    "from attnguard.observability import events\n"
    "events.emit('backend_fallback', site='t', reason_code='package_missing', reason='y',"
    " applied=attnguard.settings().changes_things)\n"
)


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", code], env=subprocess_env(**env), capture_output=True, text=True, timeout=120
    )


def test_a_log_path_gets_its_missing_directories_as_readme_says(tmp_path: Path) -> None:
    readme = (REPO / "README.md").read_text()
    assert "its missing directories are created" in readme
    assert "must name a file in a directory you can write to" not in readme
    path = tmp_path / "not" / "yet" / "there" / "events-{rank}.jsonl"
    res = _python(_EMIT, ATTNGUARD_LOG=str(path))
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert (tmp_path / "not" / "yet" / "there" / "events-0.jsonl").read_text().count("\n") >= 2
    # a path that cannot be created (its "directory" is a file): one line at start, events on
    # stderr
    (tmp_path / "a-file").write_text("")
    res = _python(_EMIT, ATTNGUARD_LOG=str(tmp_path / "a-file" / "events.jsonl"))
    assert res.returncode == 0 and "invalid ATTNGUARD_LOG" in res.stderr


def test_warn_mode_summary_goes_where_readme_says(tmp_path: Path) -> None:
    readme = " ".join((REPO / "README.md").read_text().split())
    assert (
        "In warn mode (`ATTNGUARD_MODE=warn`) nothing was changed, so the summary is an INFO "
        "event: by default it does not reach stderr; it goes to the log file "
        '(`ATTNGUARD_LOG=stderr,<path>`) and to the `"attnguard"` logger at INFO, and to '
        "stderr with `ATTNGUARD_LOG_LEVEL=info`."
    ) in readme
    log = tmp_path / "events.jsonl"
    res = _python(_EMIT, ATTNGUARD_MODE="warn", ATTNGUARD_LOG=f"stderr,{log}")
    assert "backend_fallback" in res.stderr and "summary" not in res.stderr
    said = [json.loads(line) for line in log.read_text().splitlines()]
    (summary,) = [e for e in said if e["event"] == "summary"]
    assert summary["level"] == "info" and summary["would_have"] == 1
    logged = (
        "import logging\n"
        "seen = []\n"
        "class Keep(logging.Handler):\n"
        "    def emit(self, record):\n"
        "        seen.append(record.event)\n"
        "logging.getLogger('attnguard').addHandler(Keep())\n"
        "logging.getLogger('attnguard').setLevel(logging.INFO)\n" + _EMIT + "attnguard.finish()\n"
        "print(seen)\n"
    )
    res = _python(logged, ATTNGUARD_MODE="warn", ATTNGUARD_LOG="none")
    assert "'summary'" in res.stdout, res.stdout
    res = _python(_EMIT, ATTNGUARD_MODE="warn", ATTNGUARD_LOG_LEVEL="info")
    assert '"event": "summary"' in res.stderr, res.stderr[-2000:]


def _cpu_median(text: str, install: str) -> float:
    """The per-pair CPU ms median of docs/benchmarks.md's start-up row for ``install``."""
    row = re.search(rf"^\| {install}: `-c pass`: `ATTNGUARD=0` vs `1` \|(.+)$", text, re.M)
    assert row, f"docs/benchmarks.md has no '{install}' start-up row"
    return float(row.group(1).split("|")[4].split()[0])


def test_readme_start_up_cost_is_the_one_measured() -> None:
    """README's cost of ATTNGUARD=1 in a process that imports nothing guarded is what
    bench/bench_startup.py measured (docs/benchmarks.md), with and without bytecode."""
    readme = " ".join((REPO / "README.md").read_text().split())
    said = re.search(
        r"pays (\d+) to (\d+) ms where attnguard's bytecode is compiled .*? and about (\d+) ms "
        r"where none can be written",
        readme,
    )
    assert said, "README no longer says what ATTNGUARD=1 costs a process"
    low, high, about = map(int, said.groups())
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    assert low <= _cpu_median(benchmarks, "compiled") <= high
    assert abs(_cpu_median(benchmarks, "no bytecode") - about) <= 0.25 * about
