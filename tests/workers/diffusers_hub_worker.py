"""diffusers' ``*_hub`` attention backends as a user's program meets them, for
tests/test_diffusers_hub.py (and tests/gpu/test_diffusers_hub_gpu.py with ``--device cuda``).

    python diffusers_hub_worker.py {plain|guarded} OUT --backends a,b [--device D] [--dtype T]

One program: ``guarded`` imports attnguard first, ``plain`` never does. The environment decides
what the kernel hub offers (the ``kernels`` package on the path or not, ``HF_HUB_OFFLINE``, an
empty ``HF_HOME``, ``LOCAL_KERNELS`` stand-ins written by tests/standins/hub_kernel.py that count
their calls in ``$HUB_STANDIN_CALLS``). A tiny Flux transformer (tests/workers/diffusers_worker.py)
runs on diffusers' ``native`` backend, then on each backend in turn (``set_attention_backend``):
per backend the error (type and first line) or the largest difference from ``native``, the calls
made into the stand-in hub kernels, and (guarded) the events attnguard emitted; each output is
saved to ``OUT/<mode>-<backend>.pt`` (float32, CPU; ``native``'s too) for comparisons across
programs. Then, as a custom processor would, one ``dispatch_attention_fn`` call with q/k in
float32 and v in bfloat16 on that backend (``mixed``: its error, or the output's dtype, and the
events). One JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

FIELDS = ("event", "site", "reason_code", "rule", "requested", "hub_kernel", "applied", "reason")


def _calls() -> list[str]:
    path = Path(os.environ.get("HUB_STANDIN_CALLS", "/nonexistent"))
    return path.read_text().split() if path.exists() else []


def _mixed(torch: Any, backend: str, device: str, captured: list[dict[str, Any]]) -> dict[str, Any]:
    """One call with q/k float32 and v bfloat16 straight into the dispatcher, on ``backend``."""
    from diffusers.models.attention_dispatch import AttentionBackendName, dispatch_attention_fn

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=g).to(device) for _ in range(3))
    seen, record = len(captured), {}
    try:
        out = dispatch_attention_fn(q, k, v.bfloat16(), backend=AttentionBackendName(backend))
        record["dtype"] = str(out.dtype)
    except Exception as exc:
        record["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
    record["events"] = [(e["event"], e.get("reason_code")) for e in captured[seen:]]
    return record


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("plain", "guarded"))
    p.add_argument("out")
    p.add_argument("--backends", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    args = p.parse_args()
    logging.disable(logging.CRITICAL)  # diffusers' warnings and its "error occurred" log
    captured: list[dict[str, Any]] = []
    if args.mode == "guarded":
        import attnguard
        from attnguard.observability import events

        attnguard.activate(log="none")
        stack = events.capture()  # held: the capture lasts while the program runs
        captured = stack.__enter__()
    import torch
    from diffusers_worker import flux_inputs, run, tiny_flux

    out_dir = Path(args.out)
    dtype = getattr(torch, args.dtype)
    model = tiny_flux().to(args.device, dtype)
    inputs = flux_inputs(args.device, dtype)
    native = run(model, inputs)
    torch.save(native, out_dir / f"{args.mode}-native.pt")
    result: dict[str, Any] = {"backends": {}}
    try:
        import kernels

        result["kernels"] = kernels.__version__
    except Exception as exc:
        result["kernels"] = f"{type(exc).__name__}: {exc}"[:200]
    for backend in args.backends.split(","):
        before, seen = len(_calls()), len(captured)
        record: dict[str, Any] = {}
        try:
            model.set_attention_backend(backend)
            got = run(model, inputs)
            record["max_diff"] = (got - native).abs().max().item()
            torch.save(got, out_dir / f"{args.mode}-{backend}.pt")
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        record["calls"] = _calls()[before:]
        record["events"] = [
            {k: e.get(k) for k in FIELDS} for e in captured[seen:] if e["event"] != "activated"
        ]
        record["mixed"] = _mixed(torch, backend, args.device, captured)
        result["backends"][backend] = record
    print(json.dumps(result))


if __name__ == "__main__":
    main()
