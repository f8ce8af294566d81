"""What this runtime offers: GPUs, native bf16, which attention backends can really run, and the
launch / deliberate-init context a model is being built in.

:class:`Facts` is a frozen dataclass, so tests (and ``attnguard doctor``) can inject facts for a
machine they are not on (:func:`synthetic`). For this process (:func:`current`) nothing is read at
activation: the GPUs are read the first time a decision needs them, and each backend is probed the
first time a decision asks for *that* backend (a plain sdpa load probes nothing; a flash request
probes flash-attn only; xformers is probed by ``attnguard doctor`` alone). Results are cached; the
context parts (launcher variables, ZeRO-3 / FSDP / meta-device init, a ``torch.device`` block) are
re-read on every call because they change at run time.

A backend is judged by what it does, not by what transformers' availability check says:
transformers reads package metadata and never imports the CUDA extension or checks the compute
capability, so a broken install or a V100 passes loading and fails at the first attention call.
Here the extension is really imported and, on a GPU, a tiny call is made (with the original
function: any attnguard wrapper is unwrapped first). Importing a native extension can crash the
process if the extension is broken badly enough: the probe only runs where the program itself is
about to use that library, and ``ATTNGUARD_DISABLE=flash_attn`` turns it off (flash-attn is then
judged by its package metadata alone, as transformers does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version

from ._settings import Settings

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
NATIVE_BF16_FLOOR = (8, 0)

# What each backend needs from the environment: (pip distribution(s), import module, label)
_PACKAGES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "flash_attention_2": (("flash-attn",), "flash_attn", "flash-attn"),
    "flash_attention_3": (("flash-attn-3", "flash_attn_3"), "flash_attn_interface", "flash-attn-3"),
    "flash_attention_4": (("flash-attn-4",), "flash_attn", "flash-attn-4"),
    "xformers": (("xformers",), "xformers", "xformers"),
}


@dataclass(frozen=True)
class GPU:
    """One visible CUDA device."""

    index: int
    name: str
    capability: tuple[int, int]
    total_memory: int = 0

    @property
    def native_bf16(self) -> bool:
        """bf16 in hardware (Ampere+). ``torch.cuda.is_bf16_supported()`` is True on V100/T4
        too because it counts emulation, which is slow: never use it for this decision."""
        return tuple(self.capability) >= NATIVE_BF16_FLOOR


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


@dataclass(frozen=True)
class Launch:
    """The launcher's view of this process (torchrun, accelerate, deepspeed set these)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None


@dataclass(frozen=True)
class InitContext:
    """How the caller is building the model right now, read at each load.

    ``zero3`` / ``fsdp`` / ``meta``: contexts in which a model is built on CPU / in fp32 / on meta
    *on purpose*; casting or moving it there would break sharding or fp32 master weights, so the
    guard only observes. ``device_context``: the device of an active ``with torch.device(...)``
    block or ``torch.set_default_device`` (an explicit placement by the caller), else None.
    ``training_script``: the program has imported transformers' Trainer or TrainingArguments
    (HF example scripts, TRL, LLaMA-Factory do before they load): its mixed precision keeps
    float32 master weights under autocast on purpose, so the dtype is left alone.
    """

    zero3: bool = False
    fsdp: bool = False
    meta: bool = False
    default_device: str = "cpu"
    device_context: str | None = None
    training_script: bool = False

    @property
    def deliberate(self) -> tuple[str, str] | None:
        """(reason_code, reason) of the first deliberate-init context in force, else None."""
        if self.zero3:
            return "zero3_init", "DeepSpeed ZeRO-3 is enabled (it partitions the fp32 model itself)"
        if self.fsdp:
            return "fsdp_init", "FSDP is enabled (it shards and casts the model itself)"
        if self.meta:
            return "meta_init", "the model is being built on the meta device (init_empty_weights)"
        return None


class Hardware:
    """CUDA availability and the visible GPUs: given (synthetic facts) or read from torch the first
    time a decision needs them (never at activation: a load that needs no GPU fact touches no GPU)."""

    def __init__(self, gpus: tuple[GPU, ...] | None = None, *, cuda: bool | None = None) -> None:
        self._gpus = gpus
        self._cuda = cuda if cuda is not None else (None if gpus is None else bool(gpus))
        self._lock = threading.Lock()

    def _read(self) -> None:
        with self._lock:
            if self._gpus is None:
                self._cuda, self._gpus = _read_gpus()

    @property
    def cuda(self) -> bool:
        if self._cuda is None:
            self._read()
        return bool(self._cuda)

    @property
    def gpus(self) -> tuple[GPU, ...]:
        if self._gpus is None:
            self._read()
        return self._gpus or ()

    def __repr__(self) -> str:
        known = "not read yet" if self._gpus is None else f"{len(self._gpus)} GPU(s)"
        return f"Hardware({known})"


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


