"""Family B: flash-attention + bf16 on a GPU older than Ampere (Qwen fine-tuning on a V100).

Original: QwenLM/Qwen's fine-tuning recipe loads the model with flash attention and trains in
bf16. On a V100 (compute capability 7.0) flash-attn installs, transformers accepts it (its check
reads package metadata, never the GPU), and the first forward fails with "RuntimeError:
FlashAttention only supports Ampere GPUs or newer."; bf16 on a V100 is only emulated (slow).
Users uninstalled flash-attn, switched to sdpa/eager and trained in fp16 by hand.

attnguard: judges flash-attn by the GPU it would run on. On a V100 it keeps transformers'
flash code path with its kernel calls on attnguard's SDPA twins (``backend_fallback``, reason
``capability_too_low``), on the GPU (``model_placed``) and in fp16 instead of the emulated bf16
(``model_cast``, reason ``no_native_bf16``). On this CPU laptop flash-attn cannot run either, so
the fallback happens for real; the V100 decision is shown as planned by attnguard's own planner
with the facts of a V100 injected (``attnguard.facts.synthetic``), not run.

Run: ``python examples/family_b_old_gpu.py``. GPU: not needed (a V100 is needed to see the real
kernel error; the plan is the same code path the V100 run takes).
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
    TINY_TEXT,
    computed_by,
    finish,
    load_dtype,
    show_plan,
    without_attnguard,
)
from attnguard.observability import events
from attnguard import facts  # noqa: E402
from attnguard.plan import LoadRequest, plan_load  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(Qwen2Config(**TINY_TEXT)).save_pretrained(ckpt)
        config = AutoConfig.from_pretrained(ckpt)
        config.use_cache = False  # as the fine-tuning script does (gradient checkpointing)

        def load() -> torch.nn.Module:
            return AutoModelForCausalLM.from_pretrained(
                ckpt,
                config=config,
                device_map=None,  # plain DDP / ZeRO-2: the Trainer places the model
                attn_implementation="flash_attention_2",
                **load_dtype(torch.bfloat16),
            )

        print("without attnguard:", without_attnguard(load))
        with events.capture() as captured:
            model = load()
            # one fine-tuning step
            ids = torch.tensor([[1, 5, 9, 12, 7, 3, 2], [1, 8, 4, 6, 10, 11, 2]])
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    print(
        f"with attnguard: {type(model).__name__}, {next(model.parameters()).dtype}, attention "
        f"{model.config._attn_implementation!r}; one training step, loss {loss.item():.3f}"
    )
    print(f"  {computed_by(model)}")

    # The same load on a V100 with flash-attn 2.8.3 installed (injected facts, not run), with
    # this transformers' flash path kept on the twins where it was kept here
    v100 = facts.synthetic(
        ((7, 0),), installed={"flash_attention_2": "2.8.3"}, gpu_name="Tesla V100-SXM2-32GB"
    )
    request = LoadRequest(
        model=type(model).__name__,
        attn_implementation="flash_attention_2",
        dtype="bfloat16",
        device_map=None,
        flash_path_on_twins=any(e.get("rule") == "flash-on-sdpa" for e in captured),
    )
    planned = show_plan("on a V100", plan_load(request, v100, attnguard.settings()))
    finish(captured, planned)


if __name__ == "__main__":
    main()
