"""Settings: the one place that reads ATTNGUARD_* variables and validates them.

Every other module receives a :class:`Settings` (:mod:`attnguard._settings`, re-exported here);
none reads the environment itself. An invalid argument raises ``ValueError`` naming the setting,
the value and the valid values. An invalid value in the environment never stops a program:
activation reads it with :func:`read`, which takes the least harmful substitute for it
(:func:`_instead`) and returns one line per bad value that says it and what is done instead; a
variable that is no setting (a misspelling) gets one line.

Light on purpose: the start-up hook checks the raw values with :func:`check` in every guarded
process, long before (and often instead of) anything else of attnguard, so this module imports
``os`` only (no dataclasses, typing, re or string; the closest-name search imports difflib when
a misspelling is there to name).
"""

from __future__ import annotations

import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping
    from typing import Any

    from ._settings import Settings

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
# ATTNGUARD_VERIFY (opt-in): a sampled check of attention calls against their family's reference
# (attnguard.verify). Off words, on words (the default rate), "all", a rate, or "first:N".
VERIFY_DEFAULT_RATE = "0.001"
VERIFY_HELP = (
    "off (0, false, no, empty) | on (1, true, yes: a rate of 0.001) | all | a rate in (0, 1], "
    "e.g. 0.001 (every 1000th call per bucket, its first call included) | first:N (the first N "
    "calls per bucket)"
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
# Integration names are the top-level packages they patch: the start-up hook activates
# attnguard when one of these is first imported (attnguard._bootstrap).
INTEGRATIONS = ("transformers", "flash_attn", "xformers", "diffusers")

# ATTNGUARD (the switch) and its words, as the start-up hook's .pth line reads them too.
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")
SWITCH_HELP = "1 | true | yes | on (guard on) or 0 | false | no | off | empty (guard off)"
# Variables attnguard sets itself for its children (never a user's setting to check).
INTERNAL_PREFIX = "ATTNGUARD_INTERNAL_"


def __getattr__(name: str) -> Any:
    if name == "Settings":  # the class lives apart: its dataclass import is not light
        from ._settings import Settings

        return Settings
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


def switched_on(value: str) -> bool:
    """True when a value of the ATTNGUARD switch turns the guard on (an invalid one does not)."""
    return value.strip().lower() in _TRUE


def _switch(var: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise _bad(var, value, SWITCH_HELP)


def _log_problem(template: str, environ: Mapping[str, str]) -> str | None:
    """Why a file target cannot be used, or None. Placeholders first, then the path this
    process would write (its RANK and pid): not a directory, in a directory we may write to.
    Nothing is created here; the file is opened when attnguard activates."""
    from _string import formatter_parser  # string.Formatter's parser, without importing re

    from .safefiles import MAX_NAME, path_problem

    why = path_problem(template)
    if why is not None:
        return why
    try:
        fields = list(formatter_parser(template))
    except ValueError as exc:
        return f"malformed placeholder: {exc}"
    for _, name, spec, conversion in fields:
        if name is None:
            continue
        if name not in ("rank", "pid"):
            return f"placeholder {shown('{' + name + '}')} is not one of {{rank}}, {{pid}}"
        if conversion is not None:
            return f"placeholder {{{name}!{conversion}}} takes no conversion"
        placeholder = shown("{" + name + ":" + (spec or "") + "}")
        too_wide = _widest(spec or "", MAX_NAME)
        if too_wide is not None:
            return f"{placeholder} asks for {too_wide}: a path component holds at most {MAX_NAME}"
        try:
            if "{" in (spec or "") or "}" in (spec or ""):
                raise ValueError
            format(0, spec or "")
        except (ValueError, TypeError):
            return f"{placeholder} has no valid int format spec"
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


def _widest(spec: str, limit: int) -> str | None:
    """What in a format spec asks for more characters than a path component holds (a width of
    a billion would allocate gigabytes at every start-up before failing), or None. Every number
    in a spec is a width or a precision; a fill character is followed by its alignment."""
    digits = ""
    for ch in spec + ":":
        if "0" <= ch <= "9":
            digits += ch
            continue
        number = digits.lstrip("0")
        if len(number) > len(str(limit)) or (number and int(number) > limit):
            shown_number = number if len(number) <= 12 else f"a {len(number)}-digit number"
            return f"a field of {shown_number} characters"
        digits = ""
    return None


# words that name a stream, not a file: ATTNGUARD_LOG=stdout would otherwise write ./stdout
_STREAM_WORDS = ("stdout", "-", "console")


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
        elif t.lower() in _STREAM_WORDS:  # a stream meant, not a file named so in the cwd
            raise ValueError(
                f"attnguard: invalid {var}={shown(value)} ({shown(t)} is no target: events go "
                f"to stderr or a file); valid values: {LOG_TARGETS_HELP}"
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


def _verify(var: str, value: Any) -> str:
    """ATTNGUARD_VERIFY in one spelling: "" (off), "all", a rate ("0.001") or "first:N"."""
    if value is None or value is False:
        return ""
    if value is True:
        return VERIFY_DEFAULT_RATE
    given = value
    if isinstance(value, (int, float)):  # in Python a number is a rate: verify=1 checks every call
        value = "off" if value == 0 else repr(float(value))
    text = str(value).strip().lower()
    if text in _FALSE:
        return ""
    if text in _TRUE:
        return VERIFY_DEFAULT_RATE
    if text == "all":
        return "all"
    if text.startswith("first:") and text[6:].strip().isdigit() and int(text[6:]) >= 1:
        return f"first:{int(text[6:])}"
    try:
        rate = float(text)
    except ValueError:
        raise _bad(var, given, VERIFY_HELP) from None
    if not 0.0 < rate <= 1.0:
        raise _bad(var, given, VERIFY_HELP)
    return "all" if rate == 1.0 else format(rate, "g")


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
    "ATTNGUARD_VERIFY": "verify",
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
    if fld == "verify":
        return _verify(var, value)
    raise AssertionError(fld)


def load(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Build Settings from ATTNGUARD_* variables, then keyword overrides (field names); a bad
    value raises ValueError (:class:`EnvironmentSettingError` for a variable's). Activation
    reads the environment with :func:`read` instead, which never raises for a variable.

    ``import attnguard`` means "guard this program", so a missing ATTNGUARD counts as on here;
    the start-up hook only imports attnguard when ATTNGUARD is on.
    """
    from ._settings import Settings

    return Settings(**_values(os.environ if environ is None else environ, overrides, None))


def read(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> tuple[Settings, list[Problem]]:
    """Settings as :func:`load` builds them, where a bad ATTNGUARD_* value takes its least
    harmful substitute (README "Configuration": :func:`_instead`) and is one :class:`Problem`;
    a bad keyword override still raises ValueError (the caller's own argument)."""
    from ._settings import Settings

    problems: list[Problem] = []
    values = _values(os.environ if environ is None else environ, overrides, problems)
    return Settings(**values), problems


def check(environ: Mapping[str, str] | None = None) -> list[Problem]:
    """The bad ATTNGUARD_* values as :func:`read` finds them, without building Settings: what
    the start-up hook runs in every guarded process."""
    problems: list[Problem] = []
    _values(os.environ if environ is None else environ, None, problems)
    return problems


class EnvironmentSettingError(ValueError):
    """A bad ATTNGUARD_* value in the environment (not in the caller's arguments), as
    :func:`load` raises it. Set for a whole cluster, it must never stop a program: activation
    reads the environment with :func:`read`, which takes a substitute instead."""


class Problem:
    """A bad ATTNGUARD_* value: ``var``, the ``error`` (the variable, the value, the valid
    values), ``instead`` (what is done instead), and ``usage``: a setting that chooses what the
    guard does (``attnguard run`` refuses to start its command with it: a usage error, said
    before anything ran)."""

    __slots__ = ("var", "error", "instead", "usage")

    def __init__(self, var: str, error: str, instead: str, usage: bool) -> None:
        self.var, self.error, self.instead, self.usage = var, error, instead, usage

    @property
    def line(self) -> str:
        """The one line on stderr: the error, then what is done instead."""
        return f"{self.error} ({self.instead})"

    def __repr__(self) -> str:
        return f"Problem({self.var!r}, {self.line!r})"


# Settings that only say where and how events are written, or where a cache lives: a bad value
# never changes what the guard does (attnguard run starts its command with the substitute).
_OUTPUT = ("log", "log_format", "log_level", "console_ranks", "kernel_cache")
# The defaults a bad value falls back to, as the line says them (Settings' own defaults:
# tests/test_bad_log_setting.py checks they agree).
DEFAULTS = {
    "log_format": "auto",
    "log_level": "auto",
    "console_ranks": "all",
    "dtype": "auto",
    "fallback": "sdpa,eager",
    "fp32_policy": "cast",
    "kernel": "requested",
    "kernel_cache": "",
    "verify": "",
}
_WARN = "attnguard runs in warn mode: it says what it would change and changes nothing"


def _instead(fld: str, raw: str) -> tuple[dict[str, Any], str]:
    """The least harmful substitute for a bad value of ``fld``: the values used instead (none:
    the setting's default) and what the line says about it.

    * the switch (ATTNGUARD): off. It is the choice to guard at all; unread, attnguard stays out
      and the program runs as without it.
    * ATTNGUARD_MODE: warn. The value may have meant warn, strict or off as well as fix: warn
      changes nothing any of them would not have, and still says everything.
    * ATTNGUARD_DISABLE: the names it does read are disabled, in warn mode: a name it cannot
      read may be a remedy or a library you wanted left alone, so nothing is changed.
    * ATTNGUARD_LOG: stderr. A logging typo must not cost the guard.
    * ATTNGUARD_FALLBACK: the backends it does name, else the default.
    * any other setting (output format and level, console ranks, dtype, fp32 policy, kernel
      selection, its cache): the setting's default; ATTNGUARD_KERNEL's keeps the opt-in off.
    """
    if fld == "enabled":
        return {"enabled": False}, OFF
    if fld == "mode":
        return {"mode": "warn"}, _WARN
    if fld == "disable":
        valid = REMEDIES + INTEGRATIONS
        names = [n.strip().lower() for n in raw.split(",") if n.strip().lower() in valid]
        said = f"{', '.join(names)} disabled; " if names else ""
        return {"disable": frozenset(names), "mode": "warn"}, said + _WARN
    if fld == "log":
        return {"log": "stderr"}, "events go to stderr instead"
    if fld == "fallback":
        names = [
            n.strip().lower() for n in raw.split(",") if n.strip().lower() in FALLBACK_BACKENDS
        ]
        if names:
            return {"fallback": tuple(dict.fromkeys(names))}, f"{','.join(names)} is used"
    if fld == "kernel_cache":
        return {}, "the default directory, $XDG_CACHE_HOME/attnguard/kernels, is used"
    if fld == "verify":
        return {}, "the numbers check stays off"
    return {}, f"{_VAR_OF[fld]}={DEFAULTS[fld]} is used"


def _values(
    env: Mapping[str, str], overrides: Mapping[str, Any] | None, problems: list[Problem] | None
) -> dict[str, Any]:
    values: dict[str, Any] = {}
    forced: dict[str, Any] = {}  # substitutes that touch another setting (warn mode)
    for var, fld in _ENV.items():
        raw = env.get(var)
        if fld in (overrides or {}):
            continue  # the caller's explicit value stands; the variable is not read
        if raw is not None and (raw.strip() or fld in ("enabled", "disable")):
            try:
                values[fld] = _parse(fld, raw, env)
            except ValueError as exc:
                if problems is None:
                    raise EnvironmentSettingError(str(exc)) from None
                used, what = _instead(fld, raw)
                for key, value in used.items():
                    (values if key == fld else forced)[key] = value
                problems.append(Problem(var, str(exc), what, fld not in _OUTPUT))
    if problems and values.get("enabled") is False and any(p.var == "ATTNGUARD" for p in problems):
        problems[:] = [p for p in problems if p.var == "ATTNGUARD"]  # off: the rest is moot
    for key, value in forced.items():
        if key not in (overrides or {}) and values.get(key) != "off":
            values[key] = value  # the caller's explicit mode stands; so does off
    for key, value in (overrides or {}).items():
        if key not in _VAR_OF:
            raise ValueError(
                f"attnguard: unknown setting {shown(key)}; valid settings: {', '.join(_VAR_OF)}"
            )
        values[key] = _parse(key, value, env)
    if values.get("mode") == "off":
        values["enabled"] = False
    return values


# How a refused activation's line ends (the program runs unguarded).
OFF = "attnguard is off for this process"
_said: set[str] = set()


def say(line: str) -> None:
    """One line on stderr, once per process for the same text: a bad setting, where no logging
    is set up yet (the start-up hook) or none may be (a refused activation). Never raises."""
    if line in _said:
        return
    _said.add(line)
    try:
        import sys

        sys.stderr.write(line + "\n")
    except BaseException:
        pass


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per ATTNGUARD_* variable that is no setting (a misspelling is ignored, so the
    guard runs without it), naming the closest setting, else all of them. Names that differ
    from a setting only in case count as unknown too: the environment is case-sensitive."""
    env = os.environ if environ is None else environ
    lines = []
    for name in sorted(env):
        upper = name.upper()
        if name in _ENV or not upper.startswith("ATTNGUARD_") or upper.startswith(INTERNAL_PREFIX):
            continue
        closest = _closest(upper)
        hint = f"did you mean {closest}?" if closest else f"the settings are {', '.join(_ENV)}"
        lines.append(f"attnguard: {shown(name, quote=False)} is not a setting (ignored); {hint}")
    return lines


def _closest(name: str) -> str | None:
    """The setting whose name is nearest ``name`` (compared past the shared ``ATTNGUARD_``)."""
    if name in _ENV:
        return name
    import difflib  # only here, with a misspelling to name

    tails = {var[len("ATTNGUARD_") :]: var for var in _ENV if var != "ATTNGUARD"}
    match = difflib.get_close_matches(name[len("ATTNGUARD_") :], list(tails), n=1, cutoff=0.6)
    return tails[match[0]] if match else None
