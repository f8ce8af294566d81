"""A broken flash-attn install: the package is there, its CUDA extension is not loadable.

Original: after a torch upgrade (or a wheel built for another CUDA / torch), ``import flash_attn``
fails with "ImportError: .../flash_attn_2_cuda...so: undefined symbol: ..." or "No module named
'flash_attn_2_cuda'". transformers only reads package metadata, so ``from_pretrained(...,
attn_implementation="flash_attention_2")`` accepts it on a GPU and the job dies at the first
attention call. Users uninstalled flash-attn or switched backends by hand.

attnguard: imports the extension for real before deciding; with a broken one the load keeps
transformers' flash code path and attnguard's SDPA twins compute its kernel calls
(``backend_fallback``, reason ``extension_broken``), with the import error in the reason so the
user knows what to reinstall. ``from flash_attn import ...`` in your own code keeps failing with
the same ImportError as without attnguard (docs/how-it-works.md says why).

Run (needs a broken install on PYTHONPATH; GPU not needed). Build one without CUDA (~15 s):

    FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \\
        pip install --no-build-isolation --no-deps --target /tmp/broken-flash flash-attn==2.8.3
    PYTHONPATH=/tmp/broken-flash python examples/broken_flash_install.py

Without a broken install the example says how to make one and exits with status 3.
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
    cannot_show,
    computed_by,
    finish,
    load_dtype,
    without_attnguard,
)
from attnguard.observability import events
from attnguard import facts  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


def main() -> None:
    status = facts.current().backend("flash_attention_2")
    print(f"flash-attn here: {status.reason_code}: {status.reason}")
    if status.reason_code != facts.EXTENSION_BROKEN:
        print(
            "No broken flash-attn install found. Make one (no GPU needed):\n"
            "  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE pip install "
            "--no-build-isolation --no-deps --target /tmp/broken-flash flash-attn==2.8.3\n"
            "and run this example with PYTHONPATH=/tmp/broken-flash."
        )
        cannot_show(
            "no broken flash-attn install on the path (flash-attn here: " + status.reason + ")"
        )
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**TINY_TEXT)).save_pretrained(ckpt)

        def train_step() -> float:
            model = AutoModelForCausalLM.from_pretrained(
                ckpt, attn_implementation="flash_attention_2", **load_dtype(torch.bfloat16)
            )
            ids = torch.tensor([[1, 5, 9, 12, 7, 3, 2]], device=next(model.parameters()).device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            print(f"  {type(model).__name__} with {model.config._attn_implementation!r}")
            if attnguard.is_active():
                print(f"  {computed_by(model)}")
            return loss.item()

        print("without attnguard:", without_attnguard(train_step))
        with events.capture() as captured:
            print("with attnguard:")
            loss = train_step()
    print(f"  one training step ran, loss {loss:.3f}")
    finish(captured)


if __name__ == "__main__":
    main()
