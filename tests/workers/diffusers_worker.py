"""A user's diffusers program: a tiny model run with the attention backend it asks for, compared
with the same model on diffusers' ``native`` backend. For tests/test_diffusers_activation.py,
tests/test_diffusers.py (the models) and tests/gpu/test_diffusers_gpu.py.

    python diffusers_worker.py [--guard import|none] [--backend B] [--model flux|unet|acestep]
                               [--device D] [--dtype T] [--diffusers-first]
                               [--how set|context|env|xformers] [--save PATH] [--hide-xformers]

``--guard import`` imports attnguard first (activation by import); ``none`` imports nothing of
attnguard (unguarded, or guarded by the start-up hook / ``attnguard run`` when those activated it
before this script). ``--diffusers-first`` imports diffusers before attnguard. ``--how`` chooses
the backend with ``model.set_attention_backend(B)`` (default), the ``attention_backend(B)``
context manager, or ``DIFFUSERS_ATTN_BACKEND`` (set by the caller; the model then runs on the
default backend, the reference with ``set_attention_backend("native")``), or
``model.enable_xformers_memory_efficient_attention()`` (``xformers``: the processors that call
``xformers.ops`` directly; ``--backend`` unused). ``--save`` writes both outputs (``{"out",
"native"}``, float32 on the CPU) with ``torch.save``, for comparisons across processes.
``--hide-xformers``: xformers as if not installed (``import xformers`` fails, diffusers'
``is_xformers_available()`` is False) on a machine that has it.

Prints one JSON line: ``{"max_diff", "equal", "error", "events", "active", "flash_attn"}`` where
``error`` is the first error's type and first line (then no diff), ``events`` every attnguard event
from the import of diffusers on (guarded runs), ``flash_attn`` where ``flash_attn`` was imported
from (None: not imported).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.processes import first_line  # noqa: E402


def tiny_flux(seed: int = 0) -> Any:
    """A two-block Flux transformer (one dual-stream, one single-stream block): attention through
    diffusers' dispatcher (``FluxAttnProcessor`` -> ``dispatch_attention_fn``)."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
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


def flux_inputs(device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    b, s, t = 2, 16, 8

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    return {
        "hidden_states": rand(b, s, 8),
        "encoder_hidden_states": rand(b, t, 32),
        "pooled_projections": rand(b, 32),
        "timestep": torch.ones(b, device=device, dtype=dtype),
        "img_ids": torch.zeros(s, 3, device=device),
        "txt_ids": torch.zeros(t, 3, device=device),
        "return_dict": False,
    }


def tiny_unet(seed: int = 0) -> Any:
    """A two-level UNet2DConditionModel with cross-attention (the Stable Diffusion shape): its
    attention processors call torch SDPA (``AttnProcessor2_0``) or, after
    ``enable_xformers_memory_efficient_attention()``, ``xformers.ops``."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=1,
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=16,
    ).eval()


def unet_inputs(device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    return {
        "sample": torch.randn(2, 4, 8, 8, generator=g).to(device, dtype),
        "timestep": torch.tensor([10, 10], device=device),
        "encoder_hidden_states": torch.randn(2, 6, 32, generator=g).to(device, dtype),
        "return_dict": False,
    }


def tiny_acestep(seed: int = 0) -> Any:
    """A two-layer ACE-Step transformer: GQA attention (4 query heads, 2 key/value heads) through
    the dispatcher with ``enable_gqa=True`` and, outside the flash backends, a 4D additive mask
    (sliding-window layers)."""
    from diffusers import AceStepTransformer1DModel

    torch.manual_seed(seed)
    return AceStepTransformer1DModel(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        in_channels=12,
        audio_acoustic_hidden_dim=6,
        patch_size=2,
        sliding_window=3,
    ).eval()


def acestep_inputs(device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    b, s = 2, 20

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device, dtype)

    return {
        "hidden_states": rand(b, s, 6),
        "timestep": torch.full((b,), 0.5, device=device, dtype=dtype),
        "timestep_r": torch.full((b,), 0.5, device=device, dtype=dtype),
        "encoder_hidden_states": rand(b, 7, 32),
        "context_latents": rand(b, s, 6),
        "return_dict": False,
    }


MODELS = {
    "flux": (tiny_flux, flux_inputs),
    "unet": (tiny_unet, unet_inputs),
    "acestep": (tiny_acestep, acestep_inputs),
}


def run(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0].float().cpu()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--guard", choices=("import", "none"), default="none")
    p.add_argument("--backend", default="flash")
    p.add_argument("--model", choices=tuple(MODELS), default="flux")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--diffusers-first", action="store_true")
    p.add_argument("--how", choices=("set", "context", "env", "xformers"), default="set")
    p.add_argument("--save", default=None)
    p.add_argument("--hide-xformers", action="store_true")
    args = p.parse_args()
    logging.disable(logging.WARNING)  # diffusers' "experimental feature" warnings
    if args.hide_xformers:  # as if not installed: import fails, find_spec answers None
        sys.modules["xformers"] = None  # type: ignore[assignment]
    if args.diffusers_first:
        import diffusers.models.attention_dispatch  # noqa: F401
    if args.guard == "import":
        import attnguard  # noqa: F401
    capture: Any = contextlib.nullcontext([])
    if "attnguard" in sys.modules:  # imported above, or by the start-up hook
        from attnguard.observability import events

        capture = events.capture()
    dtype = getattr(torch, args.dtype)
    build, make_inputs = MODELS[args.model]
    out: dict[str, Any] = {"max_diff": None, "equal": None, "error": None}
    with capture as got:
        from diffusers.models.attention_dispatch import attention_backend

        model = build().to(args.device, dtype)
        inputs = make_inputs(args.device, dtype)
        try:
            if args.how == "env":
                got_out = run(model, inputs)
                model.set_attention_backend("native")
                ref = run(model, inputs)
            else:
                ref = run(model, inputs)
                if args.how == "context":
                    with attention_backend(args.backend):
                        got_out = run(model, inputs)
                elif args.how == "xformers":
                    model.enable_xformers_memory_efficient_attention()
                    got_out = run(model, inputs)
                else:
                    model.set_attention_backend(args.backend)
                    got_out = run(model, inputs)
            out["max_diff"] = (got_out - ref).abs().max().item()
            out["equal"] = torch.equal(got_out, ref)
            if args.save:
                torch.save({"out": got_out, "native": ref}, args.save)
        except Exception as exc:
            out["error"] = first_line(exc, 200)
    out["events"] = [
        {k: e.get(k) for k in ("event", "site", "reason_code", "applied", "reason")}
        for e in got
        if e.get("event") not in ("activated", "summary")
    ]
    runtime = sys.modules.get("attnguard.runtime")
    out["active"] = bool(runtime and runtime.is_active())
    flash = sys.modules.get("flash_attn")
    out["flash_attn"] = getattr(flash, "__file__", None) if flash else None
    print(json.dumps(out))


if __name__ == "__main__":
    main()
