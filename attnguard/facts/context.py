"""The context a model is being built in, re-read on every call: the launcher's variables (rank,
world size), deliberate setups (DeepSpeed ZeRO-3, FSDP, meta-device init, a ``torch.device``
block), a training script, a quantized load.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


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


_TRUE = ("1", "true", "yes", "on")


def launch_now(environ: Mapping[str, str] | None = None) -> Launch:
    from ..observability.events import launch_context

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
