"""Family A: a flash-attention model built on the CPU (VLM-R1 GRPO training).

Original: VLM-R1's GRPO trainer (torchrun x8, transformers 4.49) loads the policy with
``Qwen2_5_VLForConditionalGeneration.from_pretrained(path, attn_implementation=
"flash_attention_2", torch_dtype=torch.bfloat16)`` and no ``device_map``, so the model is built
on the CPU and transformers says "You are attempting to use Flash Attention 2.0 with a model not
initialized on GPU"; the flash kernels then fail on CPU tensors unless the user adds
``model.to("cuda")`` or ``device_map={"": local_rank}`` by hand.

attnguard: with flash-attn usable on a GPU, it loads the model straight onto ``cuda:LOCAL_RANK``
(``model_placed``). Where flash-attn cannot run at all (this CPU laptop), it keeps
transformers' flash code path and computes its kernel calls with attnguard's SDPA twins of the
flash-attn functions (``backend_fallback``). Under DeepSpeed ZeRO-3 / FSDP it only observes: the
CPU build is deliberate there.

Run: ``python examples/family_a_flash_not_on_gpu.py`` (or under ``torchrun --nproc-per-node=N``).
GPU: needed to see the placement itself (with flash-attn installed); on a CPU the example shows
the fallback for real and the placement as planned by attnguard's planner for an 8-GPU node.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("ATTNGUARD_LOG", "stderr") == "stderr":  # human-readable; log files stay JSON
    os.environ.setdefault("ATTNGUARD_LOG_FORMAT", "console")
for var, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():
    os.environ.setdefault(var, value)  # what torchrun sets for a one-process run

import attnguard  # noqa: E402  (importing activates the guard)
import torch  # noqa: E402
from _shared import (  # noqa: E402
    computed_by,
    finish,
    load_dtype,
    show_plan,
    tiny_qwen2_5_vl_config,
    vl_prompt,
    without_attnguard,
)
from attnguard.observability import events  # noqa: E402
from attnguard import facts  # noqa: E402
from attnguard.plan import LoadRequest, plan_load  # noqa: E402
from transformers import Qwen2_5_VLForConditionalGeneration  # noqa: E402

MODEL_INIT_KWARGS = {"attn_implementation": "flash_attention_2", **load_dtype(torch.bfloat16)}


def main() -> None:
    local_rank = int(os.environ["LOCAL_RANK"])
    print(f"VLM-R1-style policy load on rank {local_rank}: from_pretrained(**{MODEL_INIT_KWARGS})")
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config()).save_pretrained(ckpt)

        def load() -> torch.nn.Module:
            return Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, **MODEL_INIT_KWARGS)

        print("without attnguard:", without_attnguard(lambda: load()(**vl_prompt())))
        with events.capture() as captured:
            model = load()
            device = next(model.parameters()).device
            with torch.no_grad():  # a GRPO rollout: generate from an image + text prompt
                out = model.generate(**vl_prompt(device), max_new_tokens=4, do_sample=False)
    print(
        f"with attnguard: {type(model).__name__} on {device}, "
        f"{next(model.parameters()).dtype}, attention {model.config._attn_implementation!r}; "
        f"generated {out[0, -4:].tolist()}"
    )
    print(f"  {computed_by(model)}")
    if model.config._attn_implementation != "flash_attention_2":
        print("(flash-attn cannot run here, so there is nothing to place: see the plan below)")

    # The same request on a node of 8 A100s with flash-attn, rank 3 (injected facts).
    request = LoadRequest(
        model=type(model).__name__, attn_implementation="flash_attention_2", dtype="bfloat16"
    )
    node = dict(installed={"flash_attention_2": "2.8.3"}, gpu_name="NVIDIA A100-SXM4-80GB")
    rank3 = facts.Launch(rank=3, local_rank=3, world_size=8, local_world_size=8)
    ddp = facts.synthetic(((8, 0),) * 8, launch=rank3, **node)
    planned = show_plan(
        "rank 3 of torchrun x8 on 8 A100s", plan_load(request, ddp, attnguard.settings())
    )
    zero3 = facts.synthetic(((8, 0),) * 8, launch=rank3, init=facts.InitContext(zero3=True), **node)
    show_plan("the same under DeepSpeed ZeRO-3", plan_load(request, zero3, attnguard.settings()))
    finish(captured, planned)


if __name__ == "__main__":
    main()
