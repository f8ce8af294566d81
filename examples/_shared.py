"""Small helpers the examples share: tiny random models, "without attnguard" runs, and the
closing report (the events an example caused, one line each, then a machine-readable line).

Not part of attnguard's API; each example imports attnguard itself, first.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import attnguard
from attnguard import kernels
from attnguard.plan import Plan

# The exit status of an example that could not show what it is for on this machine (a package or
# a piece of hardware it needs is missing): a script or CI running it reads "not shown", never
# success (docs/examples.md)
CANNOT_SHOW = 3

# A tiny text model: the shape of Qwen2 / Llama, 2 layers of width 64 (loads in well under 1 s).
TINY_TEXT = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Qwen2.5-VL special tokens of the tiny VLM below
VL_IMAGE, VL_START, VL_END, VL_VIDEO = 122, 120, 121, 123


def load_dtype(dtype: Any) -> dict[str, Any]:
    """The load dtype as ``from_pretrained`` takes it: ``dtype=`` from transformers 4.56 (where
    ``torch_dtype=`` is deprecated), ``torch_dtype=`` before (which knows no ``dtype=``)."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}


def tiny_qwen2_5_vl_config() -> Any:
    """A tiny random Qwen2.5-VL config (flat text kwargs work on transformers 4.49 to 5.x)."""
    from transformers import Qwen2_5_VLConfig

    return Qwen2_5_VLConfig(
        **TINY_TEXT,
        rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
        image_token_id=VL_IMAGE,
        video_token_id=VL_VIDEO,
        vision_start_token_id=VL_START,
        vision_end_token_id=VL_END,
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
            window_size=16,
            fullatt_block_indexes=[1],
            tokens_per_second=2,
        ),
    )


def vl_prompt(device: Any = "cpu") -> dict[str, Any]:
    """One 16x16 image (4 merged image tokens) inside a short prompt, for the tiny VLM."""
    import torch

    gen = torch.Generator().manual_seed(0)
    ids = torch.tensor([[5, 6, VL_START] + [VL_IMAGE] * 4 + [VL_END, 7, 8]])
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "pixel_values": torch.randn(16, 3 * 2 * 4 * 4, generator=gen).to(device),
        "image_grid_thw": torch.tensor([[1, 4, 4]]).to(device),
    }


def computed_by(model: Any) -> str:
    """One line: the model's attention implementation and what computes its calls (where flash
    attention cannot run, :mod:`attnguard.kernels` sends transformers' flash path to the twins)."""
    from attnguard import kernel_identity

    impl = model.config._attn_implementation
    kernel = kernel_identity.of_request(impl)
    if kernel is None or not kernel.flash:  # what it is, not a piece of its name
        return f"attention {impl!r}: transformers' {impl} code path"
    unusable = kernels.flash_kernel_unusable(impl)
    functions = kernel.family.value if kernel.family is not None else ""
    if kernel.source is kernel_identity.Source.HUB:  # transformers' own fallback, or asked for
        if unusable is None:
            return f"attention {impl!r}: transformers' flash code path on the hub kernel"
        return (
            f"attention {impl!r}: transformers' flash code path, its kernel calls computed by "
            f"attnguard's SDPA twins of the {functions} functions (the hub kernel cannot load "
            f"here: {unusable})"
        )
    if unusable is None:
        return f"attention {impl!r}: transformers' flash code path on the flash-attn kernel"
    return (
        f"attention {impl!r}: transformers' flash code path, its kernel calls computed by "
        f"attnguard's SDPA twins of the flash-attn functions (flash-attn cannot run here: "
        f"{unusable})"
    )


class _CastNotes(logging.Handler):
    """Collects transformers' own warning that its flash path casts float32 inputs "back" to
    float32 (5.x: "Casting fp32 inputs back to torch.float32 ...", 4.x: "... We will cast back
    the input in torch.float32."), to explain it in finish()."""

    seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        _, back, target = text.partition(" back ")
        if back and "cast" in text.lower() and "torch.float32" in target:
            self.seen.append(text)


# transformers' loggers are children of "transformers": its own handler prints the line, ours
# only notes it
logging.getLogger("transformers").addHandler(_CastNotes())

CAST_NOTE = (
    "transformers' flash code path casts float32 q/k/v to the autocast dtype, else to the dtype "
    "of the layer's weights, before each flash call, and says so once. Here that dtype is "
    "float32, so the cast changes nothing. The real flash-attn kernel refuses float32 "
    '("FlashAttention only support fp16 and bf16 data type"); attnguard\'s SDPA twins compute '
    "it in float32, and on a GPU, where you chose no dtype, attnguard loads such a model in bf16 "
    "(see family_e_fp32_flash.py)."
)


def first_line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {text[:200]}"


def without_attnguard(fn: Callable[[], Any]) -> str:
    """Run ``fn`` with the guard off; returns what happened in one line."""
    was_active = attnguard.is_active()
    attnguard.deactivate()
    try:
        fn()
        return "ran without an error"
    except Exception as exc:
        return first_line(exc)
    finally:
        if was_active:
            attnguard.configure()  # back on, with the same settings


def show_plan(title: str, plan: Plan) -> list[str]:
    """Print what the real planner decided for injected facts; returns the actions' events."""
    print(f"\n[planned, not run] {title}:")
    for action in plan.actions:
        print(f"  {action.event} ({action.reason_code}): {action.reason()}")
    if not plan.actions:
        print("  nothing to change")
    return [a.event for a in plan.actions]


def finish(captured: list[dict[str, Any]], planned: list[str] | None = None) -> None:
    """A short list of the events this run caused (attnguard's own sink prints them in full on
    stderr, unless ATTNGUARD_LOG=none), then the machine-readable lines the example test reads."""
    for note in dict.fromkeys(_CastNotes.seen):
        print(f'\nNot from attnguard: transformers logged "{note}" {CAST_NOTE}')
    caused = [e for e in captured if e["event"] not in ("activated", "summary")]
    print(f"\nEvents attnguard emitted in this run ({len(caused)}):")
    for e in caused:
        print(f"  {e['event']} ({e['reason_code']}) at {e['site']}: {e['reason']}")
    print("EVENTS: " + json.dumps([e["event"] for e in caused]))
    if planned is not None:
        print("PLANNED: " + json.dumps(planned))
    sys.stdout.flush()


def cannot_show(missing: str) -> NoReturn:
    """End the example without showing what it is for, saying what is missing here, with exit
    status :data:`CANNOT_SHOW` (after its EVENTS line: nothing was caused)."""
    print(f"could not show what it is for here: {missing}")
    finish([])
    sys.exit(CANNOT_SHOW)
