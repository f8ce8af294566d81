"""What a call is checked against: the one table of references, and who computed the call.

* The kernel computed it (flash-attn, a hub kernel, xformers, a selected faster kernel): its
  family's twin, run in float32 (float64 on a CPU, or on a CUDA device where float32 matmuls may
  run in TF32) from the same arguments (:data:`TWINS`). A call whose reference would hold more
  than :data:`MEMORY_BUDGET` bytes of scores at once, or whose family has no twin, is checked
  against the explicit float64 reference instead (:mod:`.explicit`, bounded memory).
* attnguard's twin computed it (the kernel cannot run here, the call was rerouted, the site is
  latched after a kernel error): the explicit float64 reference of the family's rules, which
  shares no code with the twins; where that cannot express the call (rotary KV caches, xformers'
  block-diagonal biases), the twin itself in float64 (``twin_float64``: catches precision
  faults, not a wrong rule). transformers' flash entry computed by the flash-attn twins inside
  its code path is checked against the entry computed on SDPA (``flash_entry_on_sdpa_*``: its
  own masks from the call's padding, packed rows, window and sinks, no code of the flash-attn
  twins).
* transformers' sdpa entry and diffusers' backends: the explicit reference of the library's
  documented semantics. transformers' sdpa entry where that cannot express the call, or rejects
  its output: its own function in float64 (``library_float64``: SDPA computes float64 on its
  math path, so a fused kernel is still checked, and which calls a release makes causal is that
  release's own), a mismatch standing only where both references reject the output.

Families with no reference (a kernel whose semantics are its own, flex attention, paged entries)
are not checked (``no_reference``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from .. import kernels
from ..computing import NOW, subject
from ..kernel_identity import FLASH_FAMILIES, Family, KernelId, Source
from ..kernels import EntryKind
from . import calls
from .calls import DIFFUSERS, FLASH, TRANSFORMERS, XFORMERS, Call
from .compare import tf32_allowed

Tensor = torch.Tensor
KERNEL, TWIN = "kernel", "sdpa_twin"
MEMORY_BUDGET = 1 << 30  # bytes of scores a twin reference may hold at once
_HALF = (torch.float16, torch.bfloat16)


def family_twins(family: Family | None) -> dict[str, Callable[..., Any]]:
    """Each family's twins, by the name of the function they stand for (flash-attn 3's and 4's
    keep flash-attn's names)."""
    from .. import fallback
    from ..fallback import families

    if family is Family.FA2:
        return dict(fallback.FLASH_FUNCTIONS)
    if family in (Family.FA3, Family.FA4):
        twins = families.of_kernel(KernelId(family.value, Source.TWIN, family))
        return {role: fn for role, fn in (twins.twins if twins else {}).items() if fn is not None}
    if family is Family.XFORMERS:
        return {"memory_efficient_attention": fallback.xformers_memory_efficient_attention}
    return {}


def family_of(entry: Any) -> Family | None:
    """What the kernel behind ``entry`` is (what its integration said; flash-attn's functions
    are flash-attn 2's, the only release line attnguard patches)."""
    given = getattr(entry, "family", None)
    if given is not None:
        return given
    return {
        EntryKind.FLASH_KERNEL: Family.FA2,
        EntryKind.XFORMERS: Family.XFORMERS,
        EntryKind.REGISTRY_SDPA: Family.SDPA,
    }.get(entry.kind)


# (convention, entry kind or None) -> the families with a reference there
_CHECKED: dict[tuple[str, str | None], frozenset[Family]] = {
    (FLASH, None): FLASH_FAMILIES,
    (XFORMERS, None): frozenset({Family.XFORMERS}),
    (TRANSFORMERS, EntryKind.REGISTRY_FLASH): FLASH_FAMILIES,
    (TRANSFORMERS, EntryKind.REGISTRY_SDPA): frozenset({Family.SDPA}),
    (DIFFUSERS, None): frozenset({Family.SDPA, Family.FA2, Family.XFORMERS}),
}


def checkable(entry: Any, convention: str | None, family: Family | None) -> bool:
    """Whether calls through ``entry`` have a reference at all (decided once per entry)."""
    if convention is None or family is None:
        return False
    kind = entry.kind if convention == TRANSFORMERS else None
    return family in _CHECKED.get((convention, kind), frozenset())


