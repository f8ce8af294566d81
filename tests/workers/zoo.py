"""The model zoo: every architecture of the installed transformers that declares flash support,
as a tiny model built from the class's own config.

Enumerated at run time from transformers' auto mappings (so an architecture a new release adds is
in the zoo the day it ships): for every model type, one class that declares flash support
(``_supports_flash_attn``), the causal LM first, then the base model, then the first other head
(encoders, vision, audio, encoder-decoder). The config is the config class's own defaults, shrunk
where its fields allow (widths, depth, heads, experts, vocabulary), with the fields that must agree
kept in agreement (per-layer lists follow the depth, head_dim follows the width, rope sections
follow head_dim) and the special parameters that only matter when they bite set so they do
(a sliding window shorter than the batch, attention sinks drawn at random).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch

# ---- enumeration ------------------------------------------------------------------------------

# mapping names in the order their classes stand for a model type
_FIRST = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")


@dataclasses.dataclass(frozen=True)
class Entry:
    model_type: str
    cls_name: str
    mapping: str  # the auto mapping it was found in (CAUSAL_LM, MODEL, ...)

    @property
    def cls(self) -> Any:
        import transformers

        return getattr(transformers, self.cls_name)


def entries() -> list[Entry]:
    """One flash-declaring class per model type, sorted by model type."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = [n for n in _FIRST if hasattr(modeling_auto, n)]
    names += sorted(
        n
        for n in dir(modeling_auto)
        if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES") and n not in _FIRST
    )
    found: dict[str, Entry] = {}
    for name in names:
        mapping = getattr(modeling_auto, name)
        if not isinstance(mapping, dict):
            continue
        for model_type, classes in mapping.items():
            if model_type in found:
                continue
            for cls_name in classes if isinstance(classes, (list, tuple)) else [classes]:
                cls = getattr(transformers, cls_name, None)
                if cls is not None and _declares_flash(cls):
                    short = name.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES")
                    found[model_type] = Entry(model_type, cls_name, short)
                    break
    return [found[k] for k in sorted(found)]


def _declares_flash(cls: type) -> bool:
    for attr in ("_supports_flash_attn", "_supports_flash_attn_2"):
        value = getattr(cls, attr, None)
        if value is not None:
            return bool(value)
    return False


# ---- tiny configs -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Profile:
    """Sizes of one shrink; the zoo tries the smallest first, then ones closer to the defaults
    (some architectures fix a head_dim or a rope section in their code)."""

    name: str
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 64
    layers: int = 2
    vocab: int = 256

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


PROFILES = (
    Profile("tiny"),
    Profile("wide", heads=4, kv_heads=2, head_dim=16, ffn=128),
    Profile("head128", heads=2, kv_heads=1, head_dim=128, ffn=128),
)
WINDOW = 4  # a sliding window shorter than every test batch: it bites


