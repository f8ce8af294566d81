"""GPU benchmark: ``ATTNGUARD_KERNEL=fastest`` on vs off, in ONE process, real flash-attn installed.

A model loaded with ``attn_implementation="flash_attention_2"`` (bf16, on the GPU, the real
flash-attn 2.8.3 working) is timed with the switch off (every call on flash-attn: what the user
asked for) and on (each call bucket served by the fastest kernel that computes the same numbers,
measured on this GPU at its first call), alternating rounds so drift hits both alike:

* training step (forward, backward, AdamW) and prefill (one forward, no cache, last token's
  logits) of a Qwen2-0.5B-shaped model (24 layers, head_dim 64) at 4 x 4096, 1 x 16384 and
  1 x 32768 tokens;
* a padding-free training step on one packed row of 64 sequences of 64-512 tokens;
* a decode step (batch 4, context 2048);
* a 7B-shaped model (Qwen2-7B: head_dim 128, 28 heads / 4 kv heads) at 1 x 16384: prefill with
  all 28 layers, training step with 8 of them (the whole model's optimizer state does not fit).

Ratio = time off / time on (>= 1: the switch made it faster), median of per-round ratios
[min, max]. Each row starts with no decision (as a job of that shape would): the race's own
cost is paid in the first "on" round's warm-up; the ``kernel_selected`` events printed at the
end say which kernel won each bucket, and the candidates' times.

    python bench/bench_kernel.py [--rounds 3] [--iters 3] [--parts ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("ATTNGUARD_LOG", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_twins import ab, gpu_ms, lengths, packed_row, qwen2_05b, row  # noqa: E402

PARTS = ("dense", "packed", "decode", "7b")


def qwen2_7b(layers: int) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=152064,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=layers,
        num_attention_heads=28,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )


def build(cfg: Any) -> Any:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg._attn_implementation = "flash_attention_2"
    with torch.device("cuda"):
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16)


def switch(kernel: str) -> None:
    import attnguard

    attnguard.configure(kernel=kernel)


def modes(make: Callable[[], Callable[[], Any]]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(off, on): the same workload with the switch off and on."""
    work = make()

    def off() -> Any:
        switch("requested")
        return work()

    def on() -> Any:
        switch("fastest")
        return work()

    return off, on


def train_step(model: Any, opt: Any, batch: dict[str, Any]) -> Callable[[], Any]:
    def run() -> Any:
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return run


def prefill(model: Any, ids: Any) -> Callable[[], Any]:
    import torch

    def run() -> Any:
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False, logits_to_keep=1)

    return run


def measure(
    name: str, make: Callable[[], Callable[[], Any]], args: argparse.Namespace
) -> list[str]:
    import torch

    from attnguard.selection import decisions

    decisions.reset()  # each row decides afresh, as a job of that shape would (2 s budget each)
    try:
        off, on = modes(make)
        res = ab(off, on, args.rounds, args.iters, timer=gpu_ms)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return [f"| {name} | out of memory on this GPU | | |"]
    # ab() calls the first argument "real": here that is the switch off
    return [row(name, res)]


def dense_parts(args: argparse.Namespace) -> list[str]:
    import torch

    model = build(qwen2_05b(24))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay put
    lines = []
    g = torch.Generator(device="cuda").manual_seed(0)
    for b, s in ((4, 4096), (1, 16384), (1, 32768)):
        ids = torch.randint(3, 150000, (b, s), device="cuda", generator=g)
        batch = {"input_ids": ids, "labels": ids}
        model.train()
        lines += measure(
            f"training step {b} x {s}", lambda b_=batch: train_step(model, opt, b_), args
        )
        model.eval()
        lines += measure(f"prefill {b} x {s}", lambda i=ids: prefill(model, i), args)
        torch.cuda.empty_cache()
    return lines


def packed_part(args: argparse.Namespace) -> list[str]:
    import torch

    model = build(qwen2_05b(24)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    batch = packed_row(lengths(64, 64, 512, seed=164))
    n = batch["input_ids"].shape[1]
    lines = measure(
        f"training step, one packed row of 64 sequences ({n} tokens)",
        lambda: train_step(model, opt, batch),
        args,
    )
    return lines


def decode_part(args: argparse.Namespace) -> list[str]:
    import torch
    from transformers import DynamicCache

    model = build(qwen2_05b(24)).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, 150000, (4, 2048), device="cuda", generator=g)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)

    def make() -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
            cache.crop(2048)

        return run

    return measure("decode step, batch 4, context 2048", make, args)


def seven_b_prefill(args: argparse.Namespace) -> list[str]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, 150000, (1, 16384), device="cuda", generator=g)
    model = build(qwen2_7b(28)).eval()
    return measure("7B-shaped (28 layers) prefill 1 x 16384", lambda: prefill(model, ids), args)


def seven_b_train(args: argparse.Namespace) -> list[str]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, 150000, (1, 16384), device="cuda", generator=g)
    model = build(qwen2_7b(8)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    batch = {"input_ids": ids, "labels": ids}
    name = "7B-shaped (8 of 28 layers) training step 1 x 16384"
    return measure(name, lambda: train_step(model, opt, batch), args)


def seven_b_part(args: argparse.Namespace) -> list[str]:
    import torch

    lines = seven_b_prefill(args)
    torch.cuda.empty_cache()
    return lines + seven_b_train(args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench_kernel: needs a CUDA GPU")
        return 2
    import tempfile

    import flash_attn
    import transformers

    import attnguard
    from attnguard import events

    # a cache of its own: every decision is measured in this run, none read from an earlier one
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="attnguard-bench-cache-")
    attnguard.activate(log="none", kernel="requested")
    print(
        f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; transformers "
        f"{transformers.__version__}; flash-attn {flash_attn.__version__}"
    )
    print(f"rounds {args.rounds}, iters {args.iters}; ratio = time with the switch off / on")
    print("| measured | off ms | on ms | ratio [min, max] |")
    print("|---|---|---|---|")
    table = {"dense": dense_parts, "packed": packed_part, "decode": decode_part, "7b": seven_b_part}
    with events.capture() as seen:
        for part in [p.strip() for p in args.parts.split(",") if p.strip()]:
            try:
                lines = table[part](args)
            except Exception as exc:
                lines = [f"| {part} | error: {type(exc).__name__}: {str(exc)[:300]} | | |"]
            for line in lines:
                print(line, flush=True)
            torch.cuda.empty_cache()
    print("decisions (kernel_selected):")
    for e in seen:
        if e["event"] == "kernel_selected":
            times = {n: c.get("ms") for n, c in e["candidates"].items()}
            print(f"  {'/'.join(e['bucket'][:1] + e['bucket'][-6:])}: {e['selected']} {times}")
    print(json.dumps([e for e in seen if e["event"] == "kernel_selected"], default=str)[:20000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