@dataclass(frozen=True)
class Facts:
    """Everything the planner needs to know about this runtime."""

    hardware: Hardware
    backends: Mapping[str, Backend]
    launch: Launch = field(default_factory=Launch)
    init: InitContext = field(default_factory=InitContext)
    accelerate: bool = True
    torch_version: str | None = None
    transformers_version: str | None = None

    @property
    def cuda(self) -> bool:
        return self.hardware.cuda

    @property
    def gpus(self) -> tuple[GPU, ...]:
        return self.hardware.gpus

    def backend(self, name: str) -> Backend:
        """Status of ``name``; "eager" and keys we do not judge count as usable."""
        key = _canonical(name)
        if key in BACKENDS:
            found = self.backends.get(key)
            if found is not None:
                return found
        return Backend(name, True, OK, "not judged by attnguard")

    @property
    def local_gpu(self) -> GPU | None:
        """The GPU this rank would use: LOCAL_RANK, or 0 when each rank sees one GPU."""
        index = self.local_gpu_index
        return None if index is None else self.gpus[index]

    @property
    def local_gpu_index(self) -> int | None:
        if not self.cuda or not self.gpus:
            return None
        rank = self.launch.local_rank
        if rank < len(self.gpus):
            return rank
        return 0 if len(self.gpus) == 1 else None

    @property
    def native_bf16(self) -> bool:
        gpu = self.local_gpu
        return gpu is not None and gpu.native_bf16

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly view (``attnguard doctor --json``): judges every backend."""
        d: dict[str, Any] = {
            "cuda": self.cuda,
            "gpus": [dict(dataclasses.asdict(g), native_bf16=g.native_bf16) for g in self.gpus],
            "backends": {k: dataclasses.asdict(self.backends[k]) for k in self.backends},
            "launch": dataclasses.asdict(self.launch),
            "init": dataclasses.asdict(self.init),
            "accelerate": self.accelerate,
            "torch_version": self.torch_version,
            "transformers_version": self.transformers_version,
            "native_bf16": self.native_bf16,
        }
        for raw in d["gpus"]:
            raw["capability"] = list(raw["capability"])
        return d


def _canonical(name: str) -> str:
    """transformers spells some backends with a prefix ("paged|flash_attention_2")."""
    return name.split("|", 1)[1] if isinstance(name, str) and "|" in name else name


def _first_line(exc: BaseException | str) -> str:
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
    return Backend(name, True, OK, f"{label} {package.version or ''} usable".replace("  ", " "))


# --- probes (side effects: imports, one tiny CUDA call) -----------------------------------------
#
# A probe runs the first time a decision needs that backend: a load asking for flash attention
# probes flash-attn (the unguarded run would import it at the first attention call anyway); a plain
# sdpa load probes nothing; xformers is only ever probed by `attnguard doctor`. Import-time
# warnings and log records of the probed library are captured into the reason, never printed.

# integration name (ATTNGUARD_DISABLE) of the library each backend's probe imports
_INTEGRATION = {
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn",
    "flash_attention_4": "flash_attn",
    "xformers": "xformers",
}


def _dist_version(names: tuple[str, ...]) -> str | None:
    from importlib import metadata

    for dist in names:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _find_spec(module: str) -> bool:
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
        return _first_line(exc)


def package_state(name: str) -> tuple[PackageState, str]:
    """Metadata only (no import): whether ``name``'s package is installed, and its import name."""
    dists, module_name, _label = _PACKAGES[name]
    version = _dist_version(dists)
    if name == "flash_attention_2":
        # flash-attn-4 also installs the "flash_attn" module: only the flash-attn dist is FA2
        installed = version is not None and _find_spec(module_name)
    elif name == "flash_attention_3":
        installed = version is not None or _find_spec("flash_attn_3")
        if installed and not _find_spec(module_name):
            module_name = "flash_attn_3"
    elif name == "flash_attention_4":
        installed = version is not None and _find_spec("flash_attn")
        module_name = "flash_attn.cute"
    else:
        installed = _find_spec(module_name)
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
            return dataclasses.replace(state, import_error=_first_line(exc))
        probe_error = None
        if gpu_device is not None and half is not None:
            probe_error = _probe_call(name, module, gpu_device, half)
    return dataclasses.replace(state, probe_error=probe_error, notes=tuple(notes))


