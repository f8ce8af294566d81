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
   this way are not events one by one: they are what the load decided. Where the library loads
   flash attention from the Hugging Face kernel hub instead (an ``"org/repo"`` request,
   transformers' own fallback when flash-attn is missing, a model routed to a hub kernel,
   diffusers' ``*_hub`` backends), the library tries to load it as it would without attnguard:
   a hub kernel that loads computes every call, untouched; one that cannot load is computed by
   the twins of its family where it is one of flash-attn's (what a kernel is:
   :mod:`attnguard.kernel_identity`), else attnguard steps aside (:func:`verdict`).
2. **Per call**: is this site latched after a kernel error? (``NOW.latched``, the table of what
   computes now: :mod:`attnguard.computing`): then the call goes straight to the twin.
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

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from .facts import hub
from .kernel_identity import KernelId, Source, hub_repo

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
    HUB = "hub_kernel"  # a kernel from the Hugging Face kernel hub (events name its repo)
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
    REGISTRY_PAGED = "registry_paged"  # a paged entry (the cache update inside): never re-run


# The kinds of transformers' attention registry entries (called as transformers calls them). A
# tuple, not a frozenset: torch 2.8's compiler cannot trace a frozenset's membership test.
REGISTRY_KINDS = (
    EntryKind.REGISTRY_FLASH,
    EntryKind.REGISTRY_SDPA,
    EntryKind.REGISTRY_OTHER,
    EntryKind.REGISTRY_PAGED,
)


