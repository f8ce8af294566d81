"""What this runtime offers: GPUs, native bf16, which attention backends can really run, and the
launch / deliberate-init context a model is being built in.

Everything is a plain frozen dataclass, so tests (and ``attnguard doctor``) can inject facts for a
machine they are not on (:func:`synthetic`). The expensive part (imports, tiny kernel calls) is
collected once per process and cached (:func:`current`); the context parts (launcher variables,
ZeRO-3 / FSDP / meta-device init) are re-read on every call because they change at run time.

A backend is judged by what it does, not by what transformers' availability check says:
transformers reads package metadata and never imports the CUDA extension or checks the compute
capability, so a broken install or a V100 passes loading and fails at the first attention call.
Here the extension is really imported and, on a GPU, a tiny call is made (with the original
function: any attnguard wrapper is unwrapped first).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version

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


@dataclass(frozen=True)
class Launch:
    """The launcher's view of this process (torchrun, accelerate, deepspeed set these)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int | None = None


@dataclass(frozen=True)
class InitContext:
    """Contexts in which a model is built on CPU / in fp32 / on meta *on purpose*: casting or
    moving it there would break sharding or fp32 master weights, so the guard only observes."""

    zero3: bool = False
    fsdp: bool = False
    meta: bool = False
    default_device: str = "cpu"

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


@dataclass(frozen=True)
class Facts:
    """Everything the planner needs to know about this runtime."""

    cuda: bool
    gpus: tuple[GPU, ...]
    backends: Mapping[str, Backend]
    launch: Launch = field(default_factory=Launch)
    init: InitContext = field(default_factory=InitContext)
    accelerate: bool = True
    torch_version: str | None = None
    transformers_version: str | None = None

    def backend(self, name: str) -> Backend:
        """Status of ``name``; "eager" and keys we do not judge count as usable."""
        found = self.backends.get(_canonical(name))
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
        """JSON-friendly view (``attnguard doctor --json``)."""
        d = dataclasses.asdict(self)
        d["backends"] = {k: dataclasses.asdict(v) for k, v in self.backends.items()}
        d["native_bf16"] = self.native_bf16
        for gpu, raw in zip(self.gpus, d["gpus"], strict=True):
            raw["native_bf16"] = gpu.native_bf16
            raw["capability"] = list(gpu.capability)
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


# --- probes (side effects: imports, one tiny CUDA call per backend) ------------------------------


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


def probe_package(name: str, *, gpu_device: str | None, half: Any = None) -> PackageState:
    """Find, import and (on a GPU) call one backend's package. No import when it is absent."""
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
    if not installed:
        return PackageState(False, version)
    try:
        module = importlib.import_module(module_name)
        if name == "flash_attention_2":
            # transformers imports these two from the package root, and pad/unpad helpers
            module.flash_attn_func  # noqa: B018
            module.flash_attn_varlen_func  # noqa: B018
        elif name == "xformers":
            module = importlib.import_module("xformers.ops")
    except BaseException as exc:  # a broken .so can raise OSError, ImportError, even SystemError
        if isinstance(exc, KeyboardInterrupt):
            raise
        return PackageState(True, version, import_error=_first_line(exc))
    probe_error = None
    if gpu_device is not None and half is not None:
        probe_error = _probe_call(name, module, gpu_device, half)
    return PackageState(True, version, probe_error=probe_error)


def _flex_state() -> PackageState:
    try:
        importlib.import_module("torch.nn.attention.flex_attention")
        return PackageState(True)
    except Exception as exc:
        return PackageState(True, import_error=_first_line(exc))


def _gpus(torch: Any) -> tuple[bool, tuple[GPU, ...]]:
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


