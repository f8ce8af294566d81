"""Family C in miniature: each torchrun worker loads a tiny Qwen2.5-VL with device_map="auto".

The launch pattern of VLMEvalKit (family C), unchanged by attnguard:

    python scripts/torchrun_vl.py --make-model /tmp/tiny-vl            # once: a tiny random model
    torchrun --nproc-per-node=2 scripts/torchrun_vl.py --model /tmp/tiny-vl --out /tmp/res
    ATTNGUARD=1 torchrun --nproc-per-node=2 scripts/torchrun_vl.py --model /tmp/tiny-vl --out ...

Every worker sets its CUDA device, joins the NCCL group, loads the model with the given
``--device-map`` (default "auto": every rank spreads its copy over every GPU), runs one greedy
image+text generation and writes ``result-{rank}.json`` into ``--out``: the parameters' devices,
``hf_device_map``, the generated ids, the first step's logits, or the error it hit. A single process
(``python scripts/torchrun_vl.py ...``) is the reference run. tests/gpu/test_multigpu_gpu.py
drives it; ATTNGUARD_LOG=<out>/events-{rank}.jsonl gives each rank's events.

``--guard-by-hand`` makes the calls the loading wrapper makes (plan_from_environment before
from_pretrained, install_rotary_alignment after): a way to try attnguard.plan.device_map before that
wrapper is wired. Users never need it; the test does not use it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

# The tiny Qwen2.5-VL: 2 text layers of width 32, a 2-block vision tower; loads in < 1 s.
TEXT = {
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "vocab_size": 200,
    "max_position_embeddings": 512,
    "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
    "image_token_id": 150,
    "video_token_id": 151,
    "vision_start_token_id": 152,
    "vision_end_token_id": 153,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 32,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "window_size": 56,
    "fullatt_block_indexes": [1],
}
NEW_TOKENS = 8


def make_model(path: str) -> None:
    """Save a tiny random Qwen2.5-VL (fixed seed: every run gets the same weights)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(vision_config=VISION, **TEXT)
    Qwen2_5_VLForConditionalGeneration(config).save_pretrained(path)


def image_and_text() -> dict[str, Any]:
    """One 28x28 image (2x2 patches -> 1 merged image token) inside a short prompt."""
    import torch

    g = torch.Generator().manual_seed(1)
    pixel_values = torch.randn(4, 3 * 2 * 14 * 14, generator=g)
    ids = [5, 6, TEXT["vision_start_token_id"], TEXT["image_token_id"]]
    ids += [TEXT["vision_end_token_id"], 7, 8, 9]
    input_ids = torch.tensor([ids])
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "pixel_values": pixel_values,
        "image_grid_thw": torch.tensor([[1, 2, 2]]),
    }


def parse_device_map(text: str) -> Any:
    """ "auto" / "balanced" / "cuda:0" / a JSON dict."""
    if text.startswith("{"):
        return json.loads(text)
    if text.startswith("cuda:"):
        return {"": text}
    return text


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import Qwen2_5_VLForConditionalGeneration

    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    result: dict[str, Any] = {
        "rank": rank,
        "pid": os.getpid(),
        "local_rank": local_rank,
        "world_size": world_size,
        "n_gpus": torch.cuda.device_count(),
        "device_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "attnguard_active": "attnguard" in sys.modules
        and bool(sys.modules["attnguard"].is_active()),
        "device_map_requested": args.device_map,
    }
    if world_size > 1:
        torch.cuda.set_device(local_rank)  # what VLMEvalKit and most torchrun scripts do
        torch.distributed.init_process_group("nccl")
    device_map = parse_device_map(args.device_map)
    kwargs: dict[str, Any] = {"device_map": device_map}
    if args.guard_by_hand:
        from attnguard.plan.device_map import plan_from_environment

        decision = plan_from_environment(device_map)
        if decision is not None:
            kwargs["device_map"] = decision.device_map
            if decision.max_memory is not None:
                kwargs["max_memory"] = decision.max_memory
            result["by_hand_decision"] = decision.reason_code
    try:
        model = Qwen2_5_VLForConditionalGeneration.from_pretrained(args.model, **kwargs).eval()
        if args.guard_by_hand:
            from attnguard.integrations.transformers.rotary import install_rotary_alignment

            result["rotary_hooks"] = install_rotary_alignment(model)
        result["param_devices"] = sorted({str(p.device) for p in model.parameters()})
        result["hf_device_map"] = {
            k: str(v) for k, v in (getattr(model, "hf_device_map", None) or {}).items()
        }
        # like the user code: inputs go to "the" GPU of this process (cuda == its current device)
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        inputs = {k: v.to(device) for k, v in image_and_text().items()}
        with torch.no_grad():
            logits = model(**inputs).logits[0, -1].float().cpu()
            out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
        result["first_logits"] = logits.tolist()
        result["generated"] = out[0, inputs["input_ids"].shape[1] :].tolist()
        result["ok"] = True
    except Exception as exc:
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        result["traceback"] = traceback.format_exc()[-4000:]
    if world_size > 1:
        torch.distributed.barrier()  # finish together; the group stays up (as in the user code)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make-model", metavar="DIR", help="save the tiny model to DIR and exit")
    parser.add_argument("--model", help="directory of the tiny model")
    parser.add_argument("--out", help="directory for result-{rank}.json")
    parser.add_argument("--device-map", default="auto", help='"auto", "cuda:0", or a JSON dict')
    parser.add_argument("--guard-by-hand", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.make_model:
        make_model(args.make_model)
        return 0
    if not (args.model and args.out):
        parser.error("--model and --out are required (or --make-model DIR)")
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"result-{result['rank']}.json").write_text(json.dumps(result, indent=1))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