def twin_of(entry: Any, convention: str, family: Family | None) -> Callable[..., Any] | None:
    """The twin that is the reference of a kernel's call (None: none)."""
    if convention in (FLASH, XFORMERS):
        return family_twins(family).get(entry.name)
    if convention == TRANSFORMERS and entry.kind == EntryKind.REGISTRY_FLASH:
        return entry.twin  # transformers' flash entry on SDPA, with its family's dropout rule
    return None


def explicit_of(entry: Any, convention: str) -> Callable[[Call, float], Any] | None:
    if convention == FLASH:
        return calls.flash_explicit
    if convention == XFORMERS:
        return calls.xformers_explicit
    if convention == DIFFUSERS:
        return calls.diffusers_explicit
    if convention == TRANSFORMERS and entry.kind == EntryKind.REGISTRY_SDPA:
        return calls.sdpa_explicit
    return None


def computed_by(entry: Any, call: Call, args: tuple[Any, ...], settings: Any) -> str:
    """Who computed the call that just ran: the kernel, or attnguard's twin (what the call guard
    decided for it, read from the same facts: the latched sites, the reroute reasons, the table
    of what computes now)."""
    if NOW.latched.get(entry.latch_key(args)) is not None:
        return TWIN
    reroutes = settings.changes_things and settings.allows("reroute")
    if reroutes and entry.kind in (
        EntryKind.FLASH_KERNEL,
        EntryKind.XFORMERS,
        EntryKind.REGISTRY_FLASH,
    ):
        query = call.named.get("q", call.named.get("qkv", call.named.get("query")))
        mask = call.named.get("attention_mask", call.named.get("attn_bias"))
        head_dim = call.q.shape[-1] if entry.kind == EntryKind.FLASH_KERNEL else 0
        if isinstance(query, Tensor):
            if kernels.reroute_reason(entry.kind, query, head_dim, mask, call.named) is not None:
                return TWIN
            if (
                entry.kind == EntryKind.FLASH_KERNEL
                and query.dtype not in _HALF
                and settings.fp32_policy == "fallback"
            ):
                return TWIN
    if entry.kind == EntryKind.REGISTRY_FLASH and NOW.on_twins(subject("transformers", entry.name)):
        return TWIN
    if call.convention == DIFFUSERS and NOW.on_twins(subject("diffusers", entry.name)):
        return TWIN
    return KERNEL


def scores_held(call: Call) -> int:
    """Elements of scores a reference that writes attention out would hold for this call."""
    q, k = call.q, call.k
    heads = q.shape[-2]
    if q.dim() == 3:  # packed rows: every query against the longest sequence's keys
        return q.shape[0] * heads * call.keys
    return q.shape[0] * heads * q.shape[1] * call.keys if k.dim() == 4 else 0


def reference_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and not tf32_allowed():
        return torch.float32
    return torch.float64


def run_twin(twin: Callable[..., Any], call: Call, dtype: torch.dtype) -> Tensor:
    """``twin`` on the call's own arguments, every floating tensor in ``dtype`` (KV caches
    copied: the twin writes into them)."""
    named: dict[str, Any] = {}
    for key, value in call.named.items():
        if isinstance(value, Tensor) and value.is_floating_point():
            value = value.detach().to(dtype, copy=key in ("k_cache", "v_cache"))
        named[key] = value
    if "output_dtype" in named:
        named["output_dtype"] = None
    return first_tensor(twin(**named))


def first_tensor(result: Any) -> Tensor:
    """The attention output of a result (flash-attn's functions may return (out, lse, ...),
    transformers' registry entries (out, weights))."""
    if isinstance(result, Tensor):
        return result
    if isinstance(result, (tuple, list)) and result and isinstance(result[0], Tensor):
        return result[0]
    raise TypeError(f"no attention output in a {type(result).__name__}")


def within_budget(call: Call, dtype: torch.dtype) -> bool:
    """The scores a twin reference may write out, and the KV cache it copies, fit the budget."""
    held = scores_held(call)
    if call.name == "flash_attn_with_kvcache":
        held += 2 * call.k.numel()
    return held * torch.finfo(dtype).bits // 8 <= MEMORY_BUDGET


def finite_max(t: Tensor) -> float:
    """max |t| over its finite elements (padding past a sequence's end may hold anything)."""
    if t.numel() == 0:
        return 0.0
    a = t.detach().abs()
    value = float(torch.where(torch.isfinite(a), a, 0.0).amax())
    return value if math.isfinite(value) else 0.0
