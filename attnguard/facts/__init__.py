"""What this runtime offers: GPUs, native bf16, which attention backends can really run, and the
launch / deliberate-init context a model is being built in.

:class:`Facts` is a frozen dataclass, so tests (and ``attnguard doctor``) can inject facts for a
machine they are not on (:func:`synthetic`). For this process (:func:`current`) nothing is read at
activation: the GPUs are read the first time a decision needs them, and each backend is probed the
first time a decision asks for *that* backend (a plain sdpa load probes nothing; a flash request
probes flash-attn only; xformers is probed by ``attnguard doctor`` alone). Results are cached; the
context parts (launcher variables, ZeRO-3 / FSDP / meta-device init, a ``torch.device`` block) are
re-read on every call because they change at run time.

A backend is judged by what it does, not by what transformers' availability check says:
transformers reads package metadata and never imports the CUDA extension or checks the compute
capability, so a broken install or a V100 passes loading and fails at the first attention call.
Here the extension is really imported and, on a GPU, a tiny call is made (with the original
function: any attnguard wrapper is unwrapped first). Importing a native extension can crash the
process if the extension is broken badly enough: the probe only runs where the program itself is
about to use that library, and ``ATTNGUARD_DISABLE=flash_attn`` turns it off (flash-attn is then
judged by its package metadata alone, as transformers does).
"""

from __future__ import annotations

from .backends import (
    BACKENDS,
    CAPABILITY_FLOOR,
    CAPABILITY_TOO_LOW,
    EXTENSION_BROKEN,
    FLASH_BACKENDS,
    NO_CUDA,
    OK,
    PACKAGE_MISSING,
    PROBE_FAILED,
    TORCH_TOO_OLD,
    VERSION_TOO_OLD,
    Backend,
    Backends,
    PackageState,
    assess_backend,
    canonical_backend,
    dist_version,
    first_line,
    flash2_version_floor,
    package_state,
    probe_package,
)
from .context import (
    InitContext,
    Launch,
    fsdp_enabled,
    init_context_now,
    is_quantized_load,
    launch_now,
    training_script,
    zero3_enabled,
)
from .hardware import GPU, NATIVE_BF16_FLOOR, Hardware
from .machine import Facts, current, reset
from .synthetic import synthetic

__all__ = [
    "BACKENDS",
    "Backend",
    "Backends",
    "CAPABILITY_FLOOR",
    "CAPABILITY_TOO_LOW",
    "EXTENSION_BROKEN",
    "FLASH_BACKENDS",
    "Facts",
    "GPU",
    "Hardware",
    "InitContext",
    "Launch",
    "NATIVE_BF16_FLOOR",
    "NO_CUDA",
    "OK",
    "PACKAGE_MISSING",
    "PROBE_FAILED",
    "PackageState",
    "TORCH_TOO_OLD",
    "VERSION_TOO_OLD",
    "assess_backend",
    "canonical_backend",
    "current",
    "dist_version",
    "first_line",
    "flash2_version_floor",
    "fsdp_enabled",
    "init_context_now",
    "is_quantized_load",
    "launch_now",
    "package_state",
    "probe_package",
    "reset",
    "synthetic",
    "training_script",
    "zero3_enabled",
]
