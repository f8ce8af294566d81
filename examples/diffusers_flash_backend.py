"""A diffusers model asked for the flash-attn backend where flash-attn is not installed (or
cannot run), and a custom attention processor handing q/k/v of mixed dtypes to diffusers.

Original: diffusers routes attention through its dispatcher; ``model.set_attention_backend("flash")``
(or ``attention_backend("flash")``, or ``DIFFUSERS_ATTN_BACKEND=flash``) on a machine without a
working flash-attn raises "Flash Attention backend 'flash' is not usable because of missing package
or the version is too old" (the environment variable is never checked: the first attention call
fails instead). Users uninstalled the setting from their scripts or installed flash-attn for the
right torch. A custom processor whose key/value come out of a float32 layer while the query is
bf16 fails in SDPA ("Expected query, key, and value to have the same dtype").

attnguard: diffusers' flash backend function keeps preparing every call (layout, causal, scale,
windows, LSE) and attnguard's twin of ``flash_attn_func`` computes it on torch's kernels, with one
``backend_fallback`` event (reason ``backend_package_unusable``); the mixed dtypes are unified
(``qkv_unified``, reason ``mixed_dtypes``). The outputs are compared with the same model on
diffusers' ``native`` backend.

Run: ``python examples/diffusers_flash_backend.py`` (needs ``pip install diffusers``; without it
the example says so and exits with status 3). GPU: not needed.
"""

from __future__ import annotations

import logging
import os

if os.environ.get("ATTNGUARD_LOG", "stderr") == "stderr":  # human-readable; log files stay JSON
    os.environ.setdefault("ATTNGUARD_LOG_FORMAT", "console")

import attnguard  # noqa: E402, F401  (importing activates the guard, before diffusers)
import torch  # noqa: E402
from _shared import cannot_show, finish, without_attnguard  # noqa: E402
from attnguard.observability import events  # noqa: E402

try:
    from diffusers import FluxTransformer2DModel
    from diffusers.models.attention_dispatch import dispatch_attention_fn
except ImportError:
    FluxTransformer2DModel = None


def tiny_flux() -> tuple[torch.nn.Module, dict]:
    """A two-block Flux transformer with random weights, and its inputs."""
    torch.manual_seed(0)
    model = FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=32,
        axes_dims_rope=(4, 6, 6),
    ).eval()
    inputs = {
        "hidden_states": torch.randn(2, 16, 8),
        "encoder_hidden_states": torch.randn(2, 8, 32),
        "pooled_projections": torch.randn(2, 32),
        "timestep": torch.ones(2),
        "img_ids": torch.zeros(16, 3),
        "txt_ids": torch.zeros(8, 3),
        "return_dict": False,
    }
    return model, inputs


def mixed_dtype_processor(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """A custom processor's call: the query in bf16, key and value still float32."""
    return dispatch_attention_fn(q.bfloat16(), k, v)


def main() -> None:
    if FluxTransformer2DModel is None:
        cannot_show("diffusers is not installed (`pip install diffusers`, or the diffusers extra)")
    logging.getLogger("diffusers").setLevel(logging.ERROR)  # "experimental feature" notices
    model, inputs = tiny_flux()
    with torch.no_grad():
        native = model(**inputs)[0]
    print("without attnguard:", without_attnguard(lambda: model.set_attention_backend("flash")))
    q, k, v = (torch.randn(2, 12, 4, 16) for _ in range(3))
    print("without attnguard:", without_attnguard(lambda: mixed_dtype_processor(q, k, v)))
    with events.capture() as captured:
        mixed = mixed_dtype_processor(q, k, v)  # on diffusers' default backend, native
        want = dispatch_attention_fn(q.bfloat16(), k.bfloat16(), v.bfloat16())
        err = (mixed.float() - want.float()).abs().max().item()
        print(f"with attnguard, mixed q/k/v: {mixed.dtype}, max difference to bf16 inputs {err}")
        print(f"MAX_ERR mixed dtypes: {err:.6f} (scale {want.abs().max().item():.3f})")
        model.set_attention_backend("flash")
        with torch.no_grad():
            out = model(**inputs)[0]
        err = (out - native).abs().max().item()
        print(
            f"with attnguard, backend 'flash': {tuple(out.shape)}, max difference to native {err}"
        )
        print(f"MAX_ERR flash vs native: {err:.6f} (scale {native.abs().max().item():.3f})")
    finish(captured)


if __name__ == "__main__":
    main()
