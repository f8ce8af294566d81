"""Which kernel computes an attention call, and why: the one module that answers it.

Every attention call attnguard sees is computed by one of two kernels: the one the caller asked
for (:class:`Kernel`: flash-attn, xformers, or one of transformers' own implementations), or
attnguard's SDPA twin of it (``Kernel.SDPA_TWIN``: :mod:`attnguard.fallback` for the flash-attn
and xformers functions, :func:`attnguard.fallback.registry.flash_call_on_sdpa` for transformers'
flash registry entry). A twin takes exactly the arguments of the function it stands for and
computes the same thing: flash-attn's masks (bottom-right causal alignment, windows, softcap,
ALiBi, packed sequences) on torch's own kernels. Inside a twin, :mod:`attnguard.fallback.routes`
picks which of torch's kernels computes the call (:class:`TwinKernel`), fastest first where it
can express the call; no SDPA backend is ever forced.

The questions, in the order they are asked (:data:`QUESTIONS`; ``attnguard doctor`` prints them):

1. **Per process, at load time**: can the requested kernel run here at all?
   (:func:`flash_kernel_unusable`, from the backend's status in :mod:`attnguard.facts`). If
   not, transformers' flash code path is kept and its kernel functions are served by the twins
   (rule ``flash-on-sdpa``), or the model loads with a fallback backend (the other rules of
   :data:`attnguard.plan.TABLE`). One ``backend_fallback`` event at load says so; calls computed
   this way are not events one by one: they are what the load decided.
2. **Per call**: is this site latched after a kernel error? (``attnguard.callguard.latched``):
   then the call goes straight to the twin.
3. **Per call**: can the requested kernel take this call? (:func:`reroute_reason`,
   :data:`REROUTE_REASONS`). If not, the call runs on the twin: one ``backend_rerouted`` event
   (counted per call, emitted once per site and reason).
4. **Opt-in** ``ATTNGUARD_KERNEL=fastest``: has the selection measured another kernel faster for
   this bucket of calls? (:mod:`attnguard.selection.decisions`).
5. **After a kernel error**: is it a known, recoverable one? (:func:`classify_kernel_error`,
   :data:`KNOWN_KERNEL_ERRORS`). Then the call re-runs on the twin (``kernel_error_recovered``)
   and the site's later calls go straight there (question 2).
6. **Inside a twin**: which of torch's kernels computes it? (the table of
   :mod:`attnguard.fallback.routes`).

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

from enum import StrEnum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._settings import Settings


class Kernel(StrEnum):
    """What computes an attention call; each value is the word events use (``requested``,
    ``selected``)."""

    # what a caller requests
    FLASH_ATTN = "flash_attn"  # a flash-attn function
    XFORMERS = "xformers"  # xformers.ops.memory_efficient_attention
    SDPA = "sdpa"  # transformers' sdpa implementation (never attnguard's twin)
    EAGER = "eager"  # transformers' eager implementation
    FLEX = "flex_attention"  # transformers' flex attention
    # what attnguard computes a call with instead
    SDPA_TWIN = "sdpa_twin"  # attnguard's twin of the requested function, on torch's kernels


class TwinKernel(StrEnum):
    """Inside a twin, which of torch's kernels computes the call (the rows of
    :data:`attnguard.fallback.routes.TABLE`)."""

    TORCH_FLASH = "torch_flash"  # torch's own FlashAttention-2
    SDPA = "sdpa"  # scaled_dot_product_attention, no mask: its dispatcher picks the kernel
    SDPA_MASK = "sdpa_mask"  # SDPA with a keep-mask and/or an additive bias
    EXPLICIT = "explicit"  # softmax attention written out in float32
    PER_SEQUENCE = "per_sequence"  # a packed call split into dense calls per sequence length
    PADDED = "padded"  # a packed call gathered into a padded batch
    TRITON_DECODE = "triton_decode"  # attnguard's Triton kernel for one KV-cache decode step


class EntryKind(StrEnum):
    """Which kind of entry point a call came through: the rules that apply to it."""

    FLASH_KERNEL = "flash_kernel"  # a flash_attn function (flash_attn_func, varlen, kvcache, ...)
    XFORMERS = "xformers"  # xformers.ops.memory_efficient_attention
    REGISTRY_FLASH = "registry_flash"  # transformers' flash registry entry (its code path)
    REGISTRY_SDPA = "registry_sdpa"  # transformers' sdpa registry entry
    REGISTRY_OTHER = "registry_other"  # any other registry entry: dtypes and devices only


# (when, the question, the one place that answers it), in the order they are asked
QUESTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "load time, per process",
        "can the requested kernel run here at all?",
        "attnguard.kernels.flash_kernel_unusable (facts) -> attnguard.plan.TABLE",
    ),
    ("per call", "is this site latched after a kernel error?", "attnguard.callguard.latched"),
    (
        "per call",
        "can the requested kernel take this call?",
        "attnguard.kernels.reroute_reason (REROUTE_REASONS)",
    ),
    (
        "per call, ATTNGUARD_KERNEL=fastest",
        "has the selection measured another kernel faster for these calls?",
        "attnguard.selection.decisions",
    ),
    (
        "after a kernel error",
        "is it a known, recoverable one?",
        "attnguard.kernels.classify_kernel_error (KNOWN_KERNEL_ERRORS)",
    ),
    (
        "inside a twin",
        "which of torch's kernels computes it?",
        "attnguard.fallback.routes.TABLE",
    ),
)

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
    kind: EntryKind, query: Any, head_dim: int, mask: Any, kwargs: dict[str, Any]
) -> str | None:
    """Why the requested kernel cannot take this call (a key of :data:`REROUTE_REASONS`), or
    None: the kernel runs it. Pure and cheap: shapes, devices and flags only."""
    if kind in (EntryKind.FLASH_KERNEL, EntryKind.XFORMERS) and query.is_cpu:
        return "cpu_tensors"
    if kind == EntryKind.FLASH_KERNEL and head_dim > FLASH_MAX_HEAD_DIM:
        return "head_dim_unsupported"
    if kind == EntryKind.REGISTRY_FLASH:
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


def flash_kernel_unusable(implementation: str, settings: Settings | None = None) -> str | None:
    """The backend status code when the flash-attn kernel behind ``implementation`` cannot run in
    this process (then the SDPA twins serve transformers' flash path), else None. Probes the
    backend the first time (:mod:`attnguard.facts`, with the settings in force)."""
    from . import facts

    status = facts.current(settings).backend(implementation)
    return None if status.usable else status.reason_code
