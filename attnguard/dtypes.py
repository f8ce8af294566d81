"""Which dtype an attention call runs in: autocast, the module's weights, the inputs, the GPU.

One answer for every entry point (:mod:`attnguard.callguard`): mixed q/k/v are unified to the
autocast dtype when autocast is on, else to the dtype the module computes in (what transformers'
flash path calls the target dtype), else to the half dtype among the inputs (the float32 one is
the accident: an fp32 scale or norm upcast it); a half-only kernel never gets float32.
"""

from __future__ import annotations

from typing import Any

import torch

Tensor = torch.Tensor
_BF16 = torch.bfloat16
_FP16 = torch.float16
HALF_DTYPES = (_FP16, _BF16)


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for ``device_type``, or None when autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        return None
    return None


def module_dtype(module: Any) -> torch.dtype | None:
    """The dtype the module computes in: what transformers' flash path calls the target dtype.

    Quantized models report their pre-quantization dtype; otherwise the first Linear weight,
    then the first floating parameter.
    """
    config = getattr(module, "config", None)
    pre = getattr(config, "_pre_quantization_dtype", None)
    if isinstance(pre, torch.dtype):
        return pre
    if not isinstance(module, torch.nn.Module):
        return None
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear) and sub.weight.is_floating_point():
            return sub.weight.dtype
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


_half_by_device: dict[int, torch.dtype] = {}


def half_dtype_for(device: torch.device, choice: str = "auto") -> torch.dtype:
    """The half dtype to run a half-only kernel in: ``choice`` (the ATTNGUARD_DTYPE setting:
    "bf16", "fp16"), else ("auto") bf16 where native."""
    if choice == "bf16":
        return _BF16
    if choice == "fp16":
        return _FP16
    if device.type != "cuda":
        return _BF16
    index = device.index if device.index is not None else torch.cuda.current_device()
    dtype = _half_by_device.get(index)
    if dtype is None:
        # is_bf16_supported() counts emulation (True on V100/T4); capability says native.
        major = torch.cuda.get_device_capability(index)[0]
        dtype = _BF16 if major >= 8 else _FP16
        _half_by_device[index] = dtype
    return dtype


def choose_dtype(
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    *,
    preferred: torch.dtype | None = None,
    half_only: bool = False,
    dtype_setting: str = "auto",
) -> torch.dtype:
    """One dtype for mixed q/k/v (``dtypes[0]`` is the query's).

    The autocast dtype if autocast is on; else ``preferred`` (the module's weight dtype) when it
    suits the kernel; else the half dtype among the inputs (the fp32 one is the accident: an fp32
    scale or norm upcast it); else the widest. Never float32 for a half-only kernel.
    """
    auto = autocast_dtype(device.type)
    if auto is not None and (not half_only or auto in HALF_DTYPES):
        return auto
    if (
        preferred is not None
        and preferred.is_floating_point
        and (not half_only or preferred in HALF_DTYPES)
    ):
        return preferred
    halves = [d for d in dtypes if d in HALF_DTYPES]
    if halves:
        return dtypes[0] if dtypes[0] in HALF_DTYPES else halves[0]
    if half_only:
        return half_dtype_for(device, dtype_setting)
    out = dtypes[0]
    for d in dtypes[1:]:
        if d.is_floating_point:
            out = torch.promote_types(out, d)
    return out


def dtype_names(**tensors: Any) -> dict[str, str]:
    return {k: str(t.dtype).replace("torch.", "") for k, t in tensors.items() if t is not None}


def name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def cast_out(result: Any, dtype: torch.dtype | None) -> Any:
    """Cast the attention output (first item of a tuple result) to ``dtype``."""
    if dtype is None:
        return result
    if isinstance(result, Tensor):
        return result if result.dtype == dtype else result.to(dtype)
    if isinstance(result, tuple) and result and isinstance(result[0], Tensor):
        out = result[0]
        return (out if out.dtype == dtype else out.to(dtype), *result[1:])
    return result
