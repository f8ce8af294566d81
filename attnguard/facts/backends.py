"""Which attention backends can really run here, judged by what they do: the package imported
(its CUDA extension too) and, on a GPU, a tiny call made; the reason codes a backend's status
takes (:func:`assess_backend` is the pure judgement, :func:`probe_package` the probe).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from .._settings import Settings
from .hardware import GPU

# transformers attn_implementation keys we judge, plus xformers (a direct-call library)
FLASH_BACKENDS = ("flash_attention_2", "flash_attention_3", "flash_attention_4")


BACKENDS = (*FLASH_BACKENDS, "sdpa", "flex_attention", "xformers")


# reason codes of a backend's status
OK = "ok"


PACKAGE_MISSING = "package_missing"


EXTENSION_BROKEN = "extension_broken"


NO_CUDA = "no_cuda"


CAPABILITY_TOO_LOW = "capability_too_low"


VERSION_TOO_OLD = "version_too_old"


PROBE_FAILED = "probe_failed"


TORCH_TOO_OLD = "torch_too_old"


# Lowest compute capability each kernel family runs on. FA2: Ampere (its own error text:
# "FlashAttention only supports Ampere GPUs or newer"); FA3/FA4: transformers' own floors.
CAPABILITY_FLOOR: dict[str, tuple[int, int]] = {
    "flash_attention_2": (8, 0),
    "flash_attention_3": (8, 0),
    "flash_attention_4": (9, 0),
    "xformers": (5, 0),
}


# What each backend needs from the environment: (pip distribution(s), import module, label)
_PACKAGES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "flash_attention_2": (("flash-attn",), "flash_attn", "flash-attn"),
    "flash_attention_3": (("flash-attn-3", "flash_attn_3"), "flash_attn_interface", "flash-attn-3"),
    "flash_attention_4": (("flash-attn-4",), "flash_attn", "flash-attn-4"),
    "xformers": (("xformers",), "xformers", "xformers"),
}


@dataclass(frozen=True)
class Backend:
    """Whether one attention backend can run here, and if not, why (short)."""

    name: str
    usable: bool
    reason_code: str = OK
    reason: str = "usable"
    version: str | None = None


@dataclass(frozen=True)
class PackageState:
    """What a package probe found: the raw input of :func:`assess_backend`."""

    installed: bool = False
    version: str | None = None
    # first line of the error raised by importing the package / its CUDA extension
    import_error: str | None = None
    # first line of the error raised by a tiny kernel call on the GPU (None: passed or not run)
    probe_error: str | None = None
    # warnings / log lines the package emitted while it was imported (captured, never printed)
    notes: tuple[str, ...] = ()


_probing = threading.local()


class Backends(Mapping[str, "Backend"]):
    """Each backend judged the first time a decision asks for it, then cached.

    ``probe(name)`` returns the :class:`Backend`; iterating probes every backend (``attnguard
    doctor``). Synthetic facts pass a dict instead.
    """

    def __init__(self, probe: Any) -> None:
        self._probe = probe
        self.settings: Settings | None = None  # the settings in force when last given
        self._done: dict[str, Backend] = {}
        self._lock = threading.RLock()

    def __getitem__(self, name: str) -> Backend:
        if name not in BACKENDS:
            raise KeyError(name)
        found = self._done.get(name)
        if found is None:
            with self._lock:
                found = self._done.get(name)
                if found is None:
                    busy = _probing.__dict__.setdefault("names", set())
                    if name in busy:  # re-entered from an import hook our own probe fired
                        return Backend(name, False, PROBE_FAILED, f"{name} is being probed")
                    busy.add(name)
                    try:
                        found = self._done[name] = self._probe(name)
                    finally:
                        busy.discard(name)
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(BACKENDS)

    def __len__(self) -> int:
        return len(BACKENDS)

    def probed(self) -> tuple[str, ...]:
        """The backends judged so far (tests: a decision probes only what it needs)."""
        return tuple(self._done)


def canonical_backend(name: str) -> str:
    """transformers spells some backends with a prefix ("paged|flash_attention_2")."""
    return name.split("|", 1)[1] if isinstance(name, str) and "|" in name else name


def first_line(exc: BaseException | str) -> str:
    text = str(exc) if not isinstance(exc, str) else exc
    line = (text.strip().splitlines() or [""])[0].strip()
    if isinstance(exc, BaseException):
        line = f"{type(exc).__name__}: {line}" if line else type(exc).__name__
    return line[:300]


def _version_ok(version: str | None, floor: str) -> bool:
    if version is None:
        return True
    try:
        return Version(version) >= Version(floor)
    except InvalidVersion:
        return True


def flash2_version_floor(transformers_version: str | None) -> str:
    """flash-attn version transformers accepts: 2.1.0 up to 4.x, 2.3.3 from 5.0."""
    try:
        if transformers_version and Version(transformers_version) >= Version("5.0.0.dev0"):
            return "2.3.3"
    except InvalidVersion:
        pass
    return "2.1.0"


def assess_backend(
    name: str,
    package: PackageState,
    *,
    cuda: bool,
    gpu: GPU | None,
    torch_version: str | None = None,
    transformers_version: str | None = None,
) -> Backend:
    """Pure: judge one backend from what the probes found. The order of the checks is the order
    of the causes: a missing or broken package is the first thing to fix, even on a CPU box."""
    if name == "sdpa":
        if not _version_ok(torch_version, "2.1.1"):
            return Backend(name, False, TORCH_TOO_OLD, "sdpa needs torch >= 2.1.1", torch_version)
        return Backend(name, True, OK, "torch scaled_dot_product_attention", torch_version)
    if name == "flex_attention":
        if package.import_error:
            return Backend(
                name,
                False,
                EXTENSION_BROKEN,
                f"flex_attention fails to import: {package.import_error}",
            )
        if not _version_ok(torch_version, "2.5.0"):
            return Backend(name, False, TORCH_TOO_OLD, "flex_attention needs torch >= 2.5", None)
        return Backend(name, True, OK, "torch flex_attention", torch_version)

    label = _PACKAGES[name][2]
    if not package.installed:
        return Backend(name, False, PACKAGE_MISSING, f"{label} is not installed")
    if name == "flash_attention_2":
        floor = flash2_version_floor(transformers_version)
        if not _version_ok(package.version, floor):
            return Backend(
                name,
                False,
                VERSION_TOO_OLD,
                f"{label} {package.version} is older than {floor}, the oldest transformers accepts",
                package.version,
            )
    if package.import_error:
        where = "" if cuda else " (and there is no CUDA device)"
        return Backend(
            name,
            False,
            EXTENSION_BROKEN,
            f"{label} {package.version or ''} is installed but fails to import: "
            f"{package.import_error}{where}".replace("  ", " "),
            package.version,
        )
    if not cuda or gpu is None:
        return Backend(
            name, False, NO_CUDA, f"{label} needs a CUDA GPU and none is visible", package.version
        )
    floor_cc = CAPABILITY_FLOOR.get(name)
    if floor_cc is not None and tuple(gpu.capability) < floor_cc:
        return Backend(
            name,
            False,
            CAPABILITY_TOO_LOW,
            f"{label} needs compute capability >= {floor_cc[0]}.{floor_cc[1]}; "
            f"{gpu.name} is {gpu.capability[0]}.{gpu.capability[1]}",
            package.version,
        )
    if package.probe_error:
        return Backend(
            name,
            False,
            PROBE_FAILED,
            f"{label} failed a tiny test call on {gpu.name}: {package.probe_error}",
            package.version,
        )
    return Backend(
        name,
        True,
        OK,
        f"{label} {package.version or ''} usable".replace("  ", " "),
        package.version,
    )


# integration name (ATTNGUARD_DISABLE) of the library each backend's probe imports
INTEGRATION_OF = {
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn",
    "flash_attention_4": "flash_attn",
    "xformers": "xformers",
}


def dist_version(names: tuple[str, ...]) -> str | None:
    from importlib import metadata

    for dist in names:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def spec_found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _unwrapped(fn: Any) -> Any:
    """The original function under any functools.wraps wrapper (ours included)."""
    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


class _Quiet(logging.Handler):
    """Collects the records a probed library logs while it is imported."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage().strip().splitlines()[0][:200])
        except Exception:
            pass


