"""Words of the docs that describe the code, kept true by the code itself: the libraries
attnguard patches (SECURITY.md, docs/how-it-works.md) from the integrations' registry, their
version windows from each integration's declaration, and docs/broken-flash-attn.md's tables up to
the newest transformers release a test run uses (attnguard/support.py)."""

from __future__ import annotations

import re
from pathlib import Path

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
