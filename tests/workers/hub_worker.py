"""Flash attention from the Hugging Face kernel hub, as a user's program meets it, for
tests/test_hub_kernels.py (and tests/gpu/test_hub_gpu.py with ``--device cuda``).

    python hub_worker.py make ROOT                          # the checkpoints
    python hub_worker.py run {plain|guarded} ROOT CALLS [--device cpu] [--scenarios a,b]

``make`` saves a seeded float32 Llama and, where the release has it, a GPT-OSS with sinks that
matter. ``run`` is one program: ``guarded`` imports attnguard first, ``plain`` never does. The
environment decides what the kernel hub offers (the ``kernels`` package on the path or not,
``HF_HUB_OFFLINE``, an empty ``HF_HOME``, ``LOCAL_KERNELS`` stand-ins written by
tests/standins/hub_kernel.py; ``HUB_STANDIN_CALLS`` = CALLS counts their calls). Each scenario
loads a model the way users' code does and records: the error (type and first line) or the
attention implementation the model ended with, its logits' largest difference from the eager
model on a plain, a left-padded and a packed batch (the packed row against each sequence run
alone), the calls made into the stand-in hub kernels, and (guarded) the events attnguard emitted.
One JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.models import save_gpt_oss, save_tiny  # noqa: E402
from helpers.processes import first_line  # noqa: E402

FLASH = "flash_attention_2"
HUB = "kernels-community/flash-attn2"
LENGTHS = (5, 7, 4)


def make(root: Path) -> None:
    import transformers

    save_tiny(root / "llama", max_position_embeddings=256)
    if hasattr(transformers, "GptOssForCausalLM"):
        save_gpt_oss(root / "gpt_oss")


def _batches(torch: Any, device: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    packed = torch.randint(3, 128, (1, sum(LENGTHS)), generator=g)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return {
        k: v.to(device)
        for k, v in dict(ids=ids, mask=mask, packed=packed, positions=positions).items()
    }


def _errors(torch: Any, model: Any, eager: Any, b: dict[str, Any]) -> dict[str, float]:
    """Largest logit difference from eager at real tokens: plain, padded, packed (in float32)."""
    model_logits, eager_logits = model, eager

    def model(**kw: Any) -> Any:
        out = model_logits(**kw)
        out.logits = out.logits.float()
        return out

    def eager(**kw: Any) -> Any:
        out = eager_logits(**kw)
        out.logits = out.logits.float()
        return out

    with torch.no_grad():
        plain = (model(input_ids=b["ids"]).logits - eager(input_ids=b["ids"]).logits).abs().max()
        real = b["mask"].bool()
        got = model(input_ids=b["ids"], attention_mask=b["mask"]).logits[real]
        want = eager(input_ids=b["ids"], attention_mask=b["mask"]).logits[real]
        padded = (got - want).abs().max()
        row = model(input_ids=b["packed"], position_ids=b["positions"], use_cache=False).logits[0]
        alone, start = [], 0
        for n in LENGTHS:
            alone.append(eager(input_ids=b["packed"][:, start : start + n]).logits[0])
            start += n
        packed = (row - torch.cat(alone)).abs().max()
    return {"plain": float(plain), "padded": float(padded), "packed": float(packed)}


def _calls(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def run(mode: str, root: Path, calls: Path, device: str, scenarios: list[str]) -> dict[str, Any]:
    captured: list[dict[str, Any]] = []
    if mode == "guarded":
        import attnguard
        from attnguard.observability import events

        attnguard.activate(log="none")
        stack = events.capture()
        captured = stack.__enter__()
    import torch
    import transformers

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    batches = _batches(torch, device)
    kw = dict(dtype=dtype, device_map=device) if device.startswith("cuda") else {}
    out: dict[str, Any] = {"transformers": transformers.__version__, "scenarios": {}}
    try:
        import kernels

        out["kernels"] = kernels.__version__
    except Exception as exc:
        out["kernels"] = first_line(exc)

    def load(cls: Any, path: Path, attn: str, switch: bool = False) -> Any:
        if switch:
            model = cls.from_pretrained(path, attn_implementation="eager", **kw)
            model.set_attn_implementation(attn)
            return model
        return cls.from_pretrained(path, attn_implementation=attn, **kw)

    plans = {
        "fallback": (transformers.LlamaForCausalLM, "llama", FLASH, False),
        "explicit": (transformers.LlamaForCausalLM, "llama", HUB, False),
        "switch": (transformers.LlamaForCausalLM, "llama", HUB, True),
        "flash3": (transformers.LlamaForCausalLM, "llama", "kernels-community/flash-attn3", False),
        "unknown": (transformers.LlamaForCausalLM, "llama", "acme/fancy-attention", False),
        "function": (transformers.LlamaForCausalLM, "llama", f"{HUB}:flash_attn_func", False),
        "gpt_oss": (getattr(transformers, "GptOssForCausalLM", None), "gpt_oss", FLASH, False),
    }
    # transformers' own fallback to the hub kernel where flash-attn is missing came with 5.0
    # (4.56-4.57 load hub kernels only when asked by name)
    import transformers.modeling_utils as modeling_utils

    source = Path(modeling_utils.__file__).read_text(encoding="utf-8")
    falls_back = "FLASH_ATTN_KERNEL_FALLBACK" in source
    for name in scenarios:
        cls, ckpt, attn, switch = plans[name]
        if cls is None or not (root / ckpt).exists():
            out["scenarios"][name] = {"not_applicable": "this release has no such model"}
            continue
        if name == "fallback" and not falls_back:
            out["scenarios"][name] = {
                "not_applicable": "this release does not fall back to the hub"
            }
            continue
        before = len(_calls(calls))
        seen = len(captured)
        result: dict[str, Any] = {}
        try:
            model = load(cls, root / ckpt, attn, switch)
            result["attn"] = model.config._attn_implementation
            eager = cls.from_pretrained(root / ckpt, attn_implementation="eager", **kw)
            result["errors"] = _errors(torch, model, eager, batches)
            if dtype != torch.float32:  # both against eager in float32: what bf16 itself costs
                wide = dict(kw, dtype=torch.float32)
                eager32 = cls.from_pretrained(root / ckpt, attn_implementation="eager", **wide)
                result["errors_vs_fp32"] = _errors(torch, model, eager32, batches)
                result["eager_vs_fp32"] = _errors(torch, eager, eager32, batches)
        except Exception as exc:
            result["error"] = first_line(exc)
        result["calls"] = _calls(calls)[before:]
        result["events"] = [
            {k: e.get(k) for k in ("event", "reason_code", "rule", "reason", "hub_kernel")}
            for e in captured[seen:]
            if e["event"] != "activated"
        ]
        out["scenarios"][name] = result
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=("make", "run"))
    parser.add_argument("args", nargs="+")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--scenarios", default="fallback,explicit,switch,unknown,function,gpt_oss")
    args = parser.parse_args()
    if args.what == "make":
        make(Path(args.args[0]))
        return
    mode, root, calls = args.args
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["HUB_STANDIN_CALLS"] = calls  # the stand-in hub kernels count their calls there
    result = run(mode, Path(root), Path(calls), args.device, args.scenarios.split(","))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
