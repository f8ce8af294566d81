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
LOG_FORMATS = ("auto", "json", "console")
# Threshold of the text streams (stderr, files). auto: warning on stderr, info in a file.
LOG_LEVELS = ("auto", "info", "warning", "error")
LOG_TARGETS_HELP = (
    "stderr | none | a file path in a writable directory (placeholders {rank} and {pid} only, "
    "an int format spec such as {rank:03d} allowed) | stderr,<file path>"
)
DTYPES = ("auto", "bf16", "fp16")
FP32_POLICIES = ("cast", "fallback")
# ATTNGUARD_KERNEL: "requested" computes every call with the kernel the caller asked for (unless
# it cannot run); "fastest" (opt-in) serves flash-attention calls with the fastest kernel that
# computes the same numbers within the dtype's rounding, measured on this GPU (attnguard.selection).
KERNEL_CHOICES = ("requested", "fastest")
KERNEL_CACHE_HELP = (
    "an absolute path of a directory for the kernel decisions (one on a shared filesystem lets "
    "other nodes and later jobs reuse them), or empty for $XDG_CACHE_HOME/attnguard/kernels"
)
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
    log_format: str = "auto"
    log_level: str = "auto"
    console_ranks: tuple[int, ...] | None = None  # None: every rank
    dtype: str = "auto"
    fallback: tuple[str, ...] = ("sdpa", "eager")
    fp32_policy: str = "cast"
    kernel: str = "requested"
    kernel_cache: str = ""  # "": $XDG_CACHE_HOME/attnguard/kernels

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
        """The line format of one target: JSON for files, console for a terminal stderr."""
        if self.log_format != "auto":
            return self.log_format
        if target != "stderr":
            return "json"  # files are for machines
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


# A message shows at most this much of a bad value (a 1 MB value is not echoed back whole).
SHOWN_CHARS = 200


def shown(value: object, quote: bool = True) -> str:
    """``repr`` of a value for a message (``quote=False``: a string as it is), cut to
    :data:`SHOWN_CHARS` with its length said."""
    text = value if isinstance(value, str) else None
    if text is not None and len(text) > SHOWN_CHARS:
        cut = repr(text[:SHOWN_CHARS]) if quote else text[:SHOWN_CHARS]
        return f"{cut}... ({len(text)} characters)"
    if text is not None and not quote:
        return text
    out = repr(value)
    if len(out) > SHOWN_CHARS:
        return f"{out[:SHOWN_CHARS]}... ({len(out)} characters)"
    return out


def _bad(var: str, value: object, valid: object) -> ValueError:
    return ValueError(f"attnguard: invalid {var}={shown(value)}; valid values: {valid}")


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


def _log_problem(template: str, environ: Mapping[str, str]) -> str | None:
    """Why a file target cannot be used, or None. Placeholders first, then the path this
    process would write (its RANK and pid): not a directory, in a directory we may write to.
    Nothing is created here; the file is opened when attnguard activates."""
    import string  # only for file targets: the start-up hook stays light

    from .safefiles import path_problem

    why = path_problem(template)
    if why is not None:
        return why
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as exc:
        return f"malformed placeholder: {exc}"
    for _, name, spec, conversion in fields:
        if name is None:
            continue
        if name not in ("rank", "pid"):
            return f"placeholder {shown('{' + name + '}')} is not one of {{rank}}, {{pid}}"
        if conversion is not None:
            return f"placeholder {{{name}!{conversion}}} takes no conversion"
        try:
            if "{" in (spec or "") or "}" in (spec or ""):
                raise ValueError
            format(0, spec or "")
        except (ValueError, TypeError):
            return f"{shown('{' + name + ':' + (spec or '') + '}')} has no valid int format spec"
    try:
        rank = int(environ.get("RANK", "0") or 0)
    except ValueError:
        rank = 0
    try:
        path = template.format(rank=rank, pid=os.getpid())
    except Exception as exc:  # anything the checks above missed stays a clear error
        return f"cannot fill in its placeholders ({type(exc).__name__})"
    why = path_problem(path)
    if why is not None:
        return f"with its placeholders filled in, {why}"
    if path.endswith(("/", os.sep)) or os.path.isdir(path):
        return f"{shown(path, quote=False)} is a directory"
    if os.path.exists(path):
        return None if os.access(path, os.W_OK) else f"{shown(path, quote=False)} is not writable"
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            break
        parent = up
    if not os.path.isdir(parent):
        return f"{shown(parent, quote=False)} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{shown(parent, quote=False)} is not writable"
    return None


