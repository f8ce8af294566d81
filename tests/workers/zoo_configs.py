"""The zoo's tiny configs (tests/workers/zoo.py builds the models from them): the config class's
own defaults, shrunk where its fields allow (widths, depth, heads, experts, vocabulary), with the
fields that must agree kept in agreement (per-layer lists follow the depth, head_dim follows the
width, rope sections follow head_dim, a head's fields equal to its model's width follow it, stage
widths keep their ratios wherever a neck reads them), large images scaled down, and the special
parameters that only matter when they bite set so they do (a sliding window shorter than the
batch). A timm backbone becomes transformers' own ResNet (timm is no test dependency); a
detection model whose neck reads its backbone's stage widths from its own fields gets its
backbone whole. Profiles from the smallest up: zoo.build takes the first that builds and runs.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

from workers.zoo_inputs import _int

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
    mrope: bool = False
    whole_backbones: bool = False  # conv backbones (stages, not layers) kept as they are

    @property
    def width(self) -> int:
        return self.heads * self.head_dim


PROFILES = (
    Profile("tiny"),
    Profile("wide", heads=4, kv_heads=2, head_dim=16, ffn=128),
    Profile("head128", heads=2, kv_heads=1, head_dim=128, ffn=128),
    Profile("mrope", mrope=True),  # rope sections its code defaults for a larger head_dim
    # a detection model whose neck reads its backbone's stage widths from fields of its own
    Profile("backbone", whole_backbones=True),
)
WINDOW = 4  # a sliding window shorter than every test batch: it bites
MAX_PARAMETERS = 100_000_000  # a "tiny" model above this is not tiny: CI time, disk, memory


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
        mamba_d_ssm=2 * h * hd,  # (mamba heads x their width)
        mamba_head_dim=hd,
        mamba_headdim=w,  # (mamba_expand x width / n_mamba_heads)
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
        num_expert_group=1,
        n_shared_experts=1,
        num_experts_per_tok=2,
        num_nextn_predict_layers=0,
        first_k_dense_replace=1,
        max_window_layers=p.layers,
        attention_hidden_size=2 * w,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_filters=4,  # conv towers that double their filters per stage
        num_windows=4,  # windows per image (a square): a tiny image has few patches
        num_windows_side=2,
        num_queries=8,  # object queries: top-k of the (few) feature tokens of a tiny image
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
    "fpn_hidden_size",
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
_KV_HEADS = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "linear_num_key_heads",
    "num_query_groups",
)
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
_FILL_NONE = (
    "head_dim",
    "vocab_size",
    "num_key_value_heads",
    "intermediate_size",
    "num_experts_per_tok",
    "n_routed_experts",
    "n_shared_experts",
    "n_group",
    "topk_group",
)
_CAPPED = {
    "num_experts_per_tok": 2,
    "moe_topk": 2,
    "num_experts_per_token": 2,
    "moe_k": 2,
    "moe_top_k": 2,
}  # (not "top_k": a generation parameter in older configs)
_LAYER_COUNT_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")


def _is_config_dict(key: str, value: Any) -> bool:
    return isinstance(value, dict) and ("model_type" in value or key.endswith("config"))


def _shrink(
    d: dict[str, Any],
    p: Profile,
    outer: frozenset[int] = frozenset(),
    stages: dict[int, int] | None = None,
) -> dict[str, Any]:
    """Shrunk copy of a config dict (sub-config dicts shrunk too). ``outer``: the widths of the
    configs it is part of (a head's ``condition_dim`` is its model's width); ``stages``: the
    stage widths of a backbone anywhere in the model, old -> new (a neck's channel list)."""
    sizes = _sizes(p)
    stages = _stage_widths(d, p) if stages is None else stages
    depth = next((d[k] for k in _LAYER_COUNT_KEYS if _int(d.get(k))), None)
    width = next((d[k] for k in _WIDTHS if _int(d.get(k))), None)
    widths = outer | {width} if width and width >= 64 else outer
    ffn = next((d[k] for k in _FFNS if _int(d.get(k))), None)
    if p.whole_backbones and _is_stage_backbone(d, depth):  # stages feed a neck sized for them
        return dict(d)
    out: dict[str, Any] = {}
    for key, value in d.items():
        if _is_config_dict(key, value) and value.get("model_type") == "timm_backbone":
            out[key] = _without_timm(value)
        elif _is_config_dict(key, value):
            out[key] = _shrink(value, p, widths, stages)
        elif key in sizes and _int(value):
            out[key] = min(value, sizes[key]) if value > 0 else value
        elif key in sizes and value is None and key in _FILL_NONE:
            out[key] = sizes[key]
        elif key == "pad_token_id" and value is None and "vocab_size" in d:
            out[key] = 0  # (a model may count positions from its padding token)
        elif key in _CAPPED and _int(value):
            out[key] = min(value, _CAPPED[key])
        elif _int(value) and value in widths:
            out[key] = p.width  # another name for a width (groups, codebook dims, ...)
        elif _int(value) and ffn and ffn >= 128 and value == ffn:
            out[key] = p.ffn
        elif isinstance(value, list) and depth and len(value) == depth and depth > p.layers:
            out[key] = _pattern(value, p.layers)  # one entry per layer
            base = next((s for s in sizes if key.startswith(s)), None)  # heads per layer, ...
            if base and all(_int(v) for v in value):
                out[key] = [min(v, sizes[base]) for v in out[key]]
        elif _repeated_pattern(value, depth):  # [[["global", "local"], 12]]: one repeat
            out[key] = [[value[0][0], max(1, p.layers // max(1, len(value[0][0])))]]
        elif _layer_indices(key, value, depth):
            kept = [v for v in value if v < p.layers]
            out[key] = kept or [p.layers - 1]
        elif isinstance(value, list) and value and all(_int(v) for v in value):
            base = next((s for s in sizes if key.startswith(s)), None)
            if _widens(key, value):  # widths per stage: ratios kept (a stage that widens pools)
                out[key] = [stages[v] for v in value]
            elif base:
                out[key] = [min(v, sizes[base]) for v in value]
            elif all(v in stages for v in value):  # the stage widths, as a neck reads them
                out[key] = [stages[v] for v in value]
            elif width and width >= 64:  # per-level widths ([256, 256, 256]) follow the width
                out[key] = [p.width if v == width else v for v in value]
            else:
                out[key] = value
        else:
            out[key] = value
    _agree(d, out, p)
    return out


def _has_stage_backbone(d: dict[str, Any]) -> bool:
    return any(
        _is_config_dict(k, v) and (_is_stage_backbone(v, _depth(v)) or _has_stage_backbone(v))
        for k, v in d.items()
    )


def _depth(d: dict[str, Any]) -> int | None:
    return next((d[k] for k in _LAYER_COUNT_KEYS if _int(d.get(k))), None)


def _widens(key: str, value: Any) -> bool:
    """Widths per stage that grow (``hidden_sizes``: [256, 512, 1024, 2048])."""
    ints = isinstance(value, list) and len(value) > 1 and all(_int(v) and v > 0 for v in value)
    named = any(str(key).startswith(w) for w in _WIDTHS)
    return ints and named and value == sorted(value) and value[0] < value[-1]


def _stage_widths(d: dict[str, Any], p: Profile) -> dict[int, int]:
    """Old -> new for every stage width in the model: the first stage gets the profile's width,
    the others keep their ratio to it."""
    out: dict[int, int] = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_stage_widths(value, p))
        elif _widens(key, value):
            out.update({v: max(1, v * p.width // value[0]) for v in value})
    return out


def _is_stage_backbone(d: dict[str, Any], depth: int | None) -> bool:
    """A backbone whose outputs are stages (ResNet, HGNet, ...), not one per layer: the model on
    top reads its stage widths from other fields (``encoder_in_channels``), so it is not shrunk
    (such backbones are small)."""
    stages = d.get("stage_names")
    return isinstance(stages, list) and len(stages) - 1 != depth


def _without_timm(d: dict[str, Any]) -> dict[str, Any]:
    """A timm backbone (timm is no test dependency) becomes transformers' own ResNet with the
    same output stages: what the model on top reads from it is the stage widths."""
    resnet = {"model_type": "resnet", "num_channels": d.get("num_channels", 3)}
    if isinstance(d.get("out_indices"), list):
        resnet["out_indices"] = d["out_indices"]
    return resnet


def _repeated_pattern(value: Any, depth: int | None) -> bool:
    """Layer types given as [[pattern, repeats], ...] expanding to one per layer."""
    if not (isinstance(value, list) and value and depth):
        return False
    pairs = [v for v in value if isinstance(v, list) and len(v) == 2 and _int(v[1])]
    if len(pairs) != len(value) or not all(isinstance(v[0], list) for v in pairs):
        return False
    return sum(len(v[0]) * v[1] for v in pairs) == depth


def _layer_indices(key: str, value: Any, depth: int | None) -> bool:
    """A list of layer numbers (which layers are attention, full, global, ...)."""
    if not (isinstance(value, list) and value and all(_int(v) for v in value) and depth):
        return False
    named = any(w in key for w in ("indices", "indexes", "idxs", "_ids", "layers"))
    return named and "layer" in key or (named and max(value) < depth and "block" in key)


def _agree(before: dict[str, Any], d: dict[str, Any], p: Profile) -> None:
    """Fields that must agree with the shrunk sizes."""
    heads = next((before[k] for k in _HEADS if _int(before.get(k))), None)
    for key in _KV_HEADS:  # multi-head attention (MLA, ...) stays multi-head
        if _int(before.get(key)) and before[key] == heads:
            d[key] = next(d[k] for k in _HEADS if _int(d.get(k)))
    if "num_attention_heads" in d and not any(k in before for k in _KV_HEADS):
        # a default without the field its attention reads (as many as the heads)
        d["num_key_value_heads"] = d["num_attention_heads"]
    if _int(d.get("sliding_window")) and d["sliding_window"] > 0:
        d["sliding_window"] = WINDOW
    text = d.get("text_config")  # (a composite's special tokens index its text vocabulary)
    vocab = d.get("vocab_size") or (text.get("vocab_size") if isinstance(text, dict) else None)
    for key, value in list(d.items()):
        special = key.endswith(("_token_id", "_token_index"))
        if special and _int(vocab) and _int(value) and value >= vocab:
            d[key] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}.get(key, vocab - 1)
    attention = [before.get(k) for k in ("attention_hidden_size", "attention_head_dim")]
    if heads and all(_int(v) for v in attention) and attention[0] == heads * attention[1]:
        d["attention_head_dim"] = d["attention_hidden_size"] // _heads_of(d)
    if _int(d.get("qk_nope_head_dim")) and _int(d.get("qk_head_dim")):
        d["qk_head_dim"] = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    if _int(d.get("qk_rope_head_dim")) and _int(d.get("head_dim")):
        # MLA: head_dim is the rope part (rotary over it), or the whole query head (with a
        # partial rotary factor), as in the defaults
        whole = before.get("head_dim") == before.get("qk_head_dim") != before["qk_rope_head_dim"]
        d["head_dim"] = d["qk_head_dim"] if whole else d["qk_rope_head_dim"]
    if _int(d.get("patch_size")) and _int(d.get("image_size")) and d["image_size"] != IMAGE:
        d["image_size"] = d["patch_size"] * 4  # (IMAGE: scaled with the sizes that follow it)
    patch, image = d.get("patch_size"), d.get("image_size")
    if _ints(patch, 2) and _ints(image, 2):  # (height, width)
        d["image_size"] = [patch[0] * 4, patch[1] * 4]
    tubelet = d.get("tubelet_size")  # video: [frames, height, width] per patch, or frames
    if isinstance(tubelet, list) and len(tubelet) == 3 and _int(d.get("image_size")):
        d["image_size"] = tubelet[1] * 4
    if _int(d.get("num_frames")):
        frames = tubelet[0] if isinstance(tubelet, list) and tubelet else tubelet
        d["num_frames"] = max(2, frames if _int(frames) else 1)
    lengths = {len(v) for v in d.values() if isinstance(v, list)}
    for key, value in list(d.items()):  # num_spatial_layers, num_temporal_layers, ...
        counted = key.startswith("num_") and key.endswith("_layers") and _int(value)
        depth = next((before[k] for k in _LAYER_COUNT_KEYS if _int(before.get(k))), None)
        if counted and "shared" in key and depth and 0 < value < depth:  # a share of the depth
            d[key] = value * p.layers // depth
        elif counted and value > p.layers and value not in lengths:  # (not one per list entry)
            d[key] = p.layers
    types = d.get("layer_types")
    if d.get("rope_parameters") == {} and isinstance(types, list) and types:
        # a default without rope parameters where the model reads them per layer type
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        d["rope_parameters"] = {t: dict(rope) for t in types if isinstance(t, str)}
    if isinstance(d.get("stage_names"), list):  # a shrunk backbone's stages
        count = next((k for k in _LAYER_COUNT_KEYS if _int(d.get(k))), None)
        n = d[count] if count else p.layers
        outs = before.get("out_indices") or before.get("out_features") or []
        if count and len(outs) > n:  # as many layers as outputs: a neck reads each
            n = d[count] = len(outs)
        kept = min(max(1, len(outs)), n) if count else 1
        last = [f"stage{i}" for i in range(n - kept + 1, n + 1)]
        d["stage_names"] = ["stem", *(f"stage{i}" for i in range(1, n + 1))]
        if d.get("out_features") is not None:
            d["out_features"] = last
        if d.get("out_indices") is not None:
            d["out_indices"] = [int(name.removeprefix("stage")) for name in last]
    for rope_key in ("rope_parameters", "rope_scaling"):
        rope = d.get(rope_key)
        ropes = rope.values() if isinstance(rope, dict) and "rope_type" not in rope else [rope]
        for r in ropes:
            if isinstance(r, dict) and isinstance(r.get("mrope_section"), list):
                head_dim = d.get("head_dim") or p.head_dim
                r["mrope_section"] = _sections(r["mrope_section"], head_dim // 2)
    overrides = before.get("per_layer_config")  # {layer: {"head_dim": 512, ...}}
    if isinstance(overrides, dict) and overrides:
        kept = {k: v for k, v in overrides.items() if int(k) < p.layers}
        if not kept:  # the overrides of the last layer (a global-attention layer), on the last
            last = list(overrides)[-1]
            kept = {type(last)(p.layers - 1): overrides[last]}
        # shrunk like the config, and never None (a config then derives its own at load)
        d["per_layer_config"] = {
            k: _shrink(v, p) if isinstance(v, dict) else v for k, v in kept.items()
        }


def _ints(value: Any, n: int) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == n and all(_int(v) for v in value)


def _heads_of(d: dict[str, Any]) -> int:
    return next(d[k] for k in _HEADS if _int(d.get(k)))


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
    d = _shrink(_smaller_images(config_class().to_dict()), profile)
    for key in ("transformers_version", "architectures", "_name_or_path"):
        d.pop(key, None)
    if profile.mrope or _uses_mrope(cls):
        _add_mrope(d, profile)
    return config_class.from_dict(d)


IMAGE = 128  # the side of a large image given as (height, width), scaled down to this


def _smaller_images(d: dict[str, Any]) -> dict[str, Any]:
    """A model whose images are given as (height, width) with no patch size next to them (a
    segmentation backbone: 1024 x 1024) sees them scaled to IMAGE, and every size that follows
    the image with them: other ``image_size`` fields, feature map sizes (``[[256, 256], ...]``).
    Where a patch size stands next to the image (a ViT backbone: shrunk to four patches a side
    by ``_agree``), the feature map sizes follow it the same way."""
    sides = set()
    patched = set()  # (image side, its side when shrunk)

    def find(x: dict[str, Any]) -> None:
        for key, value in x.items():
            if isinstance(value, dict):
                find(value)
            elif key == "image_size" and _ints(value, 2) and "patch_size" not in x:
                sides.add(value[0])
            elif key == "image_size" and _int(value) and _int(x.get("patch_size")):
                patched.add((value, x["patch_size"] * 4))

    find(d)
    side = max(sides, default=0)
    if side >= 4 * IMAGE and not side % IMAGE:
        factor = side // IMAGE
    elif not sides and len(patched) == 1 and not next(iter(patched))[0] % next(iter(patched))[1]:
        ((side, shrunk),) = patched
        factor = side // shrunk
        side = -1  # (image sizes are _agree's to set)
    else:
        return d

    def scale(x: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in x.items():
            if isinstance(value, dict):
                out[key] = scale(value)
            elif key == "image_size" and value == side:
                out[key] = IMAGE
            elif key == "image_size" and _ints(value, 2) and value[0] == side:
                out[key] = [v // factor for v in value]
            elif str(key).endswith("feature_sizes") and isinstance(value, list):
                out[key] = [[v // factor for v in f] if isinstance(f, list) else f // factor
                            for f in value]  # fmt: skip
            else:
                out[key] = value
        return out

    return scale(d)


def _uses_mrope(cls: type) -> bool:
    """The model's code reads multimodal rope sections (with a default sized for its own
    head_dim when the config has none)."""
    module = inspect.getmodule(cls)
    try:
        return module is not None and "mrope_section" in inspect.getsource(module)
    except (OSError, TypeError):
        return False


def _add_mrope(d: dict[str, Any], p: Profile) -> None:
    """Rope sections that fit the shrunk head_dim, in every (sub-)config with rope parameters."""
    for key, value in d.items():
        if _is_config_dict(key, value):
            _add_mrope(value, p)
    rope = d.get("rope_parameters")
    if not isinstance(rope, dict) or "rope_type" not in rope or "mrope_section" in rope:
        return
    heads = next((d[k] for k in _HEADS if _int(d.get(k))), p.heads)
    width = next((d[k] for k in _WIDTHS if _int(d.get(k))), p.width)
    head_dim = d.get("head_dim") if _int(d.get("head_dim")) else width // heads
    partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor")) or 1.0
    total = int(head_dim * partial) // 2  # (equal sections: some code pairs two of them)
    rope["mrope_section"] = [total // 3, total // 3, total - 2 * (total // 3)]