def _flex_state() -> PackageState:
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
        return PackageState(True)
    except Exception as exc:
        return PackageState(True, import_error=_first_line(exc))


def _read_gpus() -> tuple[bool, tuple[GPU, ...]]:
    torch = sys.modules.get("torch")
    if torch is None:  # nothing has imported torch: no model is being built on a GPU here
        import torch
    try:
        if not torch.cuda.is_available():
            return False, ()
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            out.append(GPU(i, props.name, (props.major, props.minor), int(props.total_memory)))
        return True, tuple(out)
    except Exception:
        return False, ()


def _integration_allowed(name: str, settings: Settings | None) -> bool:
    """False when ATTNGUARD_DISABLE (in ``settings``) names the library this backend's probe
    would import."""
    integration = _INTEGRATION.get(name)
    if integration is None:
        return True
    return settings is None or settings.allows(integration)


def _probe_backend(name: str, facts: Facts, settings: Settings | None) -> Backend:
    """Judge ``name`` on this machine (the body of :class:`Backends` for the current process)."""
    if name == "sdpa":
        state = PackageState(True)
    elif name == "flex_attention":
        state = _flex_state()
    else:
        allowed = _integration_allowed(name, settings)
        state, _ = package_state(name)
        gpu = gpu_device = half = None
        if state.installed and allowed:
            gpu = facts.local_gpu or (facts.gpus[0] if facts.gpus else None)
            floor = CAPABILITY_FLOOR.get(name)
            # a tiny call only where it can pass: capability checks come first and are cheaper
            if gpu is not None and (floor is None or tuple(gpu.capability) >= floor):
                import torch

                gpu_device = f"cuda:{gpu.index}"
                half = torch.bfloat16 if gpu.native_bf16 else torch.float16
        state = probe_package(name, gpu_device=gpu_device, half=half, do_import=allowed)
    gpu = facts.local_gpu or (facts.gpus[0] if facts.gpus else None)
    return assess_backend(
        name,
        state,
        cuda=facts.cuda,
        gpu=gpu,
        torch_version=facts.torch_version,
        transformers_version=facts.transformers_version,
    )


# --- context (re-read on every call) -------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")


def launch_now(environ: Mapping[str, str] | None = None) -> Launch:
    from .observability.events import launch_context

    env = os.environ if environ is None else environ
    ctx = launch_context(dict(env))
    try:
        lws: int | None = int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        lws = None
    return Launch(ctx["rank"], ctx["local_rank"], ctx["world_size"], lws)


def zero3_enabled() -> bool:
    """DeepSpeed ZeRO-3 as transformers sees it (an ``HfDeepSpeedConfig`` / a Trainer's ZeRO-3
    config is alive), or a ``deepspeed.zero.Init()`` block is open. Read only from modules already
    loaded: importing either here would pull them into a program that does not use them."""
    mod = sys.modules.get("transformers.integrations.deepspeed")
    fn = getattr(mod, "is_deepspeed_zero3_enabled", None)
    try:
        if fn is not None and fn():
            return True
    except Exception:
        pass
    zero = sys.modules.get("deepspeed.runtime.zero.partition_parameters")
    try:
        return bool(getattr(zero, "zero_init_context", 0))
    except Exception:
        return False


def fsdp_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """accelerate (``accelerate launch`` with an FSDP config, and transformers' Trainer with
    ``--fsdp``) announce FSDP through the environment: ACCELERATE_USE_FSDP, or FSDP_* variables."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_FSDP", "").strip().lower() in _TRUE:
        return True
    return any(k.startswith("FSDP_") and v.strip() for k, v in env.items())


def _device_context() -> str | None:
    """The device of an active ``torch.device(...)`` block or ``torch.set_default_device``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        mode_device = getattr(sys.modules.get("torch.utils._device"), "CURRENT_DEVICE", None)
        if mode_device is not None:
            return str(mode_device)
        from torch.overrides import _get_current_function_mode_stack
        from torch.utils._device import DeviceContext

        for mode in reversed(_get_current_function_mode_stack()):
            if isinstance(mode, DeviceContext):
                return str(mode.device)
    except Exception:
        pass
    return None


def _init_empty_weights_active() -> bool:
    """accelerate's init_empty_weights / init_on_device swap nn.Module.register_parameter."""
    torch = sys.modules.get("torch")
    if torch is None or "accelerate" not in sys.modules:
        return False
    fn = getattr(torch.nn.Module, "register_parameter", None)
    return getattr(fn, "__name__", "") == "register_empty_parameter" or str(
        getattr(fn, "__module__", "")
    ).startswith("accelerate")