# (when, the question, the one place that answers it), in the order they are asked
QUESTIONS: tuple[tuple[str, str, str], ...] = (
    (
        "load time, per process",
        "can the requested kernel run here at all?",
        "attnguard.kernels.flash_kernel_unusable (facts) -> attnguard.plan.TABLE",
    ),
    (
        "load time, per hub kernel",
        "where flash attention comes from the kernel hub: does the hub kernel load? if not, is "
        "it one of flash-attn's families?",
        "the library's own loader (facts.hub), what the kernel is (attnguard.kernel_identity) "
        "-> attnguard.kernels.verdict",
    ),
    ("per call", "is this site latched after a kernel error?", "attnguard.computing.NOW.latched"),
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
    backend the first time (:mod:`attnguard.facts`, with the settings in force). For a hub kernel
    (``"org/repo"``): the reason it did not load, once its library tried (None before, or when
    it loaded)."""
    repo = hub_repo(implementation)
    if repo is not None:  # a hub kernel: what became of its library's attempt to load it
        found = hub.outcome(repo)
        return found.reason_code if found is not None and not found.loaded else None
    from . import facts

    status = facts.current(settings).backend(implementation)
    return None if status.usable else status.reason_code


# --- the verdict --------------------------------------------------------------------------------

# What attnguard does where a kernel cannot compute a call (``attnguard doctor`` prints these rows;
# events carry the rule): (rule, when, then, event, reason codes). The load-time plan's own rows
# (flash_attention_N whose package cannot run here) are :data:`attnguard.plan.TABLE`.
RULES: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "hub-kernel-tried",
        "an org/repo request, a flash_attention_N request transformers serves from the hub "
        "(flash-attn missing, the `kernels` package at a version it accepts), a model whose flash "
        "request transformers routes to a hub kernel, a diffusers *_hub backend chosen with "
        "set_attention_backend or attention_backend(...)",
        "change nothing: the library loads the hub kernel as it would without attnguard (its "
        "cache, its network; again whenever the library tries again); a hub kernel that loads "
        "computes every call, its own errors included, whatever its name",
        "-",
        "-",
    ),
    (
        "hub-on-sdpa",
        "the hub kernel does not load (no `kernels`, a version the library refuses, offline "
        "without a cached build, no build for this torch and device, its import failed), its "
        "repository is one whose builds are a flash-attn family's functions "
        "(attnguard.kernel_identity.HUB_REPOS), attnguard's twins cover the library's code path "
        "and the model passes nothing they do not compute",
        "compute its calls with attnguard's SDPA twins of that family's functions (sinks "
        "included), the library's code path kept as it would run with the kernel",
        "backend_fallback",
        "hub_package_missing | hub_package_refused | hub_kernel_unavailable",
    ),
    (
        "hub-aside",
        "the hub kernel does not load, and attnguard does not know what it computes (a custom "
        "repo, org/repo:function, a kernel with its own attention function, block-sparse or "
        "quantized attention), does not recognise the library's flash code path, or the model "
        "passes an argument the twins do not compute",
        "change nothing: the library's own error stands, exactly as without attnguard",
        "observed",
        "hub_* | flash_path_unrecognised | flash_argument_uncomputed",
    ),
    (
        "package-on-sdpa",
        "a kernel package a library calls cannot run here (diffusers' flash / flash_varlen / "
        "xformers backends; transformers' flash path once the load plan kept it: "
        "attnguard.plan.TABLE) and its family has twins",
        "the library's code runs as it would with the kernel, its kernel calls computed by "
        "attnguard's twins of that family",
        "backend_fallback",
        "<backend status> | backend_package_unusable",
    ),
    (
        "no-twin",
        "a kernel package a library calls cannot run here and attnguard has no twin of its "
        "family, or the library's code no longer calls the functions the twins replace",
        "change nothing: the library's own error stands",
        "observed",
        "no_twin",
    ),
)

SERVES, HUB_TWINS, HUB_ASIDE, PACKAGE_TWINS, NO_TWIN = (r[0] for r in RULES)


@dataclass(frozen=True)
class Verdict:
    """Which kernel computes the calls of a requested kernel, and why: one for every way in.

    ``requested``: what was asked for; ``twins``: attnguard's twins of its family compute its
    calls (else the kernel itself does, or its own error stands); ``rule``: the row of
    :data:`RULES`; ``reason_code`` / ``problem`` / ``change``: what the event says ("" problem:
    nothing is wrong)."""

    requested: KernelId
    twins: bool
    rule: str
    reason_code: str = "ok"
    problem: str = ""
    change: str = ""

    @property
    def computes(self) -> str:
        """What computes the calls, in events' words."""
        return Kernel.SDPA_TWIN.value if self.twins else self.requested.name

    @property
    def event(self) -> str:
        """The event that says this verdict ("" when nothing is wrong)."""
        if not self.problem:
            return ""
        return "backend_fallback" if self.twins else "observed"

    @property
    def reason(self) -> str:
        """The event's reason: the problem, then what attnguard does (or why it does nothing)."""
        return f"{self.problem}; {self.change}" if self.change else self.problem


def verdict(
    kernel: KernelId,
    cannot: tuple[str, str] | None,
    *,
    path_problem: str = "",
    uncomputed: tuple[str, ...] = (),
    chosen_for: str = "",
    library: str = "transformers",
    function: str = "",
) -> Verdict:
    """Pure: the verdict on ``kernel`` (what it is: :mod:`attnguard.kernel_identity`).

    ``cannot``: (reason code, why) it cannot compute here (its package unusable, a hub kernel
    that did not load), None when it can; ``path_problem``: why the library's code path around
    the kernel cannot run on the twins ("" when it can); ``uncomputed``: arguments the caller
    passes that the twins do not compute; ``chosen_for``: for a hub kernel, the request (or
    diffusers backend) the library routed to it ("" when it was asked for), for a package
    backend how it was chosen (" (chosen by ...)" or ""); ``library``: the library that loads
    or calls it; ``function``: for a package backend, the kernel function the library
    calls ("" where the twins of its family have none: no twin)."""
    hub = kernel.source is Source.HUB
    if cannot is None:
        return Verdict(kernel, False, SERVES if hub else "kernel-serves")
    code, why = cannot
    if hub:
        how = ""
        if chosen_for:
            how = (
                f" (transformers' choice for a {chosen_for} request)"
                if library == "transformers"
                else f" ({library}' {chosen_for} backend)"
            )
        problem = f"hub kernel {kernel.name}{how} cannot load here: {why}"
    else:
        problem = f"{library} attention backend {kernel.name!r}{chosen_for} cannot run here ({why})"
    aside, twins = (HUB_ASIDE, HUB_TWINS) if hub else (NO_TWIN, PACKAGE_TWINS)
    stands = "its error stands" if hub else f"{library}' error stands"
    if not kernel.computable or (not hub and not function):
        also = f" (and the model's attention passes {', '.join(uncomputed)})" if uncomputed else ""
        known = "does not know what this kernel computes" if hub else "has no twin of this kernel"
        return Verdict(kernel, False, aside, code, problem, f"attnguard {known}{also}, so {stands}")
    if path_problem:
        return Verdict(
            kernel,
            False,
            aside,
            "flash_path_unrecognised" if hub else "no_twin",
            problem,
            f"attnguard does not recognise how this {library} release wires its flash code "
            f"path ({path_problem}), so {stands}"
            if hub
            else f"{path_problem}: {stands}",
        )
    if uncomputed:
        return Verdict(
            kernel,
            False,
            aside,
            "flash_argument_uncomputed",
            problem,
            f"the model's attention passes {', '.join(uncomputed)}, which attnguard's twins do "
            f"not compute, so {stands}",
        )
    family = kernel.family.value if kernel.family is not None else ""
    change = (
        f"attnguard: compute its calls with attnguard's SDPA twins of the {family} functions "
        "(same semantics)"
        if hub
        else f"{library}' backend function runs with attnguard's twin of {function} (torch SDPA) "
        "in place of the kernel"
    )
    return Verdict(kernel, True, twins, code, problem, change)