def _validate_log(var: str, value: str, environ: Mapping[str, str]) -> str:
    v = value.strip()
    if v.lower() in ("stderr", "none"):
        return v.lower()
    targets = [t.strip() for t in v.split(",")]
    if not v or any(not t for t in targets):
        raise _bad(var, value, LOG_TARGETS_HELP)
    seen: list[str] = []
    for t in targets:
        if t.lower() == "stderr":
            t = "stderr"
        elif t.lower() == "none":
            raise ValueError(
                f"attnguard: invalid {var}={shown(value)} (none cannot be combined with other "
                f"targets); valid values: {LOG_TARGETS_HELP}"
            )
        else:
            why = _log_problem(t, environ)
            if why is not None:
                raise ValueError(
                    f"attnguard: invalid {var}={shown(value)} ({why}); valid values: "
                    f"{LOG_TARGETS_HELP}"
                )
        if t not in seen:
            seen.append(t)
    return ",".join(seen)


def _kernel_cache(var: str, value: Any) -> str:
    """A directory for the kernel decisions: absolute (``~`` expanded), not a file. Nothing is
    created here; the cache makes it, under its own rules, at the first decision."""
    text = str(value).strip()
    if not text:
        return ""
    from .safefiles import path_problem

    path = os.path.expanduser(text)
    why = path_problem(path)
    if why is None and not os.path.isabs(path):
        why = "not an absolute path"
    if why is None and os.path.exists(path) and not os.path.isdir(path):
        why = f"{shown(path, quote=False)} is not a directory"
    if why is not None:
        raise ValueError(
            f"attnguard: invalid {var}={shown(value)} ({why}); valid values: {KERNEL_CACHE_HELP}"
        )
    return os.path.normpath(path)


def _ranks(var: str, value: Any) -> tuple[int, ...] | None:
    valid = "all | a comma list of ranks, e.g. 0 or 0,8"
    if isinstance(value, str):
        if value.strip().lower() == "all":
            return None
        items: list[Any] = [s.strip() for s in value.split(",") if s.strip()]
    elif value is None:
        return None
    else:
        items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    try:
        ranks = sorted({int(r) for r in items})
    except (TypeError, ValueError):
        raise _bad(var, value, valid) from None
    if not ranks or any(r < 0 for r in ranks):
        raise _bad(var, value, valid)
    return tuple(ranks)


# variable -> Settings field, with its parser
_ENV = {
    "ATTNGUARD": "enabled",
    "ATTNGUARD_MODE": "mode",
    "ATTNGUARD_DISABLE": "disable",
    "ATTNGUARD_LOG": "log",
    "ATTNGUARD_LOG_FORMAT": "log_format",
    "ATTNGUARD_LOG_LEVEL": "log_level",
    "ATTNGUARD_CONSOLE_RANKS": "console_ranks",
    "ATTNGUARD_DTYPE": "dtype",
    "ATTNGUARD_FALLBACK": "fallback",
    "ATTNGUARD_FP32_POLICY": "fp32_policy",
    "ATTNGUARD_KERNEL": "kernel",
    "ATTNGUARD_KERNEL_CACHE": "kernel_cache",
}
_VAR_OF = {f: v for v, f in _ENV.items()}


def _parse(fld: str, value: Any, environ: Mapping[str, str] | None = None) -> Any:
    var = _VAR_OF[fld]
    if fld == "enabled":
        return value if isinstance(value, bool) else _switch(var, str(value))
    if fld == "mode":
        return _choice(var, str(value), MODES)
    if fld == "disable":
        return frozenset(_names(var, value, REMEDIES + INTEGRATIONS))
    if fld == "log":
        return _validate_log(var, str(value), os.environ if environ is None else environ)
    if fld == "log_format":
        return _choice(var, str(value), LOG_FORMATS)
    if fld == "log_level":
        return _choice(var, str(value), LOG_LEVELS)
    if fld == "console_ranks":
        return _ranks(var, value)
    if fld == "dtype":
        return _choice(var, str(value), DTYPES)
    if fld == "fallback":
        names = _names(var, value, FALLBACK_BACKENDS)
        if not names:
            raise _bad(var, value, "a non-empty comma list of " + ", ".join(FALLBACK_BACKENDS))
        return tuple(names)
    if fld == "fp32_policy":
        return _choice(var, str(value), FP32_POLICIES)
    if fld == "kernel":
        return _choice(var, str(value), KERNEL_CHOICES)
    if fld == "kernel_cache":
        return _kernel_cache(var, value)
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
            values[fld] = _parse(fld, raw, env)
    for key, value in (overrides or {}).items():
        if key not in _VAR_OF:
            raise ValueError(
                f"attnguard: unknown setting {shown(key)}; valid settings: {', '.join(_VAR_OF)}"
            )
        values[key] = _parse(key, value, env)
    if values.get("mode") == "off":
        values["enabled"] = False
    return Settings(**values)
