"""Family E: a float32 model with flash attention (DeepScaleR / verl, Qwen2ForCausalLM).

Original: DeepScaleR (built on verl) loads a Qwen2ForCausalLM checkpoint stored in float32 with
``attn_implementation="flash_attention_2"`` and no dtype. transformers warns "Flash Attention 2.0
only supports torch.float16 and torch.bfloat16 dtypes, but the current dype in Qwen2ForCausalLM
is torch.float32", loads anyway, and the first forward fails with "RuntimeError: FlashAttention
only support fp16 and bf16 data type". Users load with a half dtype or use another backend.

attnguard: with flash-attn usable on a GPU it injects the load dtype (bf16 where the GPU has it
natively, else fp16: ``model_cast``) and, with no device_map, loads straight onto the GPU
(``model_placed``). ATTNGUARD_FP32_POLICY=fallback keeps float32 and uses SDPA instead. A dtype
the caller passes (verl's actor: ``torch_dtype=torch.float32``, fp32 master weights on purpose)
stands, and so does FSDP's: attnguard only observes, and the call-time guard runs each flash call
in bf16. On this CPU laptop flash-attn cannot run, so the flash code path runs on attnguard's
SDPA twins for real (``backend_fallback``) and the GPU decision is shown as planned by attnguard's
planner with an H100's facts injected, not run.

Run: ``python examples/family_e_fp32_flash.py``. GPU: needed (with flash-attn) to see the cast
and placement for real; the GPU suite runs it with the real flash-attn.
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("ATTNGUARD_LOG", "stderr") == "stderr":  # human-readable; log files stay JSON
    os.environ.setdefault("ATTNGUARD_LOG_FORMAT", "console")

import attnguard  # noqa: E402  (importing activates the guard)
import torch  # noqa: E402
from _shared import TINY_TEXT, computed_by, finish, show_plan, without_attnguard  # noqa: E402
from attnguard.observability import events
from attnguard import facts  # noqa: E402
from attnguard.plan import LoadRequest, plan_load  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402


def main() -> None:
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        Qwen2ForCausalLM(Qwen2Config(**TINY_TEXT)).float().save_pretrained(ckpt)  # fp32 weights

        def load() -> torch.nn.Module:
            return Qwen2ForCausalLM.from_pretrained(ckpt, attn_implementation="flash_attention_2")

        def first_forward(model: torch.nn.Module) -> torch.Tensor:
            device = next(model.parameters()).device
            ids = torch.tensor([[1, 5, 9, 12, 7, 3]], device=device)
            with torch.no_grad():
                return model(input_ids=ids).logits

        print("without attnguard:", without_attnguard(lambda: first_forward(load())))
        with events.capture() as captured:
            model = load()
            logits = first_forward(model)
    print(
        f"with attnguard: {type(model).__name__} on {next(model.parameters()).device}, "
        f"{next(model.parameters()).dtype}, attention {model.config._attn_implementation!r}; "
        f"first forward ran, logits {tuple(logits.shape)}"
    )
    print(f"  {computed_by(model)}")

    # The same load on an H100 with flash-attn 2.8.3 (injected facts, not run).
    request = LoadRequest(
        model="Qwen2ForCausalLM",
        attn_implementation="flash_attention_2",
        dtype=None,  # not given: float32 on 4.x, the checkpoint's (float32 here) on 5.x
        default_dtype="auto",
        checkpoint_dtype="float32",
    )
    node = dict(installed={"flash_attention_2": "2.8.3"}, gpu_name="NVIDIA H100 80GB HBM3")
    h100 = facts.synthetic(((9, 0),), **node)
    planned = show_plan("on an H100", plan_load(request, h100, attnguard.settings()))
    fsdp = facts.synthetic(((9, 0),), init=facts.InitContext(fsdp=True), **node)
    show_plan("the same inside verl's FSDP actor", plan_load(request, fsdp, attnguard.settings()))
    finish(captured, planned)


if __name__ == "__main__":
    main()
