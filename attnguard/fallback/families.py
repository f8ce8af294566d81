"""The flash-attn families attnguard has twins of, each computing its own family's rules, and the
one question integrations ask: which twins stand for this attention implementation?

A kernel's family decides what its calls mean (how a window is normalised, whether there is
dropout, how attention sinks are passed, what is returned) and, through the twins' signatures,
what a library hands it: transformers' flash path passes a kernel only the keyword arguments its
signature declares (``_lazy_define_process_function``), so a family's twins declare exactly what
its kernels declare and transformers passes them what it would pass the kernel.

* ``flash-attn 2`` (:mod:`.dense`, :mod:`.varlen`, :mod:`.kvcache`): windows closed at seqlen_k
  on an open side beside a closed one, dropout; sinks as ``s_aux`` (an addition of the twins:
  flash-attn 2 has none, transformers routes sink models to kernels that have them);
* ``flash-attn 3`` and vLLM's build of it (:mod:`.fa3`): an open window side stays open, no
  dropout; sinks (``s_aux``) in vLLM's build only;
* ``flash-attn 4`` (:mod:`.fa4`): window sides ``None`` for open, no dropout, sinks as
  ``learnable_sink``, no KV-cache function.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import kernel_identity
from ..kernel_identity import Family as KernelFamily
from ..kernel_identity import KernelId
from . import dense, fa3, fa4, kvcache, varlen

# the roles: the names a family's kernel functions have (and libraries look them up by)
FUNC, VARLEN, KVCACHE = "flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"
ROLES = (FUNC, VARLEN, KVCACHE)


@dataclass(frozen=True)
class Family:
    """One family of flash-attn kernels and attnguard's twins of its functions."""

    name: str
    major: int
    twins: dict[str, Callable[..., Any] | None] = field(compare=False)
    # the kernels take dropout (``dropout_p``); where not, a library passes none
    dropout: bool
    # the parameter the twins take attention sinks by ("" where the kernels take none)
    sinks: str

    def __str__(self) -> str:
        return self.name


FA2 = Family(
    "flash-attn 2",
    2,
    {
        FUNC: dense.flash_attn_func,
        VARLEN: varlen.flash_attn_varlen_func,
        KVCACHE: kvcache.flash_attn_with_kvcache,
    },
    dropout=True,
    sinks="s_aux",
)
FA3 = Family(
    "flash-attn 3",
    3,
    {
        FUNC: fa3.flash_attn_func,
        VARLEN: fa3.flash_attn_varlen_func,
        KVCACHE: fa3.flash_attn_with_kvcache,
    },
    dropout=False,
    sinks="",
)
FA3_VLLM = Family(
    "flash-attn 3 (vLLM's build, with attention sinks)",
    3,
    {
        FUNC: fa3.vllm_flash_attn_func,
        VARLEN: fa3.vllm_flash_attn_varlen_func,
        KVCACHE: fa3.vllm_flash_attn_with_kvcache,
    },
    dropout=False,
    sinks="s_aux",
)
FA4 = Family(
    "flash-attn 4",
    4,
    {FUNC: fa4.flash_attn_func, VARLEN: fa4.flash_attn_varlen_func, KVCACHE: None},
    dropout=False,
    sinks="learnable_sink",
)
FAMILIES = (FA2, FA3, FA3_VLLM, FA4)

_BY_FAMILY = {KernelFamily.FA2: FA2, KernelFamily.FA3: FA3, KernelFamily.FA4: FA4}


def twins_for(family: Family) -> dict[str, Callable[..., Any] | None]:
    """``family``'s twins by role (flash_attn_func, flash_attn_varlen_func,
    flash_attn_with_kvcache; None where the family has no such function)."""
    return dict(family.twins)


def of_kernel(kernel: KernelId | None) -> Family | None:
    """The twins that stand for ``kernel`` (what it is: :mod:`attnguard.kernel_identity`): its
    family's, vLLM's build of flash-attn 3 where its functions take attention sinks; None where
    attnguard does not know what it computes."""
    if kernel is None or kernel.family is None:
        return None
    if kernel.family is KernelFamily.FA3 and kernel.sinks:
        return FA3_VLLM
    return _BY_FAMILY.get(kernel.family)


def of_implementation(implementation: Any) -> Family | None:
    """The twins an attention implementation stands for: ``flash_attention_N`` the package it
    loads; a hub kernel's name (``"org/repo"``) the family known for it (its repository, or the
    functions it exported where it loaded); None for anything else."""
    if not isinstance(implementation, str):
        return None
    name = kernel_identity.bare(implementation)
    from ..computing import NOW, subject

    loaded = NOW.get(subject("transformers", name))
    return of_kernel(loaded.requested if loaded is not None else kernel_identity.of_request(name))


def hub_family(name: str) -> Family | None:
    """The twins of hub kernel ``name`` (an ``"org/repo[@revision]"`` name) that did not load:
    its repository is all that is known of it (None: attnguard does not know what it computes)."""
    return of_kernel(kernel_identity.of_request(name))


def refuses(twin: Any) -> bool:
    """Whether ``twin`` may refuse a call with :class:`.refusal.Uncomputed` (the flash-attn 3
    and 4 twins: arguments of those kernels they do not compute)."""
    return any(twin in f.twins.values() for f in (FA3, FA3_VLLM, FA4))
