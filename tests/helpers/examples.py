"""The examples of examples/ run as a user runs them (a fresh Python, this checkout on
PYTHONPATH, attnguard's JSON lines on stderr), what each reported (its EVENTS and PLANNED lines,
the errors it measured) and the checks every run gets: the stderr stream carries exactly the
events the example reported, the exit summary names them, and the output README's "What you see"
table and docs/examples.md quote is what it printed. tests/test_examples.py and
tests/gpu/test_examples_gpu.py run them."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from attnguard.observability import events
from helpers.processes import PY, REPO, subprocess_env

EXAMPLES = REPO / "examples"
BOOKKEEPING = ("activated", "summary")


@dataclass
class Run:
    stdout: str
    stderr: str
    events: list[str] | None = None  # the EVENTS line
    planned: list[str] | None = None  # the PLANNED line
    logged: list[dict[str, Any]] = field(default_factory=list)  # stderr JSON lines
    errors: dict[str, tuple[float, float]] = field(default_factory=dict)  # name -> (err, scale)

    def caused(self) -> list[dict[str, Any]]:
        return [e for e in self.logged if e["event"] not in BOOKKEEPING]


# --- what README.md and docs/examples.md quote from the examples --------------------------------

README = (REPO / "README.md").read_text()
DOCS_EXAMPLES = (REPO / "docs" / "examples.md").read_text()
# README's "What you see" lines were recorded with one transformers release: transformers' own
# words ("without attnguard") are checked on that release, attnguard's on every release
RECORDED_WITH = re.search(r"lines recorded with transformers (\S+),", README).group(1)


def _table_rows(text: str, heading: str, example: str) -> list[list[str]]:
    """The cells of the rows naming ``example`` in the first table under ``heading``."""
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [row.strip().strip("|").split(" | ") for row in rows if f"{example}`" in row]


def quoted(cell: str) -> list[list[str]]:
    """The output a cell quotes (each code span), as its pieces around "…"."""
    spans = re.findall(r"``\s?(.+?)\s?``|`([^`]+)`", cell)
    return [[p.strip() for p in (a or b).split("…") if p.strip()] for a, b in spans]


def printed(pieces: list[str], lines: list[str]) -> bool:
    """Some line holds the pieces, in order."""
    for line in lines:
        at = 0
        for piece in pieces:
            at = line.find(piece, at)
            if at < 0:
                break
            at += len(piece)
        else:
            return True
    return False


def check_quotes(name: str, run: Run) -> None:
    """Every piece of output README's "What you see" table and docs/examples.md quote for this
    example is in what it printed (attnguard's console lines rendered from its JSON events, as
    its console sink renders them)."""
    lines = [*run.stdout.splitlines(), *run.stderr.splitlines()]
    lines += [events.render_console(e) for e in run.logged]
    cells = []
    for row in _table_rows(README, "## What you see", f"examples/{name}"):
        cells += [row[2]] + ([row[1]] if transformers.__version__ == RECORDED_WITH else [])
    (docs_row,) = _table_rows(DOCS_EXAMPLES, "| example |", name)
    cells += docs_row[3:5]
    for cell in cells:
        for pieces in quoted(cell):
            assert printed(pieces, lines), (name, pieces)


def how_it_works_says(name: str, run: Run) -> None:
    """docs/how-it-works.md's table of failures names, in this example's row, each event and
    reason code the example emitted (its "—" rows are the ones a CPU run shows for real)."""
    text = (REPO / "docs" / "how-it-works.md").read_text()
    (row,) = _table_rows(text, "## The failures it fixes", f"examples/{name}")
    for e in run.caused():
        assert f"`{e['event']}`" in row[2] and f"`{e['reason_code']}`" in row[2], (row, e)


# the exit status of an example that could not show what it is for here (docs/examples.md)
CANNOT_SHOW = 3


def run_example(
    name: str,
    *extra_path: str | Path,
    quotes: bool = True,
    status: int = 0,
    missing: tuple[str, ...] = (),
) -> Run:
    """Run ``examples/<name>`` as a user would; ``missing``: packages made absent for it (their
    import fails and ``importlib.util.find_spec`` finds nothing, as where they are not
    installed)."""
    env = subprocess_env(HF_HUB_OFFLINE="1", ATTNGUARD_LOG="stderr", ATTNGUARD_LOG_FORMAT="json")
    env["PYTHONPATH"] = os.pathsep.join([*map(str, extra_path), env["PYTHONPATH"]])
    command = [PY, str(EXAMPLES / name)]
    if missing:
        command = [PY, "-c", _WITHOUT.format(missing=list(missing), path=str(EXAMPLES / name))]
    res = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == status, f"{name} exited {res.returncode}:\n{res.stderr[-4000:]}"
    run = Run(res.stdout, res.stderr)
    for line in res.stdout.splitlines():
        if line.startswith("EVENTS: "):
            run.events = json.loads(line[len("EVENTS: ") :])
        elif line.startswith("PLANNED: "):
            run.planned = json.loads(line[len("PLANNED: ") :])
        elif line.startswith("MAX_ERR "):
            label, rest = line[len("MAX_ERR ") :].rsplit(": ", 1)
            err, scale = rest.split(" (scale ")
            run.errors[label] = (float(err), float(scale.rstrip(")")))
    for line in res.stderr.splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("schema") == 1:
                run.logged.append(record)
    # every example ends with its EVENTS line (docs/examples.md)
    assert run.events is not None, res.stdout[-2000:]
    # the stderr stream and the example's own report agree, and the exit summary names them
    # (its counts include repeats, which are emitted once)
    assert [e["event"] for e in run.caused()] == run.events
    summary = [e for e in run.logged if e["event"] == "summary"]
    if run.events:
        assert len(summary) == 1
        assert set(summary[0]["events"]) == set(run.events)
    else:  # nothing changed: the summary is INFO, kept off stderr by default
        assert summary == []
    # a model on transformers' flash path says what computes its calls
    if any(e.get("rule") == "flash-on-sdpa" for e in run.logged):
        assert "its kernel calls computed by attnguard's SDPA twins" in run.stdout
    # transformers' own "cast back to float32" warning is explained where it appears
    for note in (
        "Casting fp32 inputs back to torch.float32",
        "cast back the input in torch.float32",
    ):
        if note in run.stderr:
            assert "Not from attnguard: transformers logged" in run.stdout
            assert "the cast changes nothing" in run.stdout
    if quotes and not torch.cuda.is_available():  # the docs quote a CPU machine's output
        check_quotes(name, run)
    return run


_WITHOUT = (
    "import runpy, sys\n"
    "sys.modules.update(dict.fromkeys({missing}))\n"
    "sys.argv = [{path!r}]\n"
    "sys.path.insert(0, {path!r}.rsplit('/', 1)[0])\n"
    "runpy.run_path({path!r}, run_name='__main__')\n"
)


def close_to_reference(run: Run, rel: float) -> None:
    assert run.errors, run.stdout
    for label, (err, scale) in run.errors.items():
        assert err <= rel * max(scale, 1.0), (label, err, scale)
