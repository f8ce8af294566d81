"""What computes now: the one table of this process's verdicts (:class:`attnguard.kernels.Verdict`).

Written only where a verdict is applied (:func:`attnguard.callguard.apply_verdict`, and the call
guard's latch after a kernel error); read by the call guard, the integrations (is this kernel on
the twins?), the events, the exit summary and ``attnguard doctor``. A row is keyed by its
*subject*: what a library asks for, in that library's words —

* ``"transformers:flash_attention_2"``: transformers' flash code path for that implementation;
* ``"transformers:kernels-community/flash-attn2"``: a hub kernel transformers loads;
* ``"diffusers:flash_hub"``, ``"diffusers:flash"``: a diffusers attention backend.

Two views are kept as plain dicts because the per-call fast check reads them (a dict lookup is
all that path can afford): :attr:`WhatComputes.latched` (call sites whose kernel raised a known
error: their calls go straight to the twin) and :attr:`WhatComputes.twin_arguments` (flash
implementations whose calls the twins compute -> the keyword arguments they compute there).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .kernels import Verdict


def subject(library: str, what: str) -> str:
    """A row's key: ``what`` (an implementation, a hub kernel's name, a backend) in ``library``."""
    return f"{library}:{what.strip().split('|', 1)[-1]}"


class WhatComputes:
    """The table (one per process: :data:`NOW`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._rows: dict[str, Verdict] = {}
        # read on the per-call path without a lock (one dict lookup; torch.compile traces it)
        self.latched: dict[Hashable, str] = {}
        self.twin_arguments: dict[str, frozenset[str]] = {}

    def set(self, key: str, verdict: Verdict) -> None:
        with self._lock:
            self._rows[key] = verdict

    def get(self, key: str) -> Verdict | None:
        return self._rows.get(key)

    def on_twins(self, key: str) -> bool:
        """The twins compute ``key``'s calls now."""
        found = self._rows.get(key)
        return found is not None and found.twins

    def drop(self, key: str) -> Verdict | None:
        with self._lock:
            return self._rows.pop(key, None)

    def rows(self, library: str | None = None) -> dict[str, Verdict]:
        """A copy of the rows (of ``library``'s subjects only, where given)."""
        with self._lock:
            return {
                k: v
                for k, v in self._rows.items()
                if library is None or k.startswith(f"{library}:")
            }

    def clear(self, library: str | None = None) -> None:
        """Forget the rows of ``library`` (its integration is unpatched), or everything."""
        with self._lock:
            for key in [k for k in self._rows if library is None or k.startswith(f"{library}:")]:
                del self._rows[key]
            if library in (None, "transformers"):
                self.twin_arguments.clear()
            if library is None:
                self.latched.clear()

    def describe(self) -> list[dict[str, object]]:
        """For ``attnguard doctor`` and the exit summary: one entry per row."""
        return [
            {
                "subject": key,
                "requested": v.requested.describe(),
                "computes": v.computes,
                "rule": v.rule,
                "reason_code": v.reason_code,
                "reason": v.reason,
            }
            for key, v in sorted(self.rows().items())
        ]


NOW = WhatComputes()