def _sizes(p: Profile) -> dict[str, int]:
    w, h, hd = p.width, p.heads, p.head_dim
    sizes = dict.fromkeys(_WIDTHS, w)
    sizes.update(dict.fromkeys(_HEADS, h))
    sizes.update(dict.fromkeys(_KV_HEADS, p.kv_heads))
    sizes.update(dict.fromkeys(_HEAD_DIMS, hd))
    sizes.update(dict.fromkeys(_LAYERS, p.layers))
    sizes.update(dict.fromkeys(_FFNS, p.ffn))
    sizes.update(dict.fromkeys(_HALF_FFNS, p.ffn // 2))
    sizes.update(dict.fromkeys(_EXPERTS, 4))
    sizes.update(dict.fromkeys(_VOCABS, p.vocab))
    sizes.update(
        qk_nope_head_dim=hd,
        qk_rope_head_dim=hd,
        qk_head_dim=2 * hd,
        kv_lora_rank=2 * hd,
        q_lora_rank=2 * hd,
        rotary_dim=hd,
        mamba_n_heads=2 * h,
        mamba_num_heads=2 * h,
        n_mamba_heads=2,
        mamba_d_head=hd,
        mamba_head_dim=hd,
        mamba_d_state=8,
        ssm_state_size=8,
        mamba_chunk_size=16,
        chunk_size=16,
        mamba_dt_rank=8,
        hidden_size_per_layer_input=8,
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=2,
        conv_dim=w,
        max_source_positions=16,
        max_target_positions=64,
        num_mel_bins=16,
        n_group=1,
        topk_group=1,
        num_nextn_predict_layers=0,
        first_k_dense_replace=1,
        max_window_layers=p.layers,
        attention_hidden_size=2 * w,
        attn_layer_period=2,
        attn_layer_offset=1,
    )
    return sizes


_WIDTHS = (
    "hidden_size",
    "d_model",
    "n_embd",
    "embed_dim",
    "dim",
    "embedding_size",
    "embedding_dim",
    "word_embed_proj_dim",
    "projection_dim",
    "out_hidden_size",
    "text_hidden_size",
    "encoder_hidden_size",
    "decoder_hidden_size",
    "projector_hidden_size",
    "output_hidden_size",
    "pooler_output_size",
    "audio_hidden_size",
    "classifier_proj_size",
    "vision_hidden_size",
    "text_embed_dim",
    "vision_embed_dim",
)
_HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "linear_num_value_heads",
)
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "linear_num_key_heads")
_HEAD_DIMS = (
    "head_dim",
    "kv_channels",
    "attention_head_dim",
    "v_head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
)
_LAYERS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "encoder_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_encoder_layers",
)
_FFNS = (
    "intermediate_size",
    "ffn_dim",
    "encoder_ffn_dim",
    "decoder_ffn_dim",
    "n_inner",
    "d_ff",
    "mlp_dim",
    "ffn_hidden_size",
    "decoder_intermediate_size",
)
_HALF_FFNS = (
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "expert_intermediate_size",
)
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_VOCABS = ("vocab_size",)
# fields whose None the model cannot take (a default config not meant to be built as it is)
_FILL_NONE = ("head_dim", "vocab_size", "num_key_value_heads", "intermediate_size")
_CAPPED = {"num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "num_experts_per_token": 2}
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _is_config_dict(key: str, value: Any) -> bool:
    return isinstance(value, dict) and ("model_type" in value or key.endswith("config"))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrink(d: dict[str, Any], p: Profile) -> dict[str, Any]:
    """Shrunk copy of a config dict (sub-config dicts shrunk too)."""
    sizes = _sizes(p)
    depth = next((d[k] for k in _LAYER_COUNT_KEYS if _int(d.get(k))), None)
    out: dict[str, Any] = {}
    for key, value in d.items():
        if _is_config_dict(key, value):
            out[key] = _shrink(value, p)
        elif key in sizes and _int(value):
            out[key] = min(value, sizes[key]) if value > 0 else value
        elif key in sizes and value is None and key in _FILL_NONE:
            out[key] = sizes[key]
        elif key in _CAPPED and _int(value):
            out[key] = min(value, _CAPPED[key])
        elif isinstance(value, list) and depth and len(value) == depth and depth > p.layers:
            out[key] = _pattern(value, p.layers)  # one entry per layer
        elif isinstance(value, list) and value and all(_int(v) for v in value):
            base = next((s for s in sizes if key.startswith(s)), None)
            out[key] = [min(v, sizes[base]) for v in value] if base else value
        else:
            out[key] = value
    _agree(d, out, p)
    return out


def _agree(before: dict[str, Any], d: dict[str, Any], p: Profile) -> None:
    """Fields that must agree with the shrunk sizes."""
    heads = next((before[k] for k in _HEADS if _int(before.get(k))), None)
    for key in _KV_HEADS:  # multi-head attention (MLA, ...) stays multi-head
        if _int(before.get(key)) and before[key] == heads:
            d[key] = next(d[k] for k in _HEADS if _int(d.get(k)))
    if _int(d.get("sliding_window")) and d["sliding_window"] > 0:
        d["sliding_window"] = WINDOW
    vocab = d.get("vocab_size")
    for key, value in list(d.items()):
        if key.endswith("_token_id") and _int(vocab) and _int(value) and value >= vocab:
            d[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(key, vocab - 1)
    if _int(d.get("qk_rope_head_dim")) and _int(d.get("head_dim")):
        d["head_dim"] = d["qk_rope_head_dim"]  # MLA: rotary over the rope part only
    if _int(d.get("qk_nope_head_dim")) and _int(d.get("qk_head_dim")):
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if _int(d.get("patch_size")) and _int(d.get("image_size")):
        d["image_size"] = d["patch_size"] * 4
    if isinstance(d.get("stage_names"), list):
        n = next((d[k] for k in _LAYER_COUNT_KEYS if _int(d.get(k))), p.layers)
        d["stage_names"] = ["stem", *(f"stage{i}" for i in range(1, n + 1))]
        if d.get("out_features") is not None:
            d["out_features"] = [f"stage{n}"]
        if d.get("out_indices") is not None:
            d["out_indices"] = [n]
    for rope_key in ("rope_parameters", "rope_scaling"):
        rope = d.get(rope_key)
        ropes = rope.values() if isinstance(rope, dict) and "rope_type" not in rope else [rope]
        for r in ropes:
            if isinstance(r, dict) and isinstance(r.get("mrope_section"), list):
                head_dim = d.get("head_dim") or p.head_dim
                r["mrope_section"] = _sections(r["mrope_section"], head_dim // 2)
    if isinstance(d.get("per_layer_config"), dict):
        d["per_layer_config"] = {
            k: v for k, v in d["per_layer_config"].items() if int(k) < p.layers
        } or None


def _pattern(types: list[Any], n: int) -> list[Any]:
    """The first ``n`` per-layer entries, every distinct one kept (a hybrid stays hybrid)."""
    distinct = list(dict.fromkeys(_hashable(t) for t in types))
    if len(distinct) > n:
        keep = distinct[:n]
        return [t for t in types if _hashable(t) in keep][:n] if n else []
    head = types[:n]
    seen = {_hashable(t) for t in head}
    missing = [t for t in types if _hashable(t) not in seen and not seen.add(_hashable(t))]
    return head[: n - len(missing)] + missing


def _hashable(value: Any) -> Any:
    return repr(value)


def _sections(sections: list[int], total: int) -> list[int]:
    scale = total / max(sum(sections), 1)
    out = [max(1, int(s * scale)) for s in sections]
    out[0] += total - sum(out)
    return out


def tiny_config(cls: type, profile: Profile) -> Any:
    config_class = cls.config_class
    d = _shrink(config_class().to_dict(), profile)
    for key in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(key, None)
    return config_class.from_dict(d)


def build(entry: Entry, seed: int = 0) -> tuple[Any, Any]:
    """The smallest profile whose model builds and runs the plain batch on eager."""
    cls = entry.cls
    errors = []
    for profile in PROFILES:
        try:
            config = tiny_config(cls, profile)
            torch.manual_seed(seed)
            model = cls._from_config(config, attn_implementation="eager", torch_dtype=torch.float32)
            model.eval()
            with torch.no_grad():
                model(**plain_inputs(model, entry))
            return model, config
        except Exception as exc:
            errors.append(f"{profile.name}: {type(exc).__name__}: {str(exc)[:200]}")
    raise NotBuilt(" | ".join(errors))


class NotBuilt(Exception):
    pass


# ---- inputs -----------------------------------------------------------------------------------


def _forward_params(model: Any) -> dict[str, Any]:
    return dict(inspect.signature(model.forward).parameters)


def _find(cfg: Any, name: str) -> Any:
    """``name`` on the config or the first sub-config that has it."""
    value = getattr(cfg, name, None)
    if value is not None:
        return value
    for key in ("vision_config", "audio_config", "encoder_config", "text_config", "encoder"):
        sub = getattr(cfg, key, None)
        if sub is not None and getattr(sub, name, None) is not None:
            return getattr(sub, name)
    return None


def plain_inputs(model: Any, entry: Entry, batch: int = 2, length: int = 12) -> dict[str, Any]:
    params = _forward_params(model)
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    inputs: dict[str, Any] = {}
    if "input_ids" in params:
        text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
        vocab = getattr(text, "vocab_size", None) or 256
        inputs["input_ids"] = torch.randint(3, min(vocab, 256), (batch, length), generator=g)
    elif "pixel_values" in params:
        size = _find(cfg, "image_size") or 32
        size = size[0] if isinstance(size, (list, tuple)) else size
        if isinstance(size, dict):
            size = size.get("height", 32)
        channels = _find(cfg, "num_channels") or 3
        inputs["pixel_values"] = torch.randn(batch, channels, size, size, generator=g)
    elif "input_features" in params:
        mels = _find(cfg, "num_mel_bins") or 16
        frames = 2 * (_find(cfg, "max_source_positions") or 16)
        inputs["input_features"] = torch.randn(batch, mels, frames, generator=g)
    elif "input_values" in params:
        inputs["input_values"] = torch.randn(batch, 4000, generator=g)
    if "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = torch.randint(3, 256, (batch, length - 4), generator=g)
    return inputs


# ---- special parameters: drawn so they matter ----------------------------------------------------


def randomise_special(model: Any, seed: int = 3) -> list[str]:
    """Attention sinks (learned per-head logits) drawn from N(0, 1): with tiny random weights
    the scores are near 0, so a sink of that size moves every output. Returns what was drawn."""
    g = torch.Generator().manual_seed(seed)
    drawn = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.rsplit(".", 1)[-1] in ("sinks", "sink", "s_aux", "attention_sinks"):
                param.copy_(torch.randn(param.shape, generator=g, dtype=param.dtype))
                drawn.append(name)
    return drawn


# ---- batches ----------------------------------------------------------------------------------

LENGTH = 12
PAD = 4  # left padding of the first row of the padded batch
SEGMENTS = (5, 4, 3)  # the packed row: sequences of these lengths, positions restarting


def batches(model: Any, entry: Entry) -> dict[str, dict[str, Any]]:
    """The batches this model takes: plain always; left-padded and packed where it takes text
    with a mask / position_ids."""
    plain = plain_inputs(model, entry)
    out = {"plain": plain}
    params = _forward_params(model)
    ids = plain.get("input_ids")
    if ids is None:
        return out
    if "attention_mask" in params:
        mask = torch.ones_like(ids)
        mask[0, :PAD] = 0
        padded = dict(plain, input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask)
        out["padded"] = padded
    if "position_ids" in params and "decoder_input_ids" not in plain:
        total = sum(SEGMENTS)
        pos = torch.cat([torch.arange(n) for n in SEGMENTS]).unsqueeze(0)
        out["packed"] = {"input_ids": ids[:1, :total], "position_ids": pos}
    return out


def main_output(out: Any) -> torch.Tensor:
    for name in ("logits", "last_hidden_state", "logits_per_image", "pooler_output"):
        value = getattr(out, name, None) if not isinstance(out, dict) else out.get(name)
        if isinstance(value, torch.Tensor):
            return value
    first = out[0] if isinstance(out, (tuple, list)) else out.to_tuple()[0]
    return first


def run(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """The model's main output on ``inputs``, float64; no cache; random draws (masking noise)
    seeded the same for every run."""
    extra = {"use_cache": False} if "use_cache" in _forward_params(model) else {}
    torch.manual_seed(7)
    with torch.no_grad():
        out = main_output(model(**inputs, **extra))
    if isinstance(out, (tuple, list)):
        out = out[0]
    return out.double()