def _collect_static() -> Facts:
    import torch

    from .runtime import versions

    vers = versions()
    tf_version = vers.get("transformers")
    cuda, gpus = _gpus(torch)
    launch = launch_now()
    base = Facts(cuda, gpus, {}, launch=launch)
    # a rank whose LOCAL_RANK names no GPU still judges kernels by the machine's GPU
    gpu = base.local_gpu or (gpus[0] if gpus else None)
    gpu_device = f"cuda:{gpu.index}" if gpu is not None else None
    half = None
    if gpu is not None:
        half = torch.bfloat16 if gpu.native_bf16 else torch.float16
    backends: dict[str, Backend] = {}
    for name in BACKENDS:
        if name == "sdpa":
            state = PackageState(True)
        elif name == "flex_attention":
            state = _flex_state()
        else:
            floor = CAPABILITY_FLOOR.get(name)
            # a tiny call only where it can pass: capability checks come first and are cheaper
            can_call = gpu is not None and (floor is None or tuple(gpu.capability) >= floor)
            state = probe_package(name, gpu_device=gpu_device if can_call else None, half=half)
        backends[name] = assess_backend(
            name,
            state,
            cuda=cuda,
            gpu=gpu,
            torch_version=vers.get("torch"),
            transformers_version=tf_version,
        )
    return Facts(
        cuda=cuda,
        gpus=gpus,
        backends=backends,
        launch=launch,
        accelerate=_find_spec("accelerate"),
        torch_version=vers.get("torch"),
        transformers_version=tf_version,
    )


# --- context (re-read on every call) -------------------------------------------------------------

_TRUE = ("1", "true", "yes", "on")


def launch_now(environ: Mapping[str, str] | None = None) -> Launch:
    from .events import launch_context

    env = os.environ if environ is None else environ
    ctx = launch_context(dict(env))
    try:
        lws: int | None = int(env["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        lws = None
    return Launch(ctx["rank"], ctx["local_rank"], ctx["world_size"], lws)


def zero3_enabled() -> bool:
    """transformers' own answer, only where transformers' deepspeed module is already loaded
    (it is whenever a model is being loaded; importing it here would pull transformers in)."""
    mod = sys.modules.get("transformers.integrations.deepspeed")
    fn = getattr(mod, "is_deepspeed_zero3_enabled", None)
    try:
        return bool(fn()) if fn is not None else False
    except Exception:
        return False


def fsdp_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """accelerate (and transformers' Trainer with ``--fsdp``) announce FSDP through the
    environment: ACCELERATE_USE_FSDP, or the FSDP_* variables ``accelerate launch`` exports."""
    env = os.environ if environ is None else environ
    if env.get("ACCELERATE_USE_FSDP", "").strip().lower() in _TRUE:
        return True
    return any(k.startswith("FSDP_") and v.strip() for k, v in env.items())


def _default_device() -> str:
    torch = sys.modules.get("torch")
    if torch is None:
        return "cpu"
    try:
        return str(torch.get_default_device())
    except Exception:
        try:
            return str(torch.empty(0).device)
        except Exception:
            return "cpu"


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
    device = _default_device()
    return InitContext(
        zero3=zero3_enabled(),
        fsdp=fsdp_enabled(environ),
        meta=device.startswith("meta") or _init_empty_weights_active(),
        default_device=device,
    )


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


# --- the cache -----------------------------------------------------------------------------------

_lock = threading.RLock()
_static: Facts | None = None
_collecting = threading.local()


def current() -> Facts:
    """This process's facts: probes cached after the first call, context re-read each call."""
    global _static
    static = _static
    if static is None:
        with _lock:
            if _static is None:
                if getattr(_collecting, "busy", False):
                    # Re-entered from an import hook fired by our own probe: answer without probes.
                    return _no_probe_facts()
                _collecting.busy = True
                try:
                    _static = _collect_static()
                finally:
                    _collecting.busy = False
            static = _static
    return dataclasses.replace(static, launch=launch_now(), init=init_context_now())


def _no_probe_facts() -> Facts:
    return Facts(cuda=False, gpus=(), backends={}, launch=launch_now(), init=init_context_now())


def reset() -> None:
    """Forget the cached probes (tests; after installing or removing a backend)."""
    global _static
    with _lock:
        _static = None


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
    cuda = bool(gpus)
    launch = launch or Launch()
    base = Facts(cuda, gpus, {}, launch=launch)
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
            cuda=cuda,
            gpu=gpu,
            torch_version=torch_version,
            transformers_version=transformers_version,
        )
    return Facts(
        cuda=cuda,
        gpus=gpus,
        backends=backends,
        launch=launch,
        init=init or InitContext(),
        accelerate=accelerate,
        torch_version=torch_version,
        transformers_version=transformers_version,
    )
