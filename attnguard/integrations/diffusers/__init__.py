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
versions tested are declared in :data:`SUPPORTED` and outside them nothing is patched. This module
holds only the facts attnguard's registry of integrations reads (it imports nothing, so the
registry imports it without importing the guard); :mod:`.guard` patches and unpatches.
"""

from __future__ import annotations

NAME = "diffusers"
# the module whose import triggers the patch
TRIGGER = "diffusers.models.attention_dispatch"
# the module with patch(module) / unpatch() (attnguard.runtime calls them)
PATCH_MODULE = f"{__name__}.guard"
# (distribution, lowest supported version, first unsupported version): the releases tested
SUPPORTED = ("diffusers", (0, 35), (0, 43))
