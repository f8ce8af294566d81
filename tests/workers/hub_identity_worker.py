"""A hub kernel known by what it is, not by its name, for tests/test_hub_identity.py.

    python hub_identity_worker.py make ROOT
    python hub_identity_worker.py run {plain|guarded} ROOT OUT SCENARIO

``make`` saves a seeded float32 Llama. ``run`` is one program (``guarded`` imports attnguard first,
``plain`` never does) running one scenario, with the stand-in hub kernels of
tests/standins/hub_kernel.py served through ``LOCAL_KERNELS`` (set by the test):

* ``own``: ``attn_implementation="kernels-community/flash-local"``, a hub kernel whose repo name
  has "flash" in it and which ships its own attention function (local attention over sdpa's
  4-D masks): its logits on a plain, a left-padded and a packed batch;
* ``retry``: ``kernels-community/flash-attn2`` cannot load (no build for this system), then its
  build appears (a network blip over), transformers' loader of attention hub kernels is called
  again (as transformers 5.23 and later call it at the next load) and the program loads the model
  again: what the loader returned, what serves the second model, the calls into the hub kernel;
* ``fresh``: the same hub kernel, its build there from the start.

Writes the logits to ``OUT/<mode>-<scenario>.pt``; one JSON object on the last line of stdout
(the attention implementation each load ended with, its error, the calls into the stand-in, the
events attnguard emitted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hub_worker beside this file
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.models import save_tiny  # noqa: E402
from helpers.packages import hub_standin  # noqa: E402
from helpers.processes import first_line  # noqa: E402
from hub_worker import _batches  # noqa: E402  (the same batches as the hub tests)


def _logits(torch: Any, model: Any) -> dict[str, Any]:
    b = _batches(torch, "cpu")
    ids, mask, packed, positions = b["ids"], b["mask"], b["packed"], b["positions"]
    with torch.no_grad():
        return {
            "plain": model(input_ids=ids).logits,
            "padded": model(input_ids=ids, attention_mask=mask).logits[mask.bool()],
            "packed": model(input_ids=packed, position_ids=positions, use_cache=False).logits,
        }


def make(root: Path) -> None:
    save_tiny(root / "llama", max_position_embeddings=256)


def _calls(path: str) -> list[str]:
    return Path(path).read_text().split() if path and Path(path).exists() else []


def run(mode: str, root: Path, out: Path, scenario: str) -> dict[str, Any]:
    captured: list[dict[str, Any]] = []
    if mode == "guarded":
        import attnguard
        from attnguard.observability import events

        attnguard.activate(log="none")
        capture = events.capture()  # held: the capture ends when its context is collected
        captured = capture.__enter__()
    import torch
    import transformers

    calls = os.environ.get("HUB_STANDIN_CALLS", "")
    cls = transformers.LlamaForCausalLM
    result: dict[str, Any] = {"loads": []}
    logits: dict[str, Any] = {}
    name = "kernels-community/flash-local" if scenario == "own" else "kernels-community/flash-attn2"
    if scenario == "fresh":
        hub_standin().write_repo(Path(os.environ["RETRY_REPO"]))
    attempts = 2 if scenario == "retry" else 1
    for attempt in range(attempts):
        load: dict[str, Any] = {}
        if attempt == 1:  # the build is there now, and the library tries again
            hub_standin().write_repo(Path(os.environ["RETRY_REPO"]))
            from transformers.integrations import hub_kernels

            try:
                kernel = hub_kernels.load_and_register_attn_kernel(name)
                load["loader_returned"] = getattr(kernel, "IS_ATTNGUARD_STANDIN", False)
            except Exception as exc:
                load["loader_error"] = first_line(exc)
        before = len(_calls(calls))
        try:
            model = cls.from_pretrained(root / "llama", attn_implementation=name)
            load["attn"] = model.config._attn_implementation
            logits = _logits(torch, model)
        except Exception as exc:
            load["error"] = first_line(exc)
        load["calls"] = sorted(set(_calls(calls)[before:]))
        result["loads"].append(load)
    torch.save(logits, out / f"{mode}-{scenario}.pt")
    result["events"] = [
        {k: e.get(k) for k in ("event", "reason_code", "rule", "reason", "site")}
        for e in captured
        if e["event"] != "activated"
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("make").add_argument("root", type=Path)
    r = sub.add_parser("run")
    r.add_argument("mode", choices=("plain", "guarded"))
    r.add_argument("root", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("scenario", choices=("own", "retry", "fresh"))
    args = parser.parse_args()
    if args.command == "make":
        make(args.root)
        return
    print(json.dumps(run(args.mode, args.root, args.out, args.scenario)))


if __name__ == "__main__":
    main()
