"""One shard of the model zoo on a GPU with the real flash-attn, guarded and unguarded, for
tests/gpu/test_zoo_gpu.py.

    python zoo_gpu_worker.py SHARD SHARDS OUT.jsonl ROOT [START]

Every SHARDS-th zoo model (tests/workers/zoo.py), from SHARD on (and from the START-th of those),
is built tiny on the CPU, saved in bf16, and loaded with ``from_pretrained(path,
attn_implementation="flash_attention_2", dtype=torch.bfloat16, device_map={"": DEVICE})``, first
without attnguard and then with it (``attnguard.activate()``), each run on its plain, left-padded
and packed batches. Where flash-attn's kernel runs, attnguard must change nothing: the same
outputs, bit for bit (a model whose own outputs differ between two unguarded runs is compared
within that spread), or the same error. One JSON line per model, appended as it is checked:
``{"model_type", "cls", "outcome", "detail", "index", "poisoned"}`` with outcome ``same``,
``differs``, ``remedied`` (transformers refused the load, attnguard ran the model) or
``not_built``. A model whose own code trips a device-side assert leaves the process's CUDA
context unusable: the worker exits with status 3 after its line (run with CUDA_LAUNCH_BLOCKING=1
so the assert is the model's that caused it) and the test goes on in a fresh worker; where the
unguarded run did that, the line says ``"pending"`` and the fresh worker runs the guarded half.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for `workers`

import torch  # noqa: E402
import transformers  # noqa: E402
from workers import zoo  # noqa: E402

FLASH = "flash_attention_2"
POISONED = 3  # exit status: CUDA unusable in this process, go on in a fresh one
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
        errors = [f"{k}: {v}" for o in (a, b) for k, v in o.items() if isinstance(v, str)]
        return f"outcomes {sorted(a)} / {sorted(b)} ({'; '.join(errors)[:400]})"
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


def _poisoned(*outcomes: dict[str, Any]) -> bool:
    """True once this process's CUDA context is unusable (a device-side assert in a model's own
    code): every later load would fail, so the test goes on in a fresh worker."""
    if any("CUDA error" in v for o in outcomes for v in o.values() if isinstance(v, str)):
        return True
    if not DEVICE.startswith("cuda"):
        return False
    try:
        torch.cuda.synchronize()
    except Exception:
        return True
    return False


def check(entry: zoo.Entry, root: str) -> tuple[dict[str, Any] | None, bool]:
    """One model, unguarded then guarded: its JSON line (None while its guarded half waits for a
    fresh process), and whether CUDA is now unusable. Where the unguarded run leaves CUDA
    unusable, its outcome is kept in ROOT and the guarded half runs in the next worker."""
    import attnguard

    path = Path(root) / entry.model_type
    kept = Path(root) / f"{entry.model_type}.unguarded.pt"
    plain: dict[str, Any] = {}
    if kept.exists():
        unguarded, plain = torch.load(kept, weights_only=False)
        kept.unlink()
    else:
        try:
            model, plain = zoo.build(entry)
            zoo.randomise_special(model)
            model.to(torch.bfloat16).save_pretrained(path)
            del model
        except Exception as exc:
            line = {"outcome": "not_built", "detail": _error(exc)[:300]}
            return {"model_type": entry.model_type, "cls": entry.cls_name, **line}, False
        unguarded = outcome(entry, path, plain)
        if _poisoned(unguarded):
            torch.save((unguarded, plain), kept)
            return None, True
    attnguard.activate(log="none")
    try:
        guarded = outcome(entry, path, plain)
    finally:
        attnguard.deactivate()
    poisoned = _poisoned(guarded)
    detail = same(unguarded, guarded, {})
    if detail and not poisoned:  # the model's own run-to-run spread (atomics in MoE routing, ...)
        again = outcome(entry, path, plain)
        noise = {
            k: _max_diff(again[k], v)
            for k, v in unguarded.items()
            if isinstance(v, torch.Tensor) and isinstance(again.get(k), torch.Tensor)
        }
        detail = same(unguarded, guarded, noise)
        poisoned = _poisoned(again)
    shutil.rmtree(path, ignore_errors=True)
    if not detail:
        result = "same"
    elif "load" in unguarded and "load" not in guarded:
        # transformers refused the request at load, attnguard loaded the model on what it can
        # run: a remedy (the test checks what transformers refused), not a changed outcome
        result, detail = "remedied", f"unguarded load: {unguarded['load']}"
    else:
        result = "differs"
    line = {"model_type": entry.model_type, "cls": entry.cls_name, "outcome": result}
    return {**line, "detail": detail}, poisoned


def main() -> None:
    """Checks this shard's models from START on, one JSON line each (appended as it goes); exits
    with POISONED after a model that left CUDA unusable (the test starts a fresh worker)."""
    shard, shards, out_file, root = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    start = int(sys.argv[5]) if len(sys.argv) > 5 else 0
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(max(1, int(os.environ.get("ZOO_THREADS", "2"))))
    import attnguard

    attnguard.deactivate()
    entries = zoo.entries()[shard::shards]
    for index in range(start, len(entries)):
        line, poisoned = check(entries[index], root)
        pending = {"pending": True} if line is None else line  # its guarded half: the next worker
        with open(out_file, "a", encoding="utf-8") as f:
            f.write(json.dumps({**pending, "index": index, "poisoned": poisoned}) + "\n")
        if poisoned:
            sys.exit(POISONED)


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
