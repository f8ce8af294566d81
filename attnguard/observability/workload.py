"""What happened in this process that the exit summary's advice depends on: the facts it records.

The advice for a reason code (:mod:`attnguard.observability.advice`) is a function of these facts,
never a fixed string: whether this process saw a CUDA GPU (and which compute capability), what
reached attnguard's twins of transformers' flash code path (packed rows, and whether
transformers' own sdpa path would have held them apart; sliding windows), which backends the
model classes of the flash requests support, and the ``kernels`` package as the libraries that
load hub kernels saw it, so that a hint that could not be followed here, or one that would change
the numbers, is not given. The facts travel with the summary (the ``facts`` field of a
``summary`` event and of a rank's record), so ``attnguard summary FILES`` and rank 0's job summary
advise from the facts of the processes that had the events, not from the machine that reads them.

Recording is cheap and happens outside any ``torch.compile`` trace: callers check
``torch.compiler.is_compiling()`` first. A fact is only ever set, never cleared (a fork keeps its
parent's: they describe the same program).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# the facts recorded while the program runs (set once, never cleared)
# packed rows (varlen) reached the twins of transformers' flash path in a forward where
# transformers' own sdpa path would mix them: a cache in use, or a release (or a model) whose mask
# code does not find packed sequences
PACKED_ROWS = "packed_rows"
PACKED_WITH_CACHE = "packed_rows_cache"  # ... of them: a cache was in use in that forward
# packed rows reached the twins in a forward without a cache whose position_ids transformers' own
# mask code read as packed sequences: its sdpa (and eager) path holds them apart too
PACKED_ROWS_APART = "packed_rows_apart"
SLIDING_WINDOW = "sliding_window"  # a sliding window reached the twins of the flash path
TWIN_CALLS = "twin_calls"  # a flash call on the twins was seen outside a compiled graph
FLAGS = (PACKED_ROWS, PACKED_WITH_CACHE, PACKED_ROWS_APART, SLIDING_WINDOW, TWIN_CALLS)

# recorded at the requests themselves
# [{"model": class name, "sdpa"/"flash"/"flex": supported, "part": built inside another model}]
# of the flash requests
MODELS = "models"
KERNELS = "kernels"  # {"installed": version or None, "accepted": {library: versions}}
# read from what attnguard.facts read during the run (never read for the summary), and, at this
# process's first event, whether CUDA is there at all (no GPU touched)
DEVICE = "device"  # "cuda" / "cpu"; absent when this process never looked
CAPABILITY = "capability"  # the compute capability of this rank's GPU, "9.0"

MAX_MODELS = 32
HUB_LIBRARIES = ("transformers", "diffusers")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")
_VERSION = re.compile(r"^[0-9A-Za-z.+!-]{1,40}$")
_SPEC = re.compile(r"^[0-9A-Za-z.,<>=!~*+ -]{1,80}$")
_SUPPORTS = ("sdpa", "flash", "flex", "part")

_lock = threading.Lock()
_flags: dict[str, bool] = {}
_models: dict[str, dict[str, Any]] = {}
_kernels: dict[str, Any] = {}
_device: dict[str, Any] = {}
# () -> {"device": ..., "capability": ...} from what the guard already read; set at activation
_machine: list[Callable[[], dict[str, Any]]] = []


def note(flag: str) -> None:
    """Record that ``flag`` (one of :data:`FLAGS`) happened in this process."""
    if not _flags.get(flag):
        with _lock:
            _flags[flag] = True


def seen(flag: str) -> bool:
    return bool(_flags.get(flag))


def note_model(name: str, sdpa: bool, flash: bool, flex: bool, part: bool = False) -> None:
    """A flash request for model class ``name`` (``part``: a sub-model, built inside another
    model), and what the class supports (its ``_supports_sdpa`` / ``_supports_flash_attn`` /
    ``_supports_flex_attn``)."""
    if name in _models or len(_models) >= MAX_MODELS:
        return
    entry = {"model": name, "sdpa": sdpa, "flash": flash, "flex": flex, "part": part}
    with _lock:
        _models.setdefault(name, entry)


def note_kernels(installed: str | None, library: str, accepted: str | None) -> None:
    """The ``kernels`` package as ``library`` saw it when a hub kernel did not load: the installed
    version (None: not installed) and the versions the library accepts (None: any)."""
    with _lock:
        _kernels["installed"] = installed
        if accepted:
            _kernels.setdefault("accepted", {})[library] = accepted


def note_device(read: Callable[[], dict[str, Any]]) -> None:
    """At this process's events until it is known: ``read()`` says whether CUDA is there (the
    advice then speaks of this machine even where no decision needed its GPUs)."""
    if _device:
        return
    try:
        found = clean(read())
    except Exception:
        found = {}
    if found.get(DEVICE):
        with _lock:
            _device.update(found)


def set_machine_reader(reader: Callable[[], dict[str, Any]]) -> None:
    """``reader()`` returns this process's device facts (``device``, ``capability``) from what
    attnguard already read; it is never made to read anything new at exit."""
    _machine[:] = [reader]


def snapshot() -> dict[str, Any]:
    """This process's facts as they travel in its summary and its rank record."""
    out: dict[str, Any] = {}
    with _lock:
        out.update({k: v for k, v in _device.items() if k in (DEVICE, CAPABILITY)})
    if _machine:
        try:
            read = clean(_machine[0]())
            if read.get(DEVICE):
                out.pop(CAPABILITY, None)
                out.update(read)
        except Exception:
            pass  # the advice then says what holds on any machine
    with _lock:
        out.update({k: True for k, v in _flags.items() if v})
        if _models:
            out[MODELS] = [dict(m) for m in _models.values()]
        if _kernels:
            out[KERNELS] = {
                "installed": _kernels.get("installed"),
                "accepted": dict(_kernels.get("accepted") or {}),
            }
    return out


