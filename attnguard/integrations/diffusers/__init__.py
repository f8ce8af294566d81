"""The diffusers integration: attention through ``diffusers.models.attention_dispatch``.

diffusers computes attention through one dispatcher: a registry of backend functions
(``_AttentionBackendRegistry._backends``, keyed by ``AttentionBackendName``), chosen by
``model.set_attention_backend(name)``, the ``attention_backend(name)`` context manager or
``DIFFUSERS_ATTN_BACKEND``, and a requirements check (``_check_attention_backend_requirements``)
that raises ``RuntimeError`` when the backend's package cannot be used. Patched when
``diffusers.models.attention_dispatch`` is imported:

* the requirements check (:mod:`.backends`): a ``flash`` / ``flash_varlen`` / ``xformers`` backend
  whose package diffusers cannot use here (not installed, fails to import, too old) runs on
  attnguard's twins of that package's functions, put where the backend function calls them; one
  ``backend_fallback`` event says so. diffusers' own backend function still prepares every call
  (masks, causal, scale, GQA, packed rows, windows, LSE), so the twin computes what the kernel would
  have. A backend attnguard has no twin for keeps diffusers' error, with one ``observed`` event;
* the backend functions (:mod:`.calls`): mixed q/k/v dtypes and devices are unified before the
  call (``qkv_unified``, ``tensors_aligned``); a torch backend forced to one SDPA kernel that has
  no kernel for the call ("No available kernel": float32 into ``_native_flash``, ``_native_cudnn``
  on a CPU) is re-run with SDPA free to choose (``kernel_error_recovered``);
* the kernels themselves are flash-attn's and xformers' functions: when those packages work,
  their own integrations guard every call diffusers makes (CPU tensors, float32 into a half-only
  kernel, "No operator found").

Recognised by the dispatcher's shape (:mod:`.shape`), whatever the version number says; the
versions tested are declared in :data:`INTEGRATION` and outside them nothing is patched. This
module holds only the declaration attnguard's registry of integrations reads (light: no torch, no
diffusers), :mod:`.guard` patches and unpatches.
"""

from __future__ import annotations

from ..protocol import LibraryIntegration, Part

# the versions tested; the module whose import triggers the patch; guard.patch / guard.unpatch.
# After flash_attn and xformers in the registry: it binds their guarded functions where diffusers
# imported the originals.
INTEGRATION = LibraryIntegration(
    name="diffusers",
    distribution="diffusers",
    package="diffusers",
    low=(0, 35),
    high=(0, 43),
    parts=(
        Part(
            module="attnguard.integrations.diffusers.guard",
            trigger="diffusers.models.attention_dispatch",
        ),
        # enable_xformers_memory_efficient_attention() where xformers is missing
        Part(
            module="attnguard.integrations.diffusers.enable_xformers",
            trigger="diffusers.models.attention_processor",
        ),
        Part(
            module="attnguard.integrations.diffusers.enable_xformers_mixin",
            trigger="diffusers.models.attention",
        ),
    ),
)
