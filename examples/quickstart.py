"""attnguard in one minute, on a CPU laptop.

A tiny random Llama is saved and loaded back with ``attn_implementation="flash_attention_2"`` —
the usual line in training scripts. Without flash-attn (or without a GPU) transformers refuses it
with an ImportError before the weights load: the example shows that first, with attnguard
switched off. With attnguard active the model loads with transformers' flash code path kept and
its kernel calls computed by attnguard's SDPA twins of the flash-attn functions (the same results
flash would give: padding, packed sequences, windows), and attnguard says so as one structured
event (console on a terminal, JSON otherwise). The last lines list the events this run caused.

    python examples/quickstart.py
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("ATTNGUARD_LOG", "stderr") == "stderr":  # human-readable; log files stay JSON
    os.environ.setdefault("ATTNGUARD_LOG_FORMAT", "console")

import attnguard  # noqa: E402  (importing activates the guard)
import torch  # noqa: E402
from _shared import computed_by, finish, without_attnguard  # noqa: E402
from attnguard.observability import events  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402


def main() -> None:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    with tempfile.TemporaryDirectory() as ckpt:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(ckpt)

        def load() -> torch.nn.Module:
            return AutoModelForCausalLM.from_pretrained(
                ckpt, attn_implementation="flash_attention_2"
            )

        print("Loading with attn_implementation='flash_attention_2' ...")
        print("without attnguard:", without_attnguard(load))
        with events.capture() as captured:
            model = load()
            ids = torch.tensor([[1, 5, 9, 12, 7]])
            out = model.generate(ids, max_new_tokens=5, do_sample=False)
    print(f"with attnguard: loaded {type(model).__name__}; {computed_by(model)}")
    print(f"Generated tokens: {out[0].tolist()}")
    print(f"attnguard active: {attnguard.is_active()} (mode {attnguard.settings().mode})")
    finish(captured)


if __name__ == "__main__":
    main()
