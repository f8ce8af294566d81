"""What to change in your own code, computed from what happened: the advice of a reason code.

A reason code's advice (``Reason.hint`` in :mod:`attnguard.observability.reasons`) is either a
fixed sentence, where nothing about the machine or the workload changes it, or a function of
:class:`Facts` (recorded while the program ran: :mod:`attnguard.observability.workload`):

* **the device**: where no CUDA GPU was seen, "install flash-attn for this GPU" cannot be
  followed, and is not said; the same for a GPU below what the kernel needs;
* **the workload**: where packed rows (padding-free batches: ``position_ids`` restarting,
  ``cu_seq_lens``) reached attnguard's twins of transformers' flash path in a forward where
  transformers' own sdpa path would mix them (a cache in use, or a release whose mask code does
  not hold them apart), or sliding windows did, ``attn_implementation="sdpa"`` is never advised:
  it would change the numbers. Packed rows without a cache, which transformers' own masks held
  apart, leave sdpa advised, saying so. Where no call was seen, sdpa is advised only with its
  condition spelled out;
* **the model classes**: sdpa is never advised where a model class of a flash request refuses it
  (``_supports_sdpa`` False: transformers raises at load); eager is offered, without a claim on
  its numbers, or the flash request kept under attnguard;
* **the library of the request** (from its events' sites, :meth:`Facts.for_sites`): diffusers'
  requests get diffusers' words (``set_attention_backend("native")``), never transformers'
  ``attn_implementation``;
* **the ``kernels`` package**: where a library refused the installed release, the versions it
  accepts are named, with what works where the package index has none (the index is never
  asked at run time).

A new reason code's advice is one entry: ``Reason(code, ..., hint=<a sentence, or a function of
Facts>)``; a new fact is recorded in :mod:`.workload` and read here as an attribute of
:class:`Facts`. Everything here is pure: facts in, a sentence out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from . import workload

FLASH_CAPABILITY = (8, 0)  # flash-attn 2's floor (Ampere)
SDPA = 'request attn_implementation="sdpa"'
EAGER = 'request attn_implementation="eager"'
# the libraries whose requests an event's site names (its first dotted part)
LIBRARIES = ("transformers", "diffusers", "flash_attn", "xformers")


@dataclass(frozen=True)
class Facts:
    """What the advice may depend on (:mod:`.workload`); None / False where not recorded."""

    device: str | None = None  # "cuda" / "cpu"
    capability: tuple[int, int] | None = None
    packed_rows: bool = False  # packed rows that transformers' sdpa path would mix
    packed_with_cache: bool = False  # ... because a cache was in use
    packed_rows_apart: bool = False  # packed rows without a cache: its sdpa path holds them apart
    sliding_window: bool = False
    twin_calls: bool = False
    sdpa_refused: tuple[str, ...] = ()  # model classes of flash requests that refuse sdpa
    sdpa_accepted: bool = False  # a model class of a flash request supports sdpa
    kernels_seen: bool = False  # the `kernels` package was looked at for a hub kernel
    kernels_installed: str | None = None
    kernels_accepted: tuple[tuple[str, str], ...] = ()  # (library, the versions it accepts)
    # the libraries whose requests a row of advice is for (from its events' sites; empty: any)
    libraries: frozenset[str] = frozenset()

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> Facts:
        """From a recorded ``facts`` dict (checked: what is malformed is unknown)."""
        clean = workload.clean(raw or {})
        cap = clean.get(workload.CAPABILITY)
        major, _, minor = cap.partition(".") if cap else ("", "", "")
        models = clean.get(workload.MODELS, [])
        kernels = clean.get(workload.KERNELS)
        return cls(
            device=clean.get(workload.DEVICE),
            capability=(int(major), int(minor)) if cap else None,
            packed_rows=bool(clean.get(workload.PACKED_ROWS)),
            packed_with_cache=bool(clean.get(workload.PACKED_WITH_CACHE)),
            packed_rows_apart=bool(clean.get(workload.PACKED_ROWS_APART)),
            sliding_window=bool(clean.get(workload.SLIDING_WINDOW)),
            twin_calls=bool(clean.get(workload.TWIN_CALLS)),
            sdpa_refused=_refusers(models),
            sdpa_accepted=any(m["sdpa"] for m in models if not m["part"]),
            kernels_seen=kernels is not None,
            kernels_installed=kernels["installed"] if kernels else None,
            kernels_accepted=tuple(sorted((kernels or {}).get("accepted", {}).items())),
        )

    def for_sites(self, sites: Iterable[Any]) -> Facts:
        """These facts for a row of advice whose events came from ``sites``."""
        found = {s.split(".", 1)[0] for s in sites if isinstance(s, str)}
        return replace(self, libraries=frozenset(found & set(LIBRARIES)))

    @property
    def transformers(self) -> bool:
        """The row speaks to transformers requests (or to any, where the sites are not known)."""
        return not self.libraries or "transformers" in self.libraries

    @property
    def diffusers(self) -> bool:
        return "diffusers" in self.libraries

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


def _refusers(models: list[dict[str, Any]]) -> tuple[str, ...]:
    """The model classes that refuse sdpa, as a user names them: the models they loaded, or, where
    only a part of one refuses it, that part."""
    refused = [m for m in models if not m["sdpa"]]
    whole = [m["model"] for m in refused if not m["part"]]
    return tuple(whole or [m["model"] for m in refused])


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
_PACKED_CACHE = (
    "packed rows reached attnguard's twins with a cache in use (use_cache=True, generate), which "
    "hold the sequences apart as flash-attn does; transformers' sdpa path holds packed rows apart "
    "only where no cache is in use, so it would mix them"
)
_WINDOW = (
    "sliding windows reached attnguard's twins, which compute flash-attn's window, and "
    "transformers' sdpa path does not compute that window on every release"
)
_DIFFUSERS_NATIVE = (
    "set the model's attention backend to diffusers' default, torch SDPA: "
    'pipe.transformer.set_attention_backend("native") (or attention_backend("native"))'
)


def _why_not_sdpa(f: Facts) -> str:
    """Why sdpa would change the numbers of transformers' requests ("" where it would not, as far
    as was seen)."""
    if f.packed_rows:
        return _PACKED_CACHE if f.packed_with_cache else _PACKED
    if f.sliding_window:
        return _WINDOW
    return ""


def _sdpa_same(f: Facts) -> str:
    """sdpa, with why it computes the same numbers (or the condition under which it does)."""
    if f.twin_calls and f.packed_rows_apart:
        return (
            f"{SDPA} (the same numbers: the packed rows that reached attnguard's twins came "
            "without a cache, and transformers' sdpa path holds such rows apart too; with a cache "
            "in use it would mix them)"
        )
    if f.twin_calls:
        return (
            f"{SDPA} (the same numbers: no packed rows or sliding windows reached attnguard's "
            "twins)"
        )
    return (
        f"{SDPA} if no batch packs several sequences into one row (padding-free) and the model "
        "has no sliding window (transformers' sdpa path mixes packed sequences)"
    )


def _names(names: tuple[str, ...]) -> str:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return f"{shown} {'does' if len(names) == 1 else 'do'} not support sdpa"


_EAGER_WORDS = (
    f"{EAGER} (slower; transformers' eager path does not compute its flash path's numbers for "
    "every model), or keep the flash attn_implementation under attnguard"
)


def _transformers_instead(f: Facts) -> str:
    """The backend a transformers request can ask for instead, where nothing of the workload
    keeps sdpa from computing the twins' numbers: sdpa, never for a model class that refuses it
    (``_supports_sdpa`` False: transformers raises at load)."""
    if not f.sdpa_refused:
        return _sdpa_same(f)
    refused = _names(f.sdpa_refused)
    if f.sdpa_accepted:
        return f"{_sdpa_same(f)} for the models that support it; {refused}: {_EAGER_WORDS}"
    return f"{refused}: {_EAGER_WORDS}"


def _no_flash_here(f: Facts) -> str:
    """Why installing flash-attn cannot help on this machine ("" where it could)."""
    if f.device == "cpu":
        return "flash-attn runs on CUDA GPUs only, so there is nothing to install on this machine"
    if f.gpu_below_flash and f.capability is not None:
        major, minor = f.capability
        return (
            f"flash-attn 2 runs on sm80 (Ampere) and newer GPUs, this one is sm{major}{minor}, so "
            "there is nothing to install for it"
        )
    return ""


def flash_kernel(
    fix: str | Callable[[Facts], str],
    *,
    never_here: str = "",
    on_a_gpu: bool = False,
    first: str = "",
) -> Callable[[Facts], str]:
    """The advice where a flash kernel could not run and the flash request was served another
    way: ``fix`` (what makes the kernel run: install, reinstall, upgrade; or a function of the
    facts) where this machine's GPU can run it, sdpa only where it computes the same numbers and
    the model classes support it, diffusers' own words for diffusers' requests. ``never_here``:
    why no fix helps on this machine, where the reason code itself says so (no CUDA, a GPU too
    old); ``on_a_gpu``: the reason code itself says the kernel was tried on this GPU; ``first``:
    what to do before anything else (upgrade attnguard)."""

    def advise(f: Facts) -> str:
        why_not = _why_not_sdpa(f) if f.transformers else ""
        keep = f"keep the flash attn_implementation under attnguard: {why_not}" if why_not else ""
        alternatives = []
        if f.transformers and not why_not:
            alternatives.append(_transformers_instead(f))
        if f.diffusers:
            prefix = "for diffusers: " if f.transformers else ""
            alternatives.append(prefix + _DIFFUSERS_NATIVE)
        other = "; ".join(alternatives)
        nothing = _no_flash_here(f) or never_here
        if nothing:
            said = nothing
            if keep:
                said += f"; {keep}"
            if other:
                said += f"{';' if keep else ':'} {other}"
        else:
            fixed = fix(f) if callable(fix) else fix
            where = "" if f.flash_gpu or on_a_gpu else " (on a CUDA GPU of sm80 or newer)"
            said = f"{fixed}{where}"
            if why_not:
                said += f"; not sdpa: {why_not}"
            if other:
                said += f"{';' if why_not else ', or'} {other}"
        return f"{first}; otherwise {said}" if first else said

    return advise


def _windows(f: Facts) -> list[tuple[str, str]]:
    """(library, the `kernels` versions it accepts) for the libraries of this row."""
    return [
        (lib, spec) for lib, spec in f.kernels_accepted if not f.libraries or lib in f.libraries
    ]


def _libraries(f: Facts) -> str:
    hub = [lib for lib in ("transformers", "diffusers") if lib in f.libraries]
    return " / ".join(hub) or "transformers / diffusers"


def hub_package_missing(f: Facts) -> str:
    """No `kernels` package: install one the library accepts (its window, where recorded)."""
    windows = _windows(f)
    if not windows:
        return (
            f"install the `kernels` package at a version your {_libraries(f)} accepts, or "
            "flash-attn, for this torch and GPU"
        )
    wanted = "; ".join(f"kernels{spec} ({lib} accepts only these)" for lib, spec in windows)
    return (
        f"install {wanted} if your package index has such a release, or flash-attn, for this "
        "torch and GPU"
    )


def hub_package_refused(f: Facts) -> str:
    """A `kernels` release the library refuses: its window, and what works where pip cannot give
    a release in it (the index is not asked at run time: it may have none)."""
    windows = _windows(f)
    if not windows or not f.kernels_installed:
        return (
            "install a `kernels` version the library accepts (the event names the range), or "
            "flash-attn for this torch and GPU"
        )
    said = "; ".join(f"{lib} accepts only kernels{spec}" for lib, spec in windows)
    wanted = " / ".join(f"kernels{spec}" for _lib, spec in windows)
    libraries = " / ".join(lib for lib, _spec in windows)
    return (
        f"`kernels` {f.kernels_installed} is installed and {said}: install {wanted} if your "
        f"package index has such a release; otherwise use a {libraries} release that accepts a "
        "`kernels` your index has, or install flash-attn for this torch and GPU"
    )


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


_DIRECT = (
    "attnguard's twin computes these calls (without it: "
    "torch.nn.functional.scaled_dot_product_attention in your attention code)"
)


def kernel_cannot(why: str) -> Callable[[Facts], str]:
    """The kernel cannot take these calls (``why``), whatever is installed: sdpa only where it
    computes what attnguard's twins computed and the model classes support it; diffusers' calls
    get diffusers' words; a program's own calls of flash-attn / xformers functions are told what
    computes them."""

    def advise(f: Facts) -> str:
        if not f.transformers:  # diffusers' calls, or the program's own kernel calls
            return f"{why}: {_DIFFUSERS_NATIVE if f.diffusers else _DIRECT}"
        why_not = _why_not_sdpa(f)
        if why_not:
            return f"{why}; keep the request under attnguard: {why_not}"
        return f"{why}: {_transformers_instead(f)}"

    return advise


def diffusers_backend(f: Facts) -> str:
    """A diffusers backend whose package cannot run here."""
    if f.device == "cpu":
        return (
            "the backend's kernels run on CUDA GPUs only, so there is nothing to install on this "
            f"machine: {_DIFFUSERS_NATIVE}"
        )
    if f.device == "cuda":
        return f"install the backend's package for this torch and GPU, or {_DIFFUSERS_NATIVE}"
    return f"install the backend's package on a machine with a CUDA GPU, or {_DIFFUSERS_NATIVE}"
