"""Flash attention from the Hugging Face kernel hub on an air-gapped cluster.

transformers 5 loads flash attention from the kernel hub (the `kernels` package) when asked for
``attn_implementation="kernels-community/flash-attn2"``, and by itself when
``flash_attention_2`` meets no flash-attn but a `kernels` it accepts. A cluster without network
(``HF_HUB_OFFLINE=1``, an empty Hugging Face cache), a missing `kernels` package or one at a
version transformers refuses all stop that load. This example makes such a machine (offline, an
empty cache in a temporary directory), shows the load failing without attnguard, then loads with
attnguard: the hub kernel's functions are flash-attn 2's, so attnguard's SDPA twins of those
functions compute its calls, and one event names the kernel and why it could not load. Where the
hub kernel loads (a cached build, a reachable hub), attnguard changes nothing.

    python examples/hub_kernel_air_gapped.py

On a transformers release that loads no attention kernel from the hub the example says so and
exits with status 3.
"""

from __future__ import annotations

import os
import tempfile

os.environ["HF_HUB_OFFLINE"] = "1"  # an air-gapped cluster...
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="empty-hf-home-")  # ... with an empty cache
os.environ.pop("LOCAL_KERNELS", None)
if os.environ.get("ATTNGUARD_LOG", "stderr") == "stderr":  # human-readable; log files stay JSON
    os.environ.setdefault("ATTNGUARD_LOG_FORMAT", "console")

import importlib  # noqa: E402

import attnguard  # noqa: E402,F401  (importing activates the guard)
import torch  # noqa: E402
import transformers  # noqa: E402
from _shared import cannot_show, computed_by, finish, without_attnguard  # noqa: E402
from attnguard.integrations.transformers import hub  # noqa: E402
from attnguard.observability import events  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

HUB = "kernels-community/flash-attn2"


def loads_attention_from_the_hub() -> bool:
    """Whether this transformers release has a loader of attention hub kernels (recognised by
    shape: the loader attnguard guards)."""
    try:
        module = importlib.import_module(hub.MODULE)
    except ImportError:
        return False
    return any(callable(getattr(module, name, None)) for name in hub.LOADERS)


def main() -> None:
    if not loads_attention_from_the_hub():
        cannot_show(
            f"transformers {transformers.__version__} loads no attention kernel from the kernel "
            "hub (transformers 5 does)"
        )
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
            return AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation=HUB)

        print(f"Loading with attn_implementation={HUB!r}, offline, an empty cache ...")
        print("without attnguard:", without_attnguard(load))
        with events.capture() as captured:
            model = load()
            ids = torch.tensor([[1, 5, 9, 12, 7]])
            out = model.generate(ids, max_new_tokens=5, do_sample=False)
    print(f"with attnguard: loaded {type(model).__name__}; {computed_by(model)}")
    print(f"Generated tokens: {out[0].tolist()}")
    finish(captured)


if __name__ == "__main__":
    main()
