"""Tiny real models through transformers' flash_attention_2 code path, on one kernel, for
tests/gpu/test_semantics_gpu.py.

    python semantics_worker.py make ROOT                     # the four checkpoints
    python semantics_worker.py run {real|twins} ROOT OUT_FILE [--device cuda:0]

``make`` saves seeded float32 checkpoints of Llama, Qwen2, Mistral (sliding_window=4) and Gemma 2
(head_dim 16, sliding_window 4, attn_logit_softcapping 5.0). tests/test_flash_semantics.py
imports ``config`` and ``make`` from here, so the CPU and GPU comparisons use the same models.

``run`` loads each with ``from_pretrained(path, attn_implementation="flash_attention_2",
dtype=torch.bfloat16, device_map=DEVICE)`` and records logits and generated tokens for:

* a packed row (lengths 7/12/5, position_ids restarting at 0, no mask), with ``use_cache`` False
  and True, and each of its sequences alone;
* a left-padded batch (``use_cache`` False and True);
* greedy ``generate`` of 8 tokens with the cache from a left-padded batch (tokens and scores).

``real``: the real flash-attn kernel, unguarded (the worker checks that ``flash_attn`` is the real
package with its CUDA extension and never imports attnguard). ``twins``: flash-attn absent (the
worker checks it cannot be imported), ``import attnguard`` first: transformers' flash code path
with its kernel calls computed by attnguard's SDPA twins; the events attnguard emitted are
recorded. OUT_FILE is a ``torch.save`` dict ``{"meta": ..., "families": {family: {...}}}``;
tensors are float32 on the CPU. ``--device cpu`` runs the twins mode on a machine without a GPU
(a dry run of this worker and of the comparison).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.models import tiny_config  # noqa: E402

FLASH = "flash_attention_2"
WINDOW = 4
FAMILIES = ("llama", "qwen2", "mistral", "gemma2")
LENGTHS = (7, 12, 5)
NEW_TOKENS = 8


def flash_window_left(sliding_window: int) -> int:
    """The left edge of the window_size transformers' flash path gives flash-attn for
    ``sliding_window``, on the releases we tested: ``(w, w)`` up to 4.55, ``(w - 1, w - 1)`` from
    4.56 on. A newer release is expected to keep the newest convention; one that changes it fails
    the tests that use this (and gets a row here) -- attnguard itself reads it from the module."""
    import re

    import transformers

    numbers = tuple(int(n) for n in re.findall(r"\d+", transformers.__version__)[:2])
    return sliding_window if numbers < (4, 56) else sliding_window - 1


def config(family: str) -> Any:
    extra: dict[str, dict[str, Any]] = {
        "mistral": dict(sliding_window=WINDOW),
        "gemma2": dict(
            head_dim=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=None,
            query_pre_attn_scalar=16,
        ),
    }
    if family not in FAMILIES:
        raise ValueError(family)
    return tiny_config(family, max_position_embeddings=256, **extra.get(family, {}))


def make(root: Path) -> None:
    import torch
    import transformers

    for family in FAMILIES:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(family))
        model.save_pretrained(root / family)


# --- inputs (seeded CPU generators: the same in every process) ---------------------------------


def packed_row() -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 128, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, pos


def left_padded(seed: int, rows: int, width: int, pads: dict[int, int]) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (rows, width), generator=g)
    mask = torch.ones_like(ids)
    for row, n in pads.items():
        mask[row, :n] = 0
    ids[mask == 0] = 0
    return ids, mask


def padded_batch() -> tuple[Any, Any]:
    return left_padded(1, 3, 14, {0: 5, 2: 2})


def generate_prompt() -> tuple[Any, Any]:
    return left_padded(2, 2, 9, {1: 3})


# --- one model ------------------------------------------------------------------------------------


def run_family(path: Path, device: str) -> dict[str, Any]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=FLASH, dtype=torch.bfloat16, device_map=device
    ).eval()
    p = next(model.parameters())
    rec: dict[str, Any] = {
        "attn_implementation": model.config._attn_implementation,
        "param_dtype": str(p.dtype),
        "param_device": str(p.device),
    }

    def logits(**inputs: Any) -> Any:
        with torch.no_grad():
            moved = {k: v.to(device) if hasattr(v, "to") else v for k, v in inputs.items()}
            return model(**moved).logits.float().cpu()

    ids, pos = packed_row()
    rec["packed_ids"] = ids
    for use_cache in (False, True):
        rec[f"packed_cache_{use_cache}"] = logits(
            input_ids=ids, position_ids=pos, use_cache=use_cache
        )
    start, alone = 0, []
    for n in LENGTHS:
        alone.append(logits(input_ids=ids[:, start : start + n], use_cache=False))
        start += n
    rec["packed_alone"] = alone

    ids, mask = padded_batch()
    rec["padded_mask"] = mask
    for use_cache in (False, True):
        rec[f"padded_cache_{use_cache}"] = logits(
            input_ids=ids, attention_mask=mask, use_cache=use_cache
        )

    ids, mask = generate_prompt()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            output_scores=True,
            return_dict_in_generate=True,
        )
    rec["generate_mask"] = mask
    rec["generated"] = out.sequences[:, ids.shape[1] :].cpu()
    rec["generate_scores"] = torch.stack([s.float().cpu() for s in out.scores])  # (steps, B, V)
    return rec


def run(mode: str, root: Path, out: Path, device: str) -> int:
    meta: dict[str, Any] = {"mode": mode, "device": device}
    if mode == "real":
        if "attnguard" in sys.modules:
            print("attnguard was imported: the real run must be unguarded", file=sys.stderr)
            return 3
        import flash_attn
        import flash_attn_2_cuda

        if getattr(flash_attn, "IS_ATTNGUARD_STANDIN", False):
            print(f"flash_attn is the stand-in ({flash_attn.__file__})", file=sys.stderr)
            return 3
        meta["flash_attn"] = [
            flash_attn.__version__,
            flash_attn.__file__,
            flash_attn_2_cuda.__file__,
        ]
        capture = None
    else:
        if importlib.util.find_spec("flash_attn") is not None:
            print("flash_attn is importable: the twins run needs it absent", file=sys.stderr)
            return 3
        os.environ.setdefault("ATTNGUARD_LOG", "none")
        import attnguard  # noqa: F401  (first: importing activates the guard)
        from attnguard.observability import events

        meta["flash_attn"] = None
        capture = events
    import torch
    import transformers

    meta.update(
        torch=torch.__version__,
        transformers=transformers.__version__,
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    )
    families = {}
    for family in FAMILIES:
        if capture is None:
            families[family] = run_family(root / family, device)
            continue
        capture.reset_counts()
        with capture.capture() as got:
            families[family] = run_family(root / family, device)
        families[family]["events"] = [
            {k: e.get(k) for k in ("event", "site", "reason_code", "rule", "selected", "applied")}
            for e in got
            if e["event"] not in ("activated", "summary")
        ]
    torch.save({"meta": meta, "families": families}, out)
    print(f"{mode}: {', '.join(FAMILIES)} -> {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["make", "run"])
    ap.add_argument("args", nargs="+")
    ap.add_argument("--device", default="cuda:0")
    ns = ap.parse_args()
    if ns.what == "make":
        make(Path(ns.args[0]))
        return 0
    mode, root, out = ns.args
    if mode not in ("real", "twins"):
        ap.error("run takes real or twins")
    return run(mode, Path(root), Path(out), ns.device)


if __name__ == "__main__":
    sys.exit(main())
