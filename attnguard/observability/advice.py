"""What to change in your own code, computed from what happened: the advice of a reason code.

A reason code's advice (``Reason.hint`` in :mod:`attnguard.observability.reasons`) is either a
fixed sentence, where nothing about the machine or the workload changes it, or a function of
:class:`Facts` (recorded while the program ran: :mod:`attnguard.observability.workload`):

* **the device**: where no CUDA GPU was seen, "install flash-attn for this GPU" cannot be
  followed, and is not said; the same for a GPU below what the kernel needs;
* **the workload**: where packed rows (padding-free batches: ``position_ids`` restarting,
  ``cu_seq_lens``) or sliding windows reached attnguard's twins of transformers' flash path,
  ``attn_implementation="sdpa"`` is never advised: transformers' sdpa path mixes packed sequences
  (with its default ``use_cache``) and does not compute flash's window on every release, so the
  hint would change the numbers. Where no call was seen, sdpa is advised only with that
  condition spelled out.

A new reason code's advice is one entry: ``Reason(code, ..., hint=<a sentence, or a function of
Facts>)``; a new fact is recorded in :mod:`.workload` and read here as an attribute of
:class:`Facts`. Everything here is pure: facts in, a sentence out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import workload

FLASH_CAPABILITY = (8, 0)  # flash-attn 2's floor (Ampere)
SDPA = 'request attn_implementation="sdpa"'


@dataclass(frozen=True)
class Facts:
    """What the advice may depend on (:mod:`.workload`); None / False where not recorded."""

    device: str | None = None  # "cuda" / "cpu"
    capability: tuple[int, int] | None = None
    packed_rows: bool = False
    sliding_window: bool = False
    twin_calls: bool = False

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> Facts:
        """From a recorded ``facts`` dict (checked: what is malformed is unknown)."""
        clean = workload.clean(raw or {})
        cap = clean.get(workload.CAPABILITY)
        major, _, minor = cap.partition(".") if cap else ("", "", "")
        return cls(
            device=clean.get(workload.DEVICE),
            capability=(int(major), int(minor)) if cap else None,
            packed_rows=bool(clean.get(workload.PACKED_ROWS)),
            sliding_window=bool(clean.get(workload.SLIDING_WINDOW)),
            twin_calls=bool(clean.get(workload.TWIN_CALLS)),
        )

    @property
    def gpu_below_flash(self) -> bool:
        """A GPU was seen, below flash-attn 2's sm80."""
        return (
            self.device == "cuda"
            and self.capability is not None
            and self.capability < FLASH_CAPABILITY
        )

    @property
    def flash_gpu(self) -> bool:
        """A GPU flash-attn 2 runs on was seen (sm80 or newer)."""
        return (
            self.device == "cuda"
            and self.capability is not None
            and self.capability >= FLASH_CAPABILITY
        )


Advice = str | Callable[[Facts], str]

UNKNOWN = Facts()


def render(hint: Advice, facts: Facts | None = None) -> str:
    """The sentence of ``hint`` for ``facts`` (none recorded: what holds on any machine)."""
    return hint if isinstance(hint, str) else hint(facts or UNKNOWN)


# --- the pieces ------------------------------------------------------------------------------

_PACKED = (
    "packed rows reached attnguard's twins, which hold the sequences apart as flash-attn does, "
    "and transformers' sdpa path would mix them"
)
_WINDOW = (
    "sliding windows reached attnguard's twins, which compute flash-attn's window, and "
    "transformers' sdpa path does not compute that window on every release"
)


def _why_not_sdpa(f: Facts) -> str:
    """Why sdpa would change the numbers ("" where it would not, as far as was seen)."""
    if f.packed_rows:
        return _PACKED
    if f.sliding_window:
        return _WINDOW
    return ""


def _sdpa_same(f: Facts) -> str:
    """sdpa, with why it computes the same numbers (or the condition under which it does)."""
    if f.twin_calls:
        return (
            f"{SDPA} (the same numbers: no packed rows or sliding windows reached attnguard's "
            "twins)"
        )
    return (
        f"{SDPA} if no batch packs several sequences into one row (padding-free) and the model "
        "has no sliding window (transformers' sdpa path mixes packed sequences)"
    )


def _no_flash_here(f: Facts, kernel: str = "flash-attn") -> str:
    """Why installing the kernel cannot help on this machine ("" where it could)."""
    if f.device == "cpu":
        return f"{kernel} runs on CUDA GPUs only, so there is nothing to install on this machine"
    if f.gpu_below_flash and f.capability is not None:
        major, minor = f.capability
        return (
            f"{kernel} 2 runs on sm80 (Ampere) and newer GPUs, this one is sm{major}{minor}, so "
            "there is nothing to install for it"
        )
    return ""


def flash_kernel(
    fix: str, *, never_here: str = "", on_a_gpu: bool = False, first: str = ""
) -> Callable[[Facts], str]:
    """The advice where a flash kernel could not run and the flash request was served another
    way: ``fix`` (what makes the kernel run: install, reinstall, upgrade) where this machine's
    GPU can run it, sdpa only where it computes the same numbers. ``never_here``: why no fix
    helps on this machine, where the reason code itself says so (no CUDA, a GPU too old);
    ``on_a_gpu``: the reason code itself says the kernel was tried on this GPU; ``first``: what
    to do before anything else (upgrade attnguard)."""

    def advise(f: Facts) -> str:
        why_not = _why_not_sdpa(f)
        nothing = _no_flash_here(f) or never_here
        if nothing:
            if why_not:
                said = f"{nothing}; keep the flash attn_implementation under attnguard: {why_not}"
            else:
                said = f"{nothing}: {_sdpa_same(f)}"
        else:
            where = "" if f.flash_gpu or on_a_gpu else " (on a CUDA GPU of sm80 or newer)"
            if why_not:
                said = f"{fix}{where}; not sdpa: {why_not}"
            else:
                said = f"{fix}{where}, or {_sdpa_same(f)}"
        return f"{first}; otherwise {said}" if first else said

    return advise


def no_gpu_kernel(on_gpu: str, here: str) -> Callable[[Facts], str]:
    """A CUDA-only kernel met CPU tensors: ``on_gpu`` where a GPU was seen, ``here`` on a
    machine without one, both where nothing was recorded."""

    def advise(f: Facts) -> str:
        if f.device == "cpu":
            return here
        if f.device == "cuda":
            return on_gpu
        return f"{on_gpu}; on a machine without a GPU: {here}"

    return advise


def kernel_cannot(why: str) -> Callable[[Facts], str]:
    """The kernel cannot take these calls (``why``), whatever is installed: sdpa only where it
    computes what attnguard's twins computed."""

    def advise(f: Facts) -> str:
        why_not = _why_not_sdpa(f)
        if why_not:
            return f"{why}; keep the request under attnguard: {why_not}"
        return f"{why}: {_sdpa_same(f)}"

    return advise


def diffusers_backend(f: Facts) -> str:
    """A diffusers backend whose package cannot run here."""
    native = 'model.set_attention_backend("native")'
    if f.device == "cpu":
        return (
            "the backend's kernels run on CUDA GPUs only, so there is nothing to install on this "
            f"machine: {native}"
        )
    return f"install the backend's package for this torch and GPU, or {native}"
