"""Which kernel computes an attention call, and why: the one place that decides.

Every attention call attnguard sees is computed by one of two kernels: the one the caller asked
for, or attnguard's SDPA twin of it (:mod:`attnguard.fallback` for the flash-attn and xformers
functions, :func:`attnguard.callguard.flash_call_on_sdpa` for transformers' flash registry entry).
A twin takes exactly the arguments of the function it stands for and computes the same thing:
flash-attn's masks (bottom-right causal alignment, windows, softcap, ALiBi, packed sequences) on
torch's own kernels: its bundled flash kernel where it can run, else
``scaled_dot_product_attention``, whose dispatcher picks the fastest fused kernel that can take the
call (flash, cuDNN, memory-efficient); the math path only where none can. No SDPA backend is ever
forced.

Two levels decide here, with the same twins; a third, inside each twin, picks which of torch's
kernels computes the call (torch's own flash kernel, SDPA's dispatcher, per-sequence SDPA,
explicit math), fastest first where it can express the call: the table in
:mod:`attnguard.fallback.kernels`.

* **Per process, at load time** (:func:`flash_kernel_unusable`): flash attention was requested and
  the flash-attn kernel cannot run here at all (not installed, CUDA extension broken, no CUDA, GPU
  below sm80, version too old, a tiny test call failed). transformers' flash code path is kept and
  its kernel functions are served by the twins (:mod:`attnguard.patches.transformers_kernels`);
  one ``backend_fallback`` event at load says so. The reason code is the backend's status
  (:mod:`attnguard.facts`). Calls computed this way are not events one by one: they are what the
  load decided.
* **Per call** (:func:`reroute_reason`): this one call cannot be taken by the requested kernel.
  Each such call is a ``backend_rerouted`` event (counted per call, emitted once per site and
  reason); a known kernel error re-runs the call on the twin (``kernel_error_recovered``) and
  sends that site's later calls straight to the twin (``backend_rerouted`` with the error's code).

| entry point | reason_code | why the requested kernel cannot take the call |
|---|---|---|
| flash-attn function | ``cpu_tensors`` | flash-attn runs on CUDA only |
| flash-attn function | ``head_dim_unsupported`` | flash-attn supports head_dim <= 256 |
| flash-attn function | ``fp32_input`` | float32 inputs with ``ATTNGUARD_FP32_POLICY=fallback`` |
| xformers memory_efficient_attention | ``cpu_tensors`` | xformers' fused ops run on CUDA |
| transformers flash registry entry | ``mask_4d`` | flash takes a 2D padding mask only |
| transformers flash registry entry | ``output_attentions`` | flash returns no attention weights |
| any (after a kernel error) | see :data:`KNOWN_KERNEL_ERRORS` | the kernel raised a known error |

float32 inputs into flash-attn with ``ATTNGUARD_FP32_POLICY=cast`` (the default) stay on the kernel:
q/k/v are cast to the half dtype for it and the output back (``qkv_unified``, ``fp32_into_flash``).
"""

from __future__ import annotations

from typing import Any

# entry-point kinds
FLASH_KERNEL = "flash_kernel"  # a flash_attn function (flash_attn_func, varlen, kvcache, ...)
XFORMERS = "xformers"  # xformers.ops.memory_efficient_attention
REGISTRY_FLASH = "registry_flash"  # transformers' flash registry entry (its code path)
REGISTRY_SDPA = "registry_sdpa"  # transformers' sdpa registry entry
REGISTRY_OTHER = "registry_other"  # any other registry entry: dtypes and devices only

FLASH_MAX_HEAD_DIM = 256

REROUTE_REASONS: dict[str, str] = {
    "cpu_tensors": "the kernel runs on CUDA only; this call got CPU tensors",
    "head_dim_unsupported": f"flash-attn supports head_dim <= {FLASH_MAX_HEAD_DIM}",
    "fp32_input": "float32 inputs into half-only flash-attn (ATTNGUARD_FP32_POLICY=fallback)",
    "mask_4d": "flash attention takes a 2D padding mask; this call got a 4D mask",
    "output_attentions": "flash attention cannot return attention weights (output_attentions)",
}

# (substring of the error message, reason_code). Matched against the first lines of RuntimeError /
# ValueError (NotImplementedError is a RuntimeError). Anything else is unknown and propagates.
KNOWN_KERNEL_ERRORS: tuple[tuple[str, str], ...] = (
    ("only supports Ampere GPUs or newer", "gpu_too_old"),
    ("bfloat16 is only supported on Ampere GPUs or newer", "gpu_too_old"),
    ("only support fp16 and bf16", "dtype_unsupported"),
    ("No available kernel", "no_sdpa_kernel"),
    ("No viable backend for scaled_dot_product_attention", "no_sdpa_kernel"),
    ("head dimension", "head_dim_unsupported"),
    ("No operator found for `memory_efficient_attention", "xformers_no_operator"),
    ("Expected all tensors to be on the same device", "device_mismatch"),
    ("with arguments from the 'CPU' backend", "cpu_backend"),
    ("no kernel image is available for execution on the device", "no_kernel_image"),
)


def reroute_reason(
    kind: str, query: Any, head_dim: int, mask: Any, kwargs: dict[str, Any]
) -> str | None:
    """Why the requested kernel cannot take this call (a key of :data:`REROUTE_REASONS`), or
    None: the kernel runs it. Pure and cheap: shapes, devices and flags only."""
    if kind in (FLASH_KERNEL, XFORMERS) and query.is_cpu:
        return "cpu_tensors"
    if kind == FLASH_KERNEL and head_dim > FLASH_MAX_HEAD_DIM:
        return "head_dim_unsupported"
    if kind == REGISTRY_FLASH:
        if getattr(mask, "dim", None) is not None and mask.dim() == 4:
            return "mask_4d"
        if kwargs.get("output_attentions"):
            return "output_attentions"
    return None


def classify_kernel_error(exc: BaseException) -> tuple[str, str] | None:
    """(reason_code, first line) for a known recoverable kernel error, else None."""
    from .errors import AttnGuardError

    if not isinstance(exc, (RuntimeError, ValueError)) or isinstance(exc, AttnGuardError):
        return None
    text = str(exc)
    head = text[:2000]
    for needle, code in KNOWN_KERNEL_ERRORS:
        if needle in head:
            first = (text.strip().splitlines() or [""])[0][:300]
            return code, first
    return None


def flash_kernel_unusable(implementation: str) -> str | None:
    """The backend status code when the flash-attn kernel behind ``implementation`` cannot run in
    this process (then the SDPA twins serve transformers' flash path), else None. Probes the
    backend the first time (:mod:`attnguard.facts`)."""
    from . import facts

    status = facts.current().backend(implementation)
    return None if status.usable else status.reason_code
