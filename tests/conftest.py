"""Shared fixtures. Every test starts and ends with attnguard deactivated and counts cleared.

``import attnguard`` activates from the environment; the test session imports it once with
ATTNGUARD_LOG=none so pytest's own output stays clean, then each test switches it on as needed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for _var in [v for v in os.environ if v.startswith("ATTNGUARD")]:
    del os.environ[_var]  # a developer's shell settings must not leak into tests
os.environ["ATTNGUARD_LOG"] = "none"

import attnguard  # noqa: E402
from attnguard import events  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STANDINS = REPO / "tests" / "standins"

attnguard.deactivate()


@pytest.fixture(autouse=True)
def _clean_guard() -> Iterator[None]:
    attnguard.deactivate()
    events.reset_counts()
    yield
    attnguard.deactivate()
    events.reset_counts()


@pytest.fixture
def captured() -> Iterator[list[dict[str, Any]]]:
    """Every event emitted during the test (attnguard's own capture helper)."""
    with events.capture() as got:
        yield got


@pytest.fixture
def guard(captured: list[dict[str, Any]]) -> Iterator[Any]:
    """attnguard active in fix mode with no stream output; returns a re-activation function."""

    def _activate(**overrides: Any) -> attnguard.Settings:
        return attnguard.activate(log="none", **overrides)

    _activate()
    yield _activate


def names(evts: list[dict[str, Any]], *, skip: tuple[str, ...] = ("activated",)) -> list[str]:
    """Event names in order, without bookkeeping events."""
    return [e["event"] for e in evts if e["event"] not in skip]


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports this checkout of attnguard."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


PY = sys.executable
