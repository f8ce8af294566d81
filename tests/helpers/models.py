"""Tiny real transformers models: a config of a real architecture, its class, a padded batch,
its logits, a saved checkpoint. Everything is built from these configs (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

TINY_FAMILIES = ("llama", "qwen2", "qwen2_5_vl")
# Qwen2.5-VL special tokens of the tiny recipe (ids of its tiny vocabulary)
VL_IMAGE, VL_START, VL_END, VL_VIDEO = 122, 120, 121, 123

# the text model every tiny config starts from (flat kwargs: they work on 4.49, 4.57, 5.x)
TINY_TEXT: dict[str, Any] = dict(
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
_VL_EXTRA: dict[str, Any] = dict(
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
_CLASSES = {  # family: (config class, causal LM class), names in transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLForConditionalGeneration"),
}


CLASS_DEFAULT: Any = object()  # an override that leaves the field to the config class


def tiny_config(family: str, **overrides: Any) -> Any:
    """A tiny random config of a real architecture: TINY_TEXT (and for Qwen2.5-VL a tiny vision
    tower), then ``overrides`` (CLASS_DEFAULT: not passed, the config class's own default)."""
    import transformers

    if family not in _CLASSES:
        raise ValueError(family)
    kwargs = {**TINY_TEXT, **(_VL_EXTRA if family == "qwen2_5_vl" else {}), **overrides}
    kwargs = {k: v for k, v in kwargs.items() if v is not CLASS_DEFAULT}
    return getattr(transformers, _CLASSES[family][0])(**kwargs)


def tiny_model_class(family: str) -> Any:
    import transformers

    return getattr(transformers, _CLASSES[family][1])


def save_tiny(
    path: Path, family: str = "llama", *, seed: int = 0, dtype: Any = None, **overrides: Any
) -> Path:
    """A seeded random tiny model (default attention; in ``dtype`` where given) saved at ``path``;
    ``overrides`` change its config (tiny_config)."""
    import torch

    torch.manual_seed(seed)
    model = tiny_model_class(family)(tiny_config(family, **overrides))
    if dtype is not None:
        model.to(dtype)
    model.save_pretrained(path)
    return path


# a tiny GPT-OSS: attention sinks, experts, a sliding window shorter than the test batches
GPT_OSS: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=4,
    pad_token_id=0,
)


def save_gpt_oss(path: Path, *, seed: int = 0, **overrides: Any) -> Path:
    """A seeded tiny GPT-OSS (GPT_OSS, then ``overrides``) with sinks that matter (drawn from
    N(0, 1)), saved at ``path``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**GPT_OSS, **overrides}))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 1.0)  # sinks that matter
    model.save_pretrained(path)
    return path


def tiny_inputs(family: str) -> dict[str, Any]:
    """A batch of two with left padding (and an image for the VLM)."""
    import torch

    if family != "qwen2_5_vl":
        ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
        mask = (ids != 0).long()
        return {"input_ids": ids, "attention_mask": mask}
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=gen)
    row = [5, 6, VL_START] + [VL_IMAGE] * 4 + [VL_END, 7, 8]
    ids = torch.tensor([[0, 0, *row[:-2]], row])
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "pixel_values": torch.cat([pixels, pixels]),
        "image_grid_thw": torch.cat([grid, grid]),
    }


def logits_of(model: Any, family: str) -> Any:
    import torch

    with torch.no_grad():
        return model.eval()(**tiny_inputs(family)).logits
