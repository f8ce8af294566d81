"""The zoo's inputs: what each tiny model takes (tests/workers/zoo.py builds the models).

Found from the model's own forward signature and config, never from its name: text, images,
video, audio features either way round, waveforms, series, a vision tower's patches, with what
each needs next to it (grids, masks). Then the batches every check runs: the plain one, a
left-padded one and a packed row (sequences with restarting positions, no mask) where the model
takes text with a mask and positions.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

VOCAB_CAP = 256  # token ids drawn below this (and below the model's vocabulary)
WIDTH_FALLBACK = 32
LENGTH = 12


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# ---- inputs -----------------------------------------------------------------------------------


def _forward_params(model: Any) -> dict[str, Any]:
    return dict(inspect.signature(model.forward).parameters)


_SUBS = ("vision_config", "audio_config", "encoder_config", "text_config", "encoder")


def _find(cfg: Any, name: str, nested: bool = True) -> Any:
    """``name`` on the config or the first sub-config that has it (then their backbones)."""
    value = getattr(cfg, name, None)
    if value is not None:
        return value
    for key in (*_SUBS, "backbone_config"):
        sub = getattr(cfg, key, None)
        if sub is not None and getattr(sub, name, None) is not None:
            return getattr(sub, name)
    for key in _SUBS if nested else ():  # a vision tower's backbone (a segmentation model)
        sub = getattr(cfg, key, None)
        found = _find(sub, name, nested=False) if sub is not None else None
        if found is not None:
            return found
    return None


def _first_int(value: Any, default: int) -> int:
    if isinstance(value, dict):
        value = value.get("height", value.get("shortest_edge", default))
    if isinstance(value, (list, tuple)):
        value = value[0] if value else default
    return value if _int(value) and value > 0 else default


def _mel_bins(cfg: Any) -> Any:
    names = ("num_mel_bins", "feature_size", "input_feat_size")
    return next((v for v in (_find(cfg, n) for n in names) if v is not None), None)


def _image(cfg: Any, g: Any, batch: int) -> Any:
    size = _find(cfg, "image_size")
    # (a conv backbone kept whole downsamples by 32 and more)
    height = _first_int(size, 64 if getattr(cfg, "backbone_config", None) is not None else 32)
    width = size[1] if isinstance(size, (list, tuple)) and len(size) == 2 else height
    channels = _first_int(_find(cfg, "num_channels"), 3)
    return torch.randn(batch, channels, height, _first_int(width, height), generator=g)


def _patches(cfg: Any, g: Any) -> list[Any]:
    """A Qwen-VL-style vision tower's input: the 16 patches of one 4x4 grid, flattened (one or
    two frames per patch) or as small images."""
    patch = _first_int(_find(cfg, "patch_size"), 14)
    temporal = _first_int(_find(cfg, "temporal_patch_size"), 1)
    channels = _first_int(_find(cfg, "in_channels") or _find(cfg, "num_channels"), 3)
    flat = [torch.randn(16, channels * t * patch * patch, generator=g) for t in {temporal, 2, 1}]
    return [*flat, torch.randn(16, channels, patch, patch, generator=g)]


_MODALITIES = (
    "pixel_values",
    "pixel_values_videos",
    "input_features",
    "audio_mel",
    "input_values",
    "past_values",
    "latents",
    "hidden_states",
)


def _variants(name: str, cfg: Any, g: Any, batch: int) -> list[Any]:
    """The shapes a modality input may take, most common first."""
    if name in ("pixel_values", "pixel_values_videos"):
        frames = _first_int(_find(cfg, "num_frames"), 2)
        video = _image(cfg, g, batch * frames)
        video = video.view(batch, frames, *video.shape[1:])
        still = [_image(cfg, g, batch), video] if name == "pixel_values" else [video]
        return [*still, *_patches(cfg, g)]
    if name in ("input_features", "audio_mel"):
        mels = _first_int(_mel_bins(cfg), 16)
        out = []
        # (8 frames per token: audio read in step with the text, one audio step per token)
        for frames in (2 * _first_int(_find(cfg, "max_source_positions"), 16), 200, 8 * LENGTH):
            out.append(torch.randn(batch, mels, frames, generator=g))
            out.append(torch.randn(batch, frames, mels, generator=g))
        return out
    if name == "input_values":
        out = [torch.randn(batch, 3840, generator=g), torch.randn(batch, 1, 3840, generator=g)]
        mels, frames = _find(cfg, "num_mel_bins"), _find(cfg, "max_length")
        if _int(mels) and _int(frames) and frames <= 4096:  # a spectrogram of a fixed length
            out.append(torch.randn(batch, frames, mels, generator=g))
        return out
    if name == "latents":  # an audio decoder's (batch, width, frames)
        width = _first_int(_find(cfg, "hidden_size"), WIDTH_FALLBACK)
        return [torch.randn(batch, width, 8, generator=g)]
    if name == "past_values":
        length = _first_int(_find(cfg, "context_length"), 64)
        channels = _first_int(_find(cfg, "num_input_channels"), 1)
        return [torch.randn(batch, length, channels, generator=g), torch.randn(batch, length)]
    if name == "hidden_states":
        return _patches(cfg, g)
    return []


def _companions(params: dict[str, Any], cfg: Any, source: Any) -> dict[str, Any]:
    """What a modality input needs next to it: its grid, merge sizes, feature masks."""
    out: dict[str, Any] = {}
    if source is not None and source.shape[0] == 16 and source.dim() in (2, 4):  # patches
        for name in ("grid_thw", "image_grid_thw"):
            if name in params:
                out[name] = torch.tensor([[1, 4, 4]])
        if "merge_sizes" in params:
            out["merge_sizes"] = torch.tensor([_first_int(_find(cfg, "spatial_merge_size"), 1)])
    for name in ("input_features_mask", "audio_mel_mask"):
        if name in params and source is not None and source.dim() == 3:  # over the frames
            mels = _first_int(_mel_bins(cfg), 16)
            frames = source.shape[-1] if source.shape[1] == mels else source.shape[1]
            out[name] = torch.ones(source.shape[0], frames, dtype=torch.bool)
    return out


def input_candidates(model: Any, batch: int = 2, length: int = LENGTH) -> list[dict[str, Any]]:
    """Input batches this model may take, most likely first (the first one eager runs is used):
    text; then each modality input it declares (images, video, audio features either way round,
    waveforms, series, a vision tower's patches), with text where it takes both."""
    params = _forward_params(model)
    required = {n for n, p in params.items() if p.default is p.empty and p.kind != p.VAR_KEYWORD}
    required.discard("self")
    g = torch.Generator().manual_seed(1)
    cfg = model.config
    text = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    vocab = min(getattr(text, "vocab_size", None) or VOCAB_CAP, VOCAB_CAP)
    words: dict[str, Any] = {}
    if "input_ids" in params:
        words["input_ids"] = torch.randint(3, vocab, (batch, length), generator=g)
    if "qformer_input_ids" in params:
        words["qformer_input_ids"] = torch.randint(3, vocab, (batch, length), generator=g)
    if "decoder_input_ids" in params:
        words["decoder_input_ids"] = torch.randint(3, vocab, (batch, length - 4), generator=g)
    codebooks = getattr(text, "num_codebooks", None)
    if "input_ids" in words and _int(codebooks) and codebooks > 1:  # one row per codebook
        words["input_ids"] = torch.randint(3, vocab, (batch * codebooks, length), generator=g)
    out: list[dict[str, Any]] = []
    if words and not (required - set(words)):
        out.append(dict(words))
        if _int(codebooks) and codebooks > 1:  # or a text stream and the codebooks, per token
            ids = torch.randint(3, vocab, (batch, length, codebooks + 1), generator=g)
            out.append(dict(words, input_ids=ids))
    needed = [n for n in _MODALITIES if n in required]
    if len(needed) > 1:  # several inputs it cannot run without: one of each
        together: dict[str, Any] = dict(words)
        for name in needed:
            value = _variants(name, cfg, g, batch)[0]
            together.update({name: value, **_companions(params, cfg, value)})
        out.append(together)
    for name in _MODALITIES:
        if name not in params or (name == "hidden_states" and "input_ids" in params):
            continue
        for value in _variants(name, cfg, g, batch):
            alone = {name: value, **_companions(params, cfg, value)}
            with_words = {**words, **alone}
            if not words:
                out.append(alone)
            else:
                out += [with_words, alone] if "input_ids" in required else [alone, with_words]
    if "pixel_position_ids" in params:  # patches as rows, with their (x, y) on a 4x4 grid
        flat = _patches(cfg, g)[0]
        grid = torch.stack(torch.meshgrid(torch.arange(4), torch.arange(4), indexing="xy"), -1)
        out.append(
            {
                "pixel_values": flat.expand(batch, *flat.shape).clone(),
                "pixel_position_ids": grid.reshape(1, 16, 2).expand(batch, 16, 2).clone(),
            }
        )
    width = _first_int(_find(cfg, "hidden_size"), WIDTH_FALLBACK)
    given = sorted(required - {n for c in out for n in c})  # embeddings it must be given
    given = [n for n in given if n.endswith(("_embeds", "hidden_states"))]
    for name in given:
        out.append({**words, name: torch.randn(batch, length, width, generator=g)})
    if len(out) > 1:  # one of each, together (a dual encoder needs text and images)
        merged: dict[str, Any] = {}
        for c in out:
            merged.update({k: v for k, v in c.items() if k not in merged})
        out.append(merged)
    return [c for c in out if required <= set(c)] or out


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

PAD = 4  # left padding of the first row of the padded batch
SEGMENTS = (5, 4, 3)  # the packed row: sequences of these lengths, positions restarting


def batches(model: Any, plain: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The batches this model takes: ``plain`` always; left-padded and packed where it takes
    text with a mask / position_ids."""
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
