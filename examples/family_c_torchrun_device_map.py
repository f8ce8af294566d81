"""Family C: torchrun with device_map="auto" (VLMEvalKit evaluating Qwen2.5-VL).

Original: VLMEvalKit runs ``torchrun --nproc-per-node=2 run.py ...``; each worker loads
``Qwen2_5_VLForConditionalGeneration.from_pretrained(path, torch_dtype="auto",
device_map="auto", attn_implementation="flash_attention_2")``. Every process spreads its own
copy of the model over *all* GPUs: slow at best (one replica per rank measured ~1.9x faster), at
worst "RuntimeError: Expected all tensors to be on the same device, but found at least two
devices, cuda:0 and cuda:1!" in the rotary embedding.

attnguard: under a multi-process launch it rewrites a spreading device_map so each rank loads
its own replica on ``cuda:LOCAL_RANK`` (``device_map_rewritten``), or, for a model too big for one
GPU, a disjoint slice of GPUs per rank; on a model spread over GPUs it aligns rotary inputs.

Run on 2 GPUs: ``torchrun --nproc-per-node=2 examples/family_c_torchrun_device_map.py`` (each
rank prints its own devices and events). GPU: 2 needed for the real run (the GPU suite also runs
scripts/torchrun_vl.py). On a CPU, or one process, the model loads for real in this process
(flash-attn cannot run here: its code path runs on attnguard's SDPA twins) and the per-rank
decision is shown as planned by attnguard's planner with the environment a 2-rank torchrun sets,
not run. Needs accelerate (``device_map``; the ``examples`` extra installs it); without it the
example says so and exits with status 3.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("ATTNGUARD_LOG", "stderr") == "stderr":  # human-readable; log files stay JSON
    os.environ.setdefault("ATTNGUARD_LOG_FORMAT", "console")

import attnguard  # noqa: E402  (importing activates the guard)
import torch  # noqa: E402
from _shared import (  # noqa: E402
    cannot_show,
    computed_by,
    finish,
    load_dtype,
    show_plan,
    tiny_qwen2_5_vl_config,
    vl_prompt,
)
from attnguard.observability import events
from attnguard import facts  # noqa: E402
from attnguard.plan.device_map import estimate_model_bytes  # noqa: E402
from attnguard.plan import LoadRequest, plan_load  # noqa: E402
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration  # noqa: E402

KWARGS = dict(**load_dtype("auto"), device_map="auto", attn_implementation="flash_attention_2")


def torchrun_env(rank: int, nproc: int) -> dict[str, str]:
    """The variables ``torchrun --nproc-per-node=<nproc>`` sets for worker ``rank`` (one node)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "none",
    }


def plan_ranks(title: str, model_bytes: int | None, n_gpus: int) -> list[str]:
    """What each of 2 torchrun ranks would load with on a node of ``n_gpus`` H200s."""
    request = LoadRequest(
        model="Qwen2_5_VLForConditionalGeneration",
        attn_implementation="flash_attention_2",
        dtype="auto",
        checkpoint_dtype="bfloat16",
        device_map="auto",
        model_bytes=model_bytes,
    )
    planned = []
    for rank in range(2):
        node = facts.synthetic(
            ((9, 0),) * n_gpus,
            installed={"flash_attention_2": "2.8.3"},
            gpu_name="NVIDIA H200",
            gpu_memory=141 * 10**9,
            launch=facts.launch_now(torchrun_env(rank, 2)),
        )
        plan = plan_load(request, node, attnguard.settings())
        planned += show_plan(f"{title}, rank {rank}", plan)
        print(f"  -> device_map={plan.device_map!r}, max_memory={plan.max_memory!r}")
    return planned


def how_to_see_it(world: int, gpus: int) -> str:
    """What it takes to see the real failure, from where this run stands."""
    command = f"torchrun --nproc-per-node=2 {os.path.relpath(__file__)}"
    if world >= 2:  # started under a launcher already: the machine is what is missing
        return (
            f"The real failure needs 2 GPUs; this machine has {gpus}: the same command on a "
            "machine with 2 GPUs shows it"
        )
    if gpus >= 2:
        return f"The real failure needs several processes: {command}"
    return f"The real failure needs 2 GPUs: on a machine with 2, {command}"


def main() -> None:
    import importlib.util

    if importlib.util.find_spec("accelerate") is None:
        cannot_show(
            "accelerate is not installed (device_map needs it): `pip install accelerate`, or the "
            "examples extra"
        )
    rank, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())  # as VLMEvalKit's run.py
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)  # every rank saves the same tiny model
        Qwen2_5_VLForConditionalGeneration(tiny_qwen2_5_vl_config()).save_pretrained(ckpt)
        with events.capture() as captured:
            model = Qwen2_5_VLForConditionalGeneration.from_pretrained(ckpt, **KWARGS)
            first = next(model.parameters()).device
            with torch.no_grad():
                out = model.generate(**vl_prompt(first), max_new_tokens=4, do_sample=False)
    devices = sorted({str(p.device) for p in model.parameters()})
    print(
        f"rank {rank} of {world}: model on {devices}, attention "
        f"{model.config._attn_implementation!r}; generated {out[0, -4:].tolist()}"
    )
    print(f"  {computed_by(model)}")
    planned = None
    if world < 2 or torch.cuda.device_count() < 2:
        print(how_to_see_it(world, torch.cuda.device_count()))
        planned = plan_ranks("tiny Qwen2.5-VL, 2 GPUs", None, 2)
        # a 72B-shaped Qwen2.5-VL (bf16, ~145 GB): too big for one GPU -> a GPU slice per rank
        big = Qwen2_5_VLConfig(
            hidden_size=8192,
            num_hidden_layers=80,
            intermediate_size=29568,
            num_attention_heads=64,
            num_key_value_heads=8,
            vocab_size=152064,
            vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3456),
        )
        planned += plan_ranks("72B-shaped, 4 GPUs", estimate_model_bytes(big, "bfloat16"), 4)
    finish(captured, planned)


if __name__ == "__main__":
    main()