@contextlib.contextmanager
def _quietly(logger_names: tuple[str, ...]) -> Iterator[list[str]]:
    """Capture warnings and the named loggers' records for the duration of a probe.

    The loggers are restored exactly as found (handlers, propagate, disabled): the host app owns
    logging; this only keeps a probe from printing what the unguarded program would not.
    """
    notes: list[str] = []
    handler = _Quiet()
    saved = []
    for name in logger_names:
        lg = logging.getLogger(name)
        saved.append((lg, lg.propagate, lg.level))
        lg.addHandler(handler)
        lg.propagate = False
        lg.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield notes
    finally:
        for lg, propagate, level in saved:
            lg.removeHandler(handler)
            lg.propagate = propagate
            lg.setLevel(level)
        notes.extend(handler.lines)
        notes.extend(str(w.message).strip().splitlines()[0][:200] for w in caught if w.message)


def _probe_call(name: str, module: Any, device: str, dtype: Any) -> str | None:
    """One tiny real kernel call; returns the error's first line, or None when it ran."""
    import torch

    try:
        # (batch, seq, heads, head_dim): the layout of flash_attn_func and xformers alike
        q, k, v = (torch.randn(1, 4, 2, 64, device=device, dtype=dtype) for _ in range(3))
        if name in ("flash_attention_2", "flash_attention_3"):
            _unwrapped(module.flash_attn_func)(q, k, v, causal=True)
        elif name == "xformers":
            _unwrapped(module.memory_efficient_attention)(q, k, v)
        else:
            return None
        torch.cuda.synchronize(device)
        return None
    except Exception as exc:
        return first_line(exc)


