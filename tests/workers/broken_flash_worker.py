"""A user's program importing and loading models next to an installed flash-attn, for
tests/test_broken_flash.py (CPU) and tests/gpu/test_broken_flash_gpu.py.

    python broken_flash_worker.py make ROOT
    python broken_flash_worker.py run ROOT OUT [--guarded] [--standin-cuda] [--device DEV]
                                               [--dtype DTYPE] [--impls I,J] [--families F,G]

``make`` saves the seeded float32 checkpoints of tests/workers/semantics_worker.py (Llama, Qwen2,
Mistral with a sliding window, Gemma 2 with softcapping) and a ModernBERT (masked LM) with the
transformers of this process.

``run`` is the program: ``import attnguard`` first when ``--guarded`` (ATTNGUARD_LOG from the
environment), then for each family and ``attn_implementation``
``AutoModelForCausalLM.from_pretrained(path, attn_implementation=impl[, dtype][, device_map])``
and the logits of a left-padded batch and of a packed row (position_ids restarting at 0), or the
error the load or the forward raised (type and first line). ``--standin-cuda`` makes this CPU
process look like a CUDA machine to transformers' flash-attn availability check
(``torch.cuda.is_available = lambda: True``, ``torch.version.cuda = "13.0"``, set before
transformers is imported): on a CPU machine that check says no, so transformers never imports
flash-attn, broken or not. Whatever flash-attn is importable comes from PYTHONPATH.

OUT is a ``torch.save`` dict ``{"meta": ..., "loads": {family: {impl: {...}}}}`` with tensors on
the CPU in float32; ``meta`` says which transformers ran, where ``flash_attn`` would be imported
from, which flash-attn modules the program imported, and (guarded) every event at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
import semantics_worker  # noqa: E402  (the same checkpoints and inputs as the semantics tests)
from helpers.processes import first_line  # noqa: E402

# the decoders of the semantics tests, and ModernBERT: its model file imports flash-attn's layers
# at module import on 4.49-5.0
FAMILIES = (*semantics_worker.FAMILIES, "modernbert")
IMPLS = ("sdpa", "eager", "flash_attention_2")


def make(root: Path) -> None:
    import torch
    import transformers

    semantics_worker.make(root)
    config = transformers.ModernBertConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
        global_attn_every_n_layers=2,
        local_attention=8,
        reference_compile=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForMaskedLM.from_config(config).save_pretrained(root / "modernbert")


def flash_modules() -> list[str]:
    return sorted(m for m in sys.modules if m.split(".")[0].startswith("flash_attn"))


def load_and_run(path: Path, impl: str, device: str, dtype: str | None) -> dict[str, Any]:
    import torch
    import transformers

    kwargs: dict[str, Any] = {"attn_implementation": impl}
    if dtype is not None:
        new = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (4, 56)
        kwargs["dtype" if new else "torch_dtype"] = getattr(torch, dtype)
    if device != "cpu":
        kwargs["device_map"] = device
    encoder = path.name == "modernbert"
    auto = transformers.AutoModelForMaskedLM if encoder else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(path, **kwargs).eval()
    p = next(model.parameters())
    rec: dict[str, Any] = {
        "attn_implementation": model.config._attn_implementation,
        "param_dtype": str(p.dtype),
        "param_device": str(p.device),
    }
    with torch.no_grad():
        ids, mask = semantics_worker.padded_batch()
        out = model(input_ids=ids.to(p.device), attention_mask=mask.to(p.device), use_cache=False)
        rec["logits_padded"] = out.logits.float().cpu()
        rec["padded_mask"] = mask
        if encoder:  # packed rows are a decoder's question
            return rec
        ids, pos = semantics_worker.packed_row()
        out = model(input_ids=ids.to(p.device), position_ids=pos.to(p.device), use_cache=False)
        rec["logits_packed"] = out.logits.float().cpu()
    return rec


def record_flash_imports() -> set[str]:
    """The flash-attn modules whose code is loaded from now on, by any kind of import (an audit
    hook on the files Python opens: ``find_spec`` and metadata reads open no module file)."""
    loaded: set[str] = set()

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event != "open" or not isinstance(args[0], str) or ".dist-info" in args[0]:
            return
        parts = Path(args[0]).parts
        if "attnguard" in parts:  # attnguard's own flash-attn integration, not flash-attn
            return
        roots = [i for i, p in enumerate(parts) if p.startswith("flash_attn")]
        if not roots:
            return
        names = [p for p in parts[roots[0] :] if p != "__pycache__"]
        names[-1] = names[-1].split(".")[0]  # flash_attn_interface.cpython-311.pyc, .py, .so
        loaded.add(".".join(n for n in names if n != "__init__"))

    sys.addaudithook(hook)
    return loaded


def run(ns: argparse.Namespace) -> int:
    tried = record_flash_imports()
    import torch

    if ns.standin_cuda:
        torch.cuda.is_available = lambda: True
        torch.version.cuda = "13.0"
    with contextlib.ExitStack() as stack:
        events = None
        seen: list[dict[str, Any]] = []
        if ns.guarded:
            import attnguard  # noqa: F401  (first: importing activates the guard)
            from attnguard.observability import events

            seen = stack.enter_context(events.capture())  # the whole run's events
        spec = importlib.util.find_spec("flash_attn")
        import transformers

        meta: dict[str, Any] = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "guarded": ns.guarded,
            "flash_attn_origin": spec.origin if spec is not None else None,
            "device": ns.device,
        }
        loads: dict[str, dict[str, Any]] = {}
        for family in ns.families.split(","):
            loads[family] = {}
            for impl in ns.impls.split(","):
                with contextlib.ExitStack() as one:
                    got: list[dict[str, Any]] = []
                    if events is not None:
                        events.reset_counts()  # each load reports as if it were the only one
                        got = one.enter_context(events.capture())
                    try:
                        rec = load_and_run(Path(ns.root) / family, impl, ns.device, ns.dtype)
                    except Exception as exc:
                        rec = {"error": first_line(exc)}
                rec["events"] = [
                    {k: e.get(k) for k in ("event", "site", "reason_code", "rule", "selected")}
                    for e in got
                    if e["event"] not in ("activated", "summary")
                ]
                loads[family][impl] = rec
        meta["flash_imports"] = sorted(tried)  # before the program's own import below
        meta["flash_modules"] = flash_modules()
        try:  # the program's own import, after transformers asked
            import flash_attn  # noqa: F401

            meta["own_import"] = "imported"
        except Exception as exc:
            meta["own_import"] = first_line(exc)
        meta["events"] = [
            {k: e.get(k) for k in ("event", "site", "reason_code", "reason", "package", "error")}
            for e in seen
            if e["event"] not in ("activated", "summary")
        ]
    torch.save({"meta": meta, "loads": loads}, ns.out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["make", "run"])
    ap.add_argument("root")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--guarded", action="store_true")
    ap.add_argument("--standin-cuda", action="store_true")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--impls", default=",".join(IMPLS))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ns = ap.parse_args()
    if ns.what == "make":
        make(Path(ns.root))
        return 0
    if ns.out is None:
        ap.error("run needs OUT")
    return run(ns)


if __name__ == "__main__":
    sys.exit(main())
