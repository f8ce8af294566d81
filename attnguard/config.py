"""Settings: the one place that reads ATTNGUARD_* variables and validates them.

Every other module receives a :class:`Settings`; none reads the environment itself.
An invalid value raises ``ValueError`` naming the variable, the value and the valid values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

MODES = ("fix", "warn", "strict", "off")
LOG_FORMATS = ("json", "console")
DTYPES = ("auto", "bf16", "fp16")
FP32_POLICIES = ("cast", "fallback")
# Backends a load-time fallback may select (transformers attn_implementation keys). "eager" is
# always available; flash kernels are never a fallback target (they are what failed).
FALLBACK_BACKENDS = ("sdpa", "eager", "flex_attention")

# Names accepted by ATTNGUARD_DISABLE: remedies, then integrations (patched libraries).
REMEDIES = (
    "fallback",  # replace an unusable backend at load time
    "cast",  # load or run in a half dtype a kernel needs
    "place",  # load a flash model straight onto its GPU
    "device_map",  # one replica per rank under torchrun + device_map="auto"
    "align",  # move q/k/v, rotary inputs onto one device
    "unify",  # give q/k/v (and bias) one dtype
    "reroute",  # send one call to SDPA when the kernel cannot take it
    "recover",  # re-run a call on SDPA after a known kernel error
)
INTEGRATIONS = ("transformers", "flash_attn", "xformers")

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Settings:
    """Validated attnguard settings (see README "Configuration")."""

    enabled: bool = True
    mode: str = "fix"
    disable: frozenset[str] = field(default_factory=frozenset)
    log: str = "stderr"
    log_format: str = "console"
    dtype: str = "auto"
    fallback: tuple[str, ...] = ("sdpa", "eager")
    fp32_policy: str = "cast"

    def allows(self, name: str) -> bool:
        """True when remedy or integration ``name`` is not disabled."""
        return name not in self.disable

    @property
    def changes_things(self) -> bool:
        """True in the modes that apply remedies (fix); warn/strict/off change nothing."""
        return self.mode == "fix" and self.enabled

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view, for the ``activated`` event."""
        d = dataclasses.asdict(self)
        d["disable"] = sorted(self.disable)
        d["fallback"] = list(self.fallback)
        return d


def _bad(var: str, value: object, valid: object) -> ValueError:
    return ValueError(f"attnguard: invalid {var}={value!r}; valid values: {valid}")


def _choice(var: str, value: str, valid: tuple[str, ...]) -> str:
    v = value.strip().lower()
    if v not in valid:
        raise _bad(var, value, " | ".join(valid))
    return v


def _names(var: str, value: str | list[str] | tuple[str, ...], valid: tuple[str, ...]) -> list[str]:
    items = value.split(",") if isinstance(value, str) else list(value)
    out = [s.strip().lower() for s in items if s.strip()]
    for name in out:
        if name not in valid:
            raise _bad(var, value, "a comma list of " + ", ".join(valid))
    return out


def _switch(var: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise _bad(var, value, "1 | 0")


def _log_format_default(log: str) -> str:
    if log not in ("stderr", "none"):
        return "json"  # files are for machines
    try:
        import sys

        return "console" if sys.stderr.isatty() else "json"
    except Exception:
        return "json"


def _validate_log(var: str, value: str) -> str:
    v = value.strip()
    if not v:
        raise _bad(var, value, "stderr | none | a file path (may contain {rank} and {pid})")
    if v.lower() in ("stderr", "none"):
        return v.lower()
    try:
        v.format(rank=0, pid=0)
    except (KeyError, IndexError, ValueError):
        raise _bad(
            var, value, "stderr | none | a file path whose only placeholders are {rank} and {pid}"
        ) from None
    return v


# variable -> Settings field, with its parser
_ENV = {
    "ATTNGUARD": "enabled",
    "ATTNGUARD_MODE": "mode",
    "ATTNGUARD_DISABLE": "disable",
    "ATTNGUARD_LOG": "log",
    "ATTNGUARD_LOG_FORMAT": "log_format",
    "ATTNGUARD_DTYPE": "dtype",
    "ATTNGUARD_FALLBACK": "fallback",
    "ATTNGUARD_FP32_POLICY": "fp32_policy",
}
_VAR_OF = {f: v for v, f in _ENV.items()}


def _parse(fld: str, value: Any) -> Any:
    var = _VAR_OF[fld]
    if fld == "enabled":
        return value if isinstance(value, bool) else _switch(var, str(value))
    if fld == "mode":
        return _choice(var, str(value), MODES)
    if fld == "disable":
        return frozenset(_names(var, value, REMEDIES + INTEGRATIONS))
    if fld == "log":
        return _validate_log(var, str(value))
    if fld == "log_format":
        return _choice(var, str(value), LOG_FORMATS)
    if fld == "dtype":
        return _choice(var, str(value), DTYPES)
    if fld == "fallback":
        names = _names(var, value, FALLBACK_BACKENDS)
        if not names:
            raise _bad(var, value, "a non-empty comma list of " + ", ".join(FALLBACK_BACKENDS))
        return tuple(names)
    if fld == "fp32_policy":
        return _choice(var, str(value), FP32_POLICIES)
    raise AssertionError(fld)


def load(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Build Settings from ATTNGUARD_* variables, then keyword overrides (field names).

    ``import attnguard`` means "guard this program", so a missing ATTNGUARD counts as on here;
    the start-up hook only imports attnguard when ATTNGUARD is on.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    for var, fld in _ENV.items():
        raw = env.get(var)
        if raw is not None and (raw.strip() or fld in ("enabled", "disable")):
            values[fld] = _parse(fld, raw)
    for key, value in (overrides or {}).items():
        if key not in _VAR_OF:
            raise ValueError(
                f"attnguard: unknown setting {key!r}; valid settings: {', '.join(_VAR_OF)}"
            )
        values[key] = _parse(key, value)
    if "log_format" not in values:
        values["log_format"] = _log_format_default(values.get("log", "stderr"))
    if values.get("mode") == "off":
        values["enabled"] = False
    return Settings(**values)