def clean(raw: Any) -> dict[str, Any]:
    """The facts of ``raw`` that attnguard knows, checked (a file of another version, or edited,
    yields only what is well-formed)."""
    out: dict[str, Any] = {}
    if not isinstance(raw, Mapping):
        return out
    for flag in FLAGS:
        if raw.get(flag) is True:
            out[flag] = True
    if raw.get(DEVICE) in ("cuda", "cpu"):
        out[DEVICE] = raw[DEVICE]
    cap = raw.get(CAPABILITY)
    if out.get(DEVICE) == "cuda" and isinstance(cap, str) and _capability(cap) is not None:
        out[CAPABILITY] = cap
    models = _clean_models(raw.get(MODELS))
    if models:
        out[MODELS] = models
    kernels = _clean_kernels(raw.get(KERNELS))
    if kernels is not None:
        out[KERNELS] = kernels
    return out


def _clean_models(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list):
        return []
    out: dict[str, dict[str, Any]] = {}
    for m in raw[: MAX_MODELS * 4]:
        if not isinstance(m, Mapping):
            continue
        name = m.get("model")
        if not isinstance(name, str) or not _NAME.match(name):
            continue
        if any(not isinstance(m.get(k), bool) for k in _SUPPORTS):
            continue
        if len(out) < MAX_MODELS:
            out.setdefault(name, {"model": name, **{k: m[k] for k in _SUPPORTS}})
    return list(out.values())


def _clean_kernels(raw: Any) -> dict[str, Any] | None:
    if not isinstance(raw, Mapping) or "installed" not in raw:
        return None
    installed = raw.get("installed")
    if installed is not None and not (isinstance(installed, str) and _VERSION.match(installed)):
        return None
    accepted = raw.get("accepted")
    clean_accepted = {
        lib: spec
        for lib, spec in (accepted.items() if isinstance(accepted, Mapping) else ())
        if lib in HUB_LIBRARIES and isinstance(spec, str) and _SPEC.match(spec)
    }
    return {"installed": installed, "accepted": clean_accepted}


def _capability(text: str) -> tuple[int, int] | None:
    major, _, minor = text.partition(".")
    if major.isdigit() and minor.isdigit() and len(text) <= 7:
        return int(major), int(minor)
    return None


def merge(many: Iterable[Any]) -> dict[str, Any]:
    """The facts of several processes (a job's ranks, the files ``attnguard summary`` reads): a
    flag holds when it held anywhere; a GPU when any process had one, with the lowest compute
    capability among them (what every rank's GPU can run); the model classes of them all; the
    ``kernels`` package as any of them saw it."""
    out: dict[str, Any] = {}
    caps: list[tuple[tuple[int, int], str]] = []
    models: dict[str, dict[str, Any]] = {}
    kernels: dict[str, Any] | None = None
    for raw in many:
        one = clean(raw)
        for flag in FLAGS:
            if one.get(flag):
                out[flag] = True
        device = one.get(DEVICE)
        if device == "cuda" or (device == "cpu" and DEVICE not in out):
            out[DEVICE] = device
        cap = one.get(CAPABILITY)
        if cap is not None:
            parsed = _capability(cap)
            if parsed is not None:
                caps.append((parsed, cap))
        for m in one.get(MODELS, ()):
            if len(models) < MAX_MODELS:
                models.setdefault(m["model"], m)
        seen_kernels = one.get(KERNELS)
        if seen_kernels is not None:
            if kernels is None:
                kernels = {"installed": seen_kernels["installed"], "accepted": {}}
            kernels["installed"] = kernels["installed"] or seen_kernels["installed"]
            kernels["accepted"].update(seen_kernels["accepted"])
    if out.get(DEVICE) == "cuda" and caps:
        out[CAPABILITY] = min(caps)[1]
    if models:
        out[MODELS] = list(models.values())
    if kernels is not None:
        out[KERNELS] = kernels
    return out


def reset() -> None:
    """Forget everything recorded (tests)."""
    with _lock:
        _flags.clear()
        _models.clear()
        _kernels.clear()
        _device.clear()
