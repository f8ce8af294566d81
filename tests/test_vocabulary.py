"""Every event name, reason code, decision rule and setting the README and docs name is one the
code has: an alert or a query written from the docs must be able to fire. Reads README.md and
docs/*.md as a user does and checks them against attnguard.observability.events.EVENTS, attnguard.observability.reasons,
attnguard.plan.TABLE and the settings of attnguard.config."""

from __future__ import annotations

import re

import pytest
from helpers.processes import REPO

from attnguard import config, kernels, plan
from attnguard.observability import advice, events, reasons
from attnguard.observability.advice import Facts

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
EVENT_NAMES = set(events.EVENTS)
CODES = set(reasons.REASONS)
SETTINGS = set(config._ENV) | {"ATTNGUARD_INTERNAL_PARENT"}

# how the docs spell each kind of name
PATTERNS = {
    "event": [
        r'"event":\s*"([a-z_]+)"',
        r"\[([a-z_]+) rank=",
        r"\bevent=([a-z_]+)",
        r"`([a-z_]+)` events?\b",
    ],
    "reason_code": [
        r'"reason_code":\s*"([A-Za-z0-9_]+)"',
        r"reason_code=([A-Za-z0-9_]+)",
        r"reason(?:_code)?\s+`([a-z0-9_]+)`",
        r"reason code\s+`([a-z0-9_]+)`",
    ],
    "rule": [r'"rule":\s*"([a-z0-9-]+)"', r"\brule `([a-z0-9-]+)`"],
    "setting": [r"\b(ATTNGUARD(?:_[A-Z0-9]+)*)\b"],
}


def named(kind: str) -> list[tuple[str, str]]:
    """(file, name) for every name of this kind the docs use."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for pattern in PATTERNS[kind]:
            found += [(doc.name, m) for m in re.findall(pattern, text)]
    return found


def test_the_docs_name_things_at_all() -> None:
    # the patterns must find what the docs say, or the checks below would pass on nothing
    assert len(named("event")) >= 5 and len(named("reason_code")) >= 3
    assert len(named("setting")) >= 10


@pytest.mark.parametrize(
    ("kind", "valid"),
    [
        ("event", EVENT_NAMES),
        ("reason_code", CODES | {"ValueError", "TypeError", "RuntimeError"}),
        ("rule", {r.id for r in plan.TABLE} | {r[0] for r in kernels.RULES}),
        ("setting", SETTINGS),
    ],
)
def test_every_name_in_the_docs_is_one_the_code_has(kind: str, valid: set[str]) -> None:
    unknown = sorted({(doc, name) for doc, name in named(kind) if name not in valid})
    assert unknown == [], f"{kind}s named in the docs that the code does not have: {unknown}"


def test_the_readme_lists_every_event() -> None:
    text = (REPO / "README.md").read_text()
    missing = [e for e in EVENT_NAMES if f"`{e}`" not in text]
    assert missing == []


def test_docs_reason_table_matches_the_vocabulary() -> None:
    """docs/observability.md's table of reason codes is the vocabulary, row for row."""
    text = (REPO / "docs" / "observability.md").read_text()
    rows = set(re.findall(r"^\| `([a-z0-9_]+)` \| `[a-z_]+`", text, flags=re.M))
    assert rows == CODES, (sorted(CODES - rows), sorted(rows - CODES))


def test_docs_reason_table_says_what_the_vocabulary_says() -> None:
    """Each row's events, meaning and hint are the vocabulary's words (the hint is what the
    summary prints), so the table cannot promise another fix than the one attnguard names."""
    text = (REPO / "docs" / "observability.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (`[a-z_`, ]+`) \| (.+) \| (.+) \|$", text, re.M)
    assert len(rows) == len(CODES)
    for code, evts, meaning, hint in rows:
        reason = reasons.REASONS[code]
        said = (evts, meaning, hint)
        assert said == (
            ", ".join(f"`{e}`" for e in reason.events),
            reason.meaning,
            advice.render(reason.hint) or "—",  # where it depends on facts: none recorded
        )


def test_a_hint_for_flash_and_xformers_calls_names_neither_kernel_alone() -> None:
    """A reason code that calls into flash-attn and into xformers both produce gets a hint true
    for both (the summary prints it without the call site): "before calling a flash kernel" was
    the advice for an xformers call."""
    import torch

    from attnguard import kernels

    cpu_query = torch.zeros(1, 4, 2, 8)
    by_kind = {
        kind: kernels.reroute_reason(kind, cpu_query, 8, None, {})
        for kind in (kernels.EntryKind.FLASH_KERNEL, kernels.EntryKind.XFORMERS)
    }
    shared = set(by_kind.values()) - {None}
    assert shared == {"cpu_tensors"}, by_kind
    for code in shared:
        for facts in (None, Facts(device="cpu"), Facts(device="cuda", capability=(9, 0))):
            hint = advice.render(reasons.REASONS[code].hint, facts).lower()
            assert ("flash" in hint) == ("xformers" in hint), (code, hint)


def test_the_docs_paths_exist() -> None:
    for doc in DOCS:
        text = doc.read_text()
        for rel in re.findall(
            r"`((?:attnguard|examples|tests|bench|scripts|docs)/[\w/.-]+)`", text
        ):
            assert (REPO / rel.rstrip("/")).exists(), (
                f"{doc.name} names {rel}, which does not exist"
            )
