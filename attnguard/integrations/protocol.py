"""What an integration is: the typed protocol every library integration implements.

An integration owns everything attnguard knows about one library. It declares once the versions
of its library it supports (the ones CI tests, see README "Compatibility"); outside them it does
not patch, and one ``observed`` event (``version_unsupported``) says why: no guessing on
internals never tested. It has one or more parts, each a patch module (``patch(module)`` /
``unpatch()``, its patches in a :class:`~attnguard.integrations.ledger.Ledger`) with the import
that triggers it: each part is imported only when its library is, so activating attnguard
imports neither torch nor any patched library. This module and the integrations' package
``__init__`` files stay light for that reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, kw_only=True)
class Part:
    """One patch module of an integration and the import that triggers its patch."""

    module: str  # dotted name of the patch module: patch(target module) / unpatch()
    trigger: str  # the module whose import patches it (patched at once if already imported)


@runtime_checkable
class Integration(Protocol):
    """One patched library (the runtime walks :data:`attnguard.integrations.REGISTRY`)."""

    @property
    def name(self) -> str:
        """As in ATTNGUARD_DISABLE (and in the ``site`` of its events)."""

    @property
    def distribution(self) -> str:
        """The library's distribution name (for its version)."""

    @property
    def package(self) -> str:
        """The library's import name (its ``__version__`` says what runs)."""

    @property
    def parts(self) -> tuple[Part, ...]:
        """Its patch modules, in patch order."""

    @property
    def switchable(self) -> bool:
        """Whether ATTNGUARD_DISABLE may name it (an integration that changes nothing the
        program computes is not: the job summary's view of the process group)."""

    def supports(self, version: str | None) -> str | None:
        """Why the library at ``version`` is outside what this integration supports; None when
        it is supported."""


@dataclass(frozen=True, kw_only=True)
class LibraryIntegration:
    """An :class:`Integration` declared as data: a version window and its parts."""

    name: str
    distribution: str
    package: str
    low: tuple[int, ...]  # the lowest supported release
    high: tuple[int, ...] | None  # the first unsupported release; None: every release
    parts: tuple[Part, ...]
    switchable: bool = True

    def window(self) -> str:
        """The supported versions as a specifier: ``">=2.6,<3"``."""
        if self.high is None:
            return f">={spelled(self.low)}"
        return f">={spelled(self.low)},<{spelled(self.high)}"

    def supports(self, version: str | None) -> str | None:
        """Why ``version`` is outside the window, or None when it is inside. An unknown version
        (no metadata, unparsable) is not guessed at: unsupported."""
        window = self.window()
        numbers = release(version or "")
        if not numbers:
            return (
                f"{self.distribution} has no readable version ({version!r}); "
                f"this integration supports {window}"
            )
        if self.low <= numbers and (self.high is None or numbers < self.high):
            return None
        return (
            f"{self.distribution} {version} is outside the versions this integration supports "
            f"({window})"
        )


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"5.0.0.dev0"`` -> (5, 0, 0), ``"2.8.3.post2"``
    -> (2, 8, 3). A pre-release counts as its release (6.0.0rc1 is 6.0: unsupported)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def minor_release(dist: str) -> tuple[int, int] | None:
    """(major, minor) of an installed distribution, from its metadata; None when unknown."""
    from importlib import metadata

    try:
        numbers = release(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None
    return (numbers + (0,))[:2] if numbers else None


def spelled(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))