def package_state(name: str) -> tuple[PackageState, str]:
    """Metadata only (no import): whether ``name``'s package is installed, and its import name."""
    dists, module_name, _label = _PACKAGES[name]
    version = dist_version(dists)
    if name == "flash_attention_2":
        # flash-attn-4 also installs the "flash_attn" module: only the flash-attn dist is FA2
        installed = version is not None and spec_found(module_name)
    elif name == "flash_attention_3":
        installed = version is not None or spec_found("flash_attn_3")
        if installed and not spec_found(module_name):
            module_name = "flash_attn_3"
    elif name == "flash_attention_4":
        installed = version is not None and spec_found("flash_attn")
        module_name = "flash_attn.cute"
    else:
        installed = spec_found(module_name)
    return PackageState(installed, version), module_name


def probe_package(
    name: str, *, gpu_device: str | None, half: Any = None, do_import: bool = True
) -> PackageState:
    """Find, import and (on a GPU) call one backend's package. No import when it is absent, or
    when ``do_import`` is False (the integration is disabled: judged by metadata only)."""
    state, module_name = package_state(name)
    if not state.installed or not do_import:
        return state
    with _quietly((module_name.split(".")[0], "xformers")) as notes:
        try:
            module = importlib.import_module(module_name)
            if name == "flash_attention_2":
                # transformers imports these two from the package root, and pad/unpad helpers
                module.flash_attn_func  # noqa: B018
                module.flash_attn_varlen_func  # noqa: B018
            elif name == "xformers":
                module = importlib.import_module("xformers.ops")
        except BaseException as exc:  # a broken .so can raise OSError, ImportError, SystemError
            if isinstance(exc, KeyboardInterrupt):
                raise
            return dataclasses.replace(state, import_error=first_line(exc))
        probe_error = None
        if gpu_device is not None and half is not None:
            probe_error = _probe_call(name, module, gpu_device, half)
    return dataclasses.replace(state, probe_error=probe_error, notes=tuple(notes))


def flex_state() -> PackageState:
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
        return PackageState(True)
    except Exception as exc:
        return PackageState(True, import_error=first_line(exc))