def init_context_now(environ: Mapping[str, str] | None = None) -> InitContext:
    device = _device_context()
    return InitContext(
        zero3=zero3_enabled(),
        fsdp=fsdp_enabled(environ),
        meta=(device or "").startswith("meta") or _init_empty_weights_active(),
        default_device=device or "cpu",
        device_context=device,
        training_script=training_script(),
    )


def training_script() -> bool:
    """transformers' Trainer / TrainingArguments are imported (read, never imported here)."""
    return "transformers.training_args" in sys.modules or "transformers.trainer" in sys.modules


def is_quantized_load(kwargs: Mapping[str, Any], config: Any = None) -> bool:
    """A quantized load: quantization_config / load_in_4bit / load_in_8bit kwargs, or a
    checkpoint whose config carries a quantization_config."""
    if kwargs.get("quantization_config") is not None:
        return True
    if kwargs.get("load_in_4bit") or kwargs.get("load_in_8bit"):
        return True
    if config is None:
        return False
    if isinstance(config, Mapping):
        return config.get("quantization_config") is not None
    return getattr(config, "quantization_config", None) is not None


# --- this process's facts ------------------------------------------------------------------------

_lock = threading.RLock()
_machine: tuple[Hardware, Backends, dict[str, Any]] | None = None


def _this_machine() -> tuple[Hardware, Backends, dict[str, Any]]:
    """The cached hardware / backends objects and versions of this process (nothing probed yet)."""
    global _machine
    machine = _machine
    if machine is None:
        with _lock:
            if _machine is None:
                from .installed import imported_version

                hardware = Hardware()
                static = {
                    "accelerate": _find_spec("accelerate"),
                    "torch_version": imported_version("torch", "torch"),
                    "transformers_version": imported_version("transformers", "transformers"),
                }
                holder: list[Facts] = []
                backends = Backends(lambda name: _probe_backend(name, holder[0], backends.settings))
                holder.append(Facts(hardware, backends, **static))
                _machine = (hardware, backends, static)
            machine = _machine
    return machine


def current(settings: Settings | None = None) -> Facts:
    """This process's facts. Cheap: hardware and each backend are read the first time a decision
    needs them and cached; the launch and init context are re-read on every call.

    ``settings``: the settings in force, whose ATTNGUARD_DISABLE keeps a backend's probe from
    importing a library it names (None: as the last caller gave them; none given: every one)."""
    hardware, backends, static = _this_machine()
    if settings is not None:
        backends.settings = settings
    return Facts(hardware, backends, launch=launch_now(), init=init_context_now(), **static)


def reset() -> None:
    """Forget everything read so far (tests; after installing or removing a backend)."""
    global _machine
    with _lock:
        _machine = None


def synthetic(
    capabilities: tuple[tuple[int, int], ...] = (),
    *,
    installed: Mapping[str, str | PackageState] | None = None,
    gpu_name: str = "GPU",
    gpu_memory: int = 80 * 2**30,
    launch: Launch | None = None,
    init: InitContext | None = None,
    accelerate: bool = True,
    torch_version: str = "2.5.0",
    transformers_version: str = "4.57.6",
) -> Facts:
    """Facts for a machine we are not on, judged by the same :func:`assess_backend`.

    ``capabilities``: one (major, minor) per GPU (empty: no CUDA). ``installed``: backend name ->
    version string (installed and importable) or a :class:`PackageState` (e.g. a broken import).
    """
    gpus = tuple(
        GPU(i, f"{gpu_name} (sm{c[0]}{c[1]})", tuple(c), gpu_memory)  # type: ignore[arg-type]
        for i, c in enumerate(capabilities)
    )
    launch = launch or Launch()
    base = Facts(Hardware(gpus), {}, launch=launch)
    gpu = base.local_gpu or (gpus[0] if gpus else None)
    backends = {}
    for name in BACKENDS:
        raw = (installed or {}).get(name)
        if name in ("sdpa", "flex_attention"):
            state = raw if isinstance(raw, PackageState) else PackageState(True)
        elif raw is None:
            state = PackageState(False)
        elif isinstance(raw, PackageState):
            state = raw
        else:
            state = PackageState(True, raw)
        backends[name] = assess_backend(
            name,
            state,
            cuda=bool(gpus),
            gpu=gpu,
            torch_version=torch_version,
            transformers_version=transformers_version,
        )
    return Facts(
        Hardware(gpus),
        backends,
        launch=launch,
        init=init or InitContext(),
        accelerate=accelerate,
        torch_version=torch_version,
        transformers_version=transformers_version,
    )
