"""The :class:`Settings` value every part of attnguard receives (:func:`attnguard.config.load`
builds it from ATTNGUARD_* variables; ``attnguard.config.Settings`` is this class).

Apart from :mod:`attnguard.config` because a frozen dataclass costs the import of
:mod:`dataclasses` (and :mod:`inspect` under it), which the start-up hook must not pay in every
guarded process just to check the raw values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Settings:
    """Validated attnguard settings (see README "Configuration")."""

    enabled: bool = True
    mode: str = "fix"
    disable: frozenset[str] = field(default_factory=frozenset)
    log: str = "stderr"
    log_format: str = "auto"
    log_level: str = "auto"
    console_ranks: tuple[int, ...] | None = None  # None: every rank
    dtype: str = "auto"
    fallback: tuple[str, ...] = ("sdpa", "eager")
    fp32_policy: str = "cast"
    kernel: str = "requested"
    kernel_cache: str = ""  # "": $XDG_CACHE_HOME/attnguard/kernels
    # opt-in numbers check (attnguard.verify): "" off, "all", a rate ("0.001") or "first:N"
    verify: str = ""

    @property
    def fastest(self) -> bool:
        """ATTNGUARD_KERNEL=fastest: flash-attention calls race for the fastest kernel."""
        return self.kernel == "fastest" and self.enabled

    def allows(self, name: str) -> bool:
        """True when remedy or integration ``name`` is not disabled."""
        return name not in self.disable

    @property
    def changes_things(self) -> bool:
        """True in the modes that apply remedies (fix); warn/strict/off change nothing."""
        return self.mode == "fix" and self.enabled

    @property
    def log_targets(self) -> tuple[str, ...]:
        """Where the text stream goes: ``"stderr"`` and/or file path templates (none: empty)."""
        if not self.enabled or self.log == "none":
            return ()
        return tuple(t.strip() for t in self.log.split(",") if t.strip())

    def format_for(self, target: str) -> str:
        """The line format of one target: JSON lines for files, whatever ``ATTNGUARD_LOG_FORMAT``
        says (it picks stderr's), console for a terminal stderr by default."""
        if target != "stderr":
            return "json"  # files are for machines: attnguard summary, log shippers
        if self.log_format != "auto":
            return self.log_format
        try:
            import sys

            return "console" if sys.stderr.isatty() else "json"
        except Exception:
            return "json"

    def threshold_for(self, target: str) -> str:
        """The lowest event level written to one target (``ATTNGUARD_LOG_LEVEL``)."""
        if self.log_level != "auto":
            return self.log_level
        return "warning" if target == "stderr" else "info"

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view, for the ``activated`` event."""
        d = dataclasses.asdict(self)
        d["disable"] = sorted(self.disable)
        d["fallback"] = list(self.fallback)
        d["console_ranks"] = "all" if self.console_ranks is None else list(self.console_ranks)
        return d


class InForce:
    """The settings in force, behind one attribute the runtime swaps in one step.

    The runtime owns the one instance (``attnguard.runtime.IN_FORCE``) and hands it to the
    integrations, which hand it to the call guard with each entry point: guarded calls read
    ``in_force.settings`` at every call, so a change of settings is atomic for running code.
    No ``__slots__``: torch.compile of torch 2.4 cannot read a slot's value on the traced path
    (a graph break; an error with ``fullgraph=True``)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
