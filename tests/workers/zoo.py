"""The model zoo: every architecture of the installed transformers that declares flash support,
as a tiny model built from the class's own config.

Enumerated at run time from transformers' auto mappings (so an architecture a new release adds is
in the zoo the day it ships): for every model type, one class that declares flash support
(``_supports_flash_attn``), the causal LM first, then the base model, then the first other head
(encoders, vision, audio, encoder-decoder). The config (tests/workers/zoo_configs.py) is the
config class's own defaults, shrunk where its fields allow (widths, depth, heads, experts,
vocabulary), with the fields that must agree kept in agreement (per-layer lists follow the depth,
head_dim follows the width, rope sections follow head_dim, a head's fields equal to its model's
width follow it, stage widths keep their ratios wherever a neck reads them) and the special
parameters that only matter when they bite set so they do (a sliding window shorter than the
batch, attention sinks drawn at random). A timm backbone becomes transformers' own ResNet (timm
is no test dependency); a detection model whose neck reads its backbone's stage widths from its
own fields gets its backbone whole. Classes whose forward is torch's unimplemented one
(generation-only wrappers) are left out.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from workers.zoo_configs import (  # noqa: F401 (the tiny configs, re-exported)
    MAX_PARAMETERS,
    PROFILES,
    WINDOW,
    Profile,
    _has_stage_backbone,
    tiny_config,
)
from workers.zoo_entries import Entry, entries, unimportable  # noqa: F401 (re-exported)
from workers.zoo_inputs import (  # noqa: F401 (the zoo's inputs, re-exported)
    LENGTH,
    _int,
    batches,
    input_candidates,
    main_output,
    randomise_special,
    run,
)


def build(entry: Entry, seed: int = 0) -> tuple[Any, dict[str, Any]]:
    """The smallest profile whose model builds and runs a plain batch on eager: the model and
    that batch."""
    cls = entry.cls
    errors = []
    try:
        defaults = cls.config_class().to_dict()
    except Exception:  # (a default its own validators refuse: every profile fails the same)
        defaults = {}
    for profile in PROFILES:
        if profile.whole_backbones and not _has_stage_backbone(defaults):
            continue  # (the same config as the first profile's)
        try:
            config = tiny_config(cls, profile)
            with torch.device("meta"):  # its size first, without drawing any weight
                shape = cls._from_config(config, attn_implementation="eager")
            size = sum(p.numel() for p in shape.parameters())
            if size > MAX_PARAMETERS:  # a part this shrink does not reach (conv towers, ...)
                errors.append(f"{profile.name}: still {size / 1e6:.0f}M parameters")
                continue
            torch.manual_seed(seed)
            model = cls._from_config(config, attn_implementation="eager", torch_dtype=torch.float32)
            prepare(model)
        except Exception as exc:
            errors.append(f"{profile.name}: {type(exc).__name__}: {str(exc)[:200]}")
            continue
        failed = None
        for inputs in input_candidates(model):
            try:
                run(model, inputs)
                return model, inputs
            except Exception as exc:
                failed = failed or exc
        if failed is None:  # nothing the zoo makes covers what its forward requires
            params = inspect.signature(model.forward).parameters.values()
            needs = [p.name for p in params if p.default is p.empty and p.kind <= p.KEYWORD_ONLY]
            errors.append(f"{profile.name}: no inputs: its forward requires {', '.join(needs)}")
            continue
        errors.append(f"{profile.name}: {type(failed).__name__}: {str(failed)[:200]}")
    raise NotBuilt(" | ".join(dict.fromkeys(errors)))


def prepare(model: Any) -> Any:
    """Eval mode, and what a model needs set before it runs (its language, for models with
    adapters per language)."""
    model.eval()
    languages = getattr(model.config, "languages", None)
    if languages and callable(getattr(model, "set_default_language", None)):
        model.set_default_language(list(languages)[0])
    return model


class NotBuilt(Exception):
    pass
