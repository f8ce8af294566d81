"""One shard of the model zoo on a GPU with the real flash-attn, guarded and unguarded, for
tests/gpu/test_zoo_gpu.py.

    python zoo_gpu_worker.py SHARD SHARDS OUT.jsonl ROOT

Every SHARDS-th zoo model (tests/workers/zoo.py), from SHARD on, is built tiny on the CPU, saved
in bf16, and loaded with ``from_pretrained(path, attn_implementation="flash_attention_2",
dtype=torch.bfloat16, device_map={"": DEVICE})``: first every model without attnguard, then every
model with it (``attnguard.activate()``), each run on its plain, left-padded and packed batches.
Where flash-attn's kernel runs, attnguard must change nothing: the same outputs, bit for bit (a
model whose own outputs differ between two unguarded runs is compared within that spread), or
the same error. One JSON line per model: ``{"model_type", "cls", "outcome", "detail"}`` with
outcome ``same``, ``differs`` or ``not_built``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for `workers`

import torch  # noqa: E402
import transformers  # noqa: E402
from workers import zoo  # noqa: E402

FLASH = "flash_attention_2"
DEVICE = os.environ.get("ZOO_DEVICE", "cuda:0")  # "cpu": a dry run of this script


def _on(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _error(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def outcome(entry: zoo.Entry, path: Path, plain: dict[str, Any]) -> dict[str, Any]:
    """The load's error, or each batch's output (CPU float32) or error."""
    try:
        model = entry.cls.from_pretrained(
            path, attn_implementation=FLASH, dtype=torch.bfloat16, device_map={"": DEVICE}
        ).eval()
    except Exception as exc:
        return {"load": _error(exc)}
    out: dict[str, Any] = {}
    for name, inputs in zoo.batches(model, plain).items():
        try:
            out[name] = zoo.run(model, _on(inputs)).float().cpu()
        except Exception as exc:
            out[name] = _error(exc)
    del model
    return out


def _max_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x - y).abs().nan_to_num(nan=float("inf")).max().item() if x.numel() else 0.0


def same(a: dict[str, Any], b: dict[str, Any], noise: dict[str, float]) -> str:
    """ "" when ``a`` and ``b`` are the same outcome (outputs within twice the model's own
    run-to-run ``noise``, 0 for a deterministic model), else what differs."""
    if a.keys() != b.keys():
        return f"outcomes {sorted(a)} / {sorted(b)}"
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, str) or isinstance(y, str):
            if x != y:
                ran = "ran"
                return f"{name}: {x if isinstance(x, str) else ran} / {y if isinstance(y, str) else ran}"
            continue
        if x.shape != y.shape:
            return f"{name}: shapes {tuple(x.shape)} / {tuple(y.shape)}"
        diff, allowed = _max_diff(x, y), 2 * noise.get(name, 0.0)
        if diff > allowed:
            return f"{name}: max |guarded - unguarded| {diff:.3e} (run to run {noise.get(name, 0):.3e})"
    return ""


def main() -> None:
    shard, shards, out_file, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(max(1, int(os.environ.get("ZOO_THREADS", "2"))))
    import attnguard

    attnguard.deactivate()
    entries = zoo.entries()[shard::shards]
    built: dict[str, tuple[zoo.Entry, Path, dict[str, Any]]] = {}
    lines: list[dict[str, Any]] = []
    for entry in entries:
        try:
            model, plain = zoo.build(entry)
            zoo.randomise_special(model)
            path = Path(root) / entry.model_type
            model.to(torch.bfloat16).save_pretrained(path)
            built[entry.model_type] = (entry, path, plain)
        except Exception as exc:
            lines.append({"model_type": entry.model_type, "cls": entry.cls_name,
                          "outcome": "not_built", "detail": _error(exc)[:300]})  # fmt: skip
    unguarded = {t: outcome(*built[t]) for t in built}
    attnguard.activate(log="none")
    guarded = {t: outcome(*built[t]) for t in built}
    attnguard.deactivate()
    for t, (entry, path, plain) in built.items():
        detail = same(unguarded[t], guarded[t], {})
        if detail:  # the model's own run-to-run spread (atomics in MoE routing, ...)
            again = outcome(entry, path, plain)
            noise = {
                k: _max_diff(again[k], v)
                for k, v in unguarded[t].items()
                if isinstance(v, torch.Tensor) and isinstance(again.get(k), torch.Tensor)
            }
            detail = same(unguarded[t], guarded[t], noise)
        lines.append({"model_type": t, "cls": entry.cls_name,
                      "outcome": "differs" if detail else "same", "detail": detail})  # fmt: skip
    with open(out_file, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
