"""GPU benchmark: forward throughput of a Qwen2-0.5B-shaped model (random weights, bf16, sdpa)
with the call-time guard active vs not, eager and torch.compile'd, prefill and decode.

* prefill: one forward over ``--prefill`` tokens (batch 1), tokens/s;
* decode: one-token forwards against a KV cache of ``--prefill`` tokens (batch ``--decode-batch``),
  the cache cropped back after each step so every step sees the same length, steps/s.

Guarded and unguarded runs alternate in rounds (A B, B A, A B, ...) so clock and thermal drift
and order effects hit both alike. Throughputs are medians over rounds; "ratio" (guarded /
unguarded throughput; the target is >= 0.99) is the median of the per-round ratios. The guard is
switched with attnguard.activate()/deactivate(), which patch and restore the attention registry;
compiled variants are compiled once per state (static shapes, so both get the same graphs).

Usage: PYTHONPATH=. python bench/bench_forward.py [--rounds 11] [--iters 30] [--no-compile]

``--smoke`` (CI): the same rounds on the CPU with a 2-layer model of width 64, eager only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import _smoke
import torch

os.environ.setdefault("ATTNGUARD_LOG", "none")  # importing attnguard activates it
import attnguard  # noqa: E402

DEV = "cuda"  # "cpu" with --smoke


def qwen2_05b_config(smoke: bool = False) -> Any:
    from transformers import Qwen2Config

    if smoke:
        size = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        return Qwen2Config(**size, num_attention_heads=4, num_key_value_heads=2)
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def build_model(smoke: bool = False) -> Any:
    from transformers import Qwen2ForCausalLM

    cfg = qwen2_05b_config(smoke)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Qwen2ForCausalLM(cfg)
    return model.to(torch.bfloat16).eval()


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call (CUDA-synchronised), after one warm-up call."""
    fn()
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def make_steps(model: Any, prefill: int, decode_batch: int) -> dict[str, Callable[[], Any]]:
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    g = torch.Generator(device=DEV).manual_seed(1)
    prompt = torch.randint(0, vocab, (1, prefill), device=DEV, generator=g)
    ctx = torch.randint(0, vocab, (decode_batch, prefill), device=DEV, generator=g)
    step_ids = torch.randint(0, vocab, (decode_batch, 1), device=DEV, generator=g)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ctx, past_key_values=cache, use_cache=True)
    position = torch.full((decode_batch, 1), prefill, device=DEV)

    def prefill_step() -> Any:
        with torch.no_grad():
            return model(input_ids=prompt, use_cache=False).logits

    def decode_step() -> Any:
        with torch.no_grad():
            out = model(
                input_ids=step_ids, past_key_values=cache, position_ids=position, use_cache=True
            ).logits
        cache.crop(-1)  # back to the same context length for the next step
        return out

    return {"prefill": prefill_step, "decode": decode_step}


def set_guard(on: bool) -> None:
    if on:
        attnguard.activate(log="none")
    else:
        attnguard.deactivate()


def run(opts: argparse.Namespace) -> None:
    model = build_model(opts.smoke)
    modes = ["eager", "compiled"] if opts.compile else ["eager"]
    rows = []
    for mode in modes:
        if mode == "compiled":
            torch._dynamo.reset()
            torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        steps: dict[bool, dict[str, Callable[[], Any]]] = {}
        for guarded in (True, False):
            set_guard(guarded)
            # dynamic=False: both states get the same static graphs, whatever compiled first
            target = torch.compile(model, dynamic=False) if mode == "compiled" else model
            steps[guarded] = make_steps(target, opts.prefill, opts.decode_batch)
            for fn in steps[guarded].values():  # compile / warm up outside the timed rounds
                fn()
                fn()
        results: dict[tuple[str, bool], list[float]] = {}
        for r in range(opts.rounds):
            for guarded in (True, False) if r % 2 == 0 else (False, True):
                set_guard(guarded)
                for name, fn in steps[guarded].items():
                    results.setdefault((name, guarded), []).append(timed(fn, opts.iters))
        for name, unit, scale in (("prefill", "tokens/s", opts.prefill), ("decode", "steps/s", 1)):
            gs, us = results[(name, True)], results[(name, False)]
            g, u = statistics.median(gs), statistics.median(us)
            # paired per round: both of a round ran back to back under the same conditions
            ratio = statistics.median(ut / gt for ut, gt in zip(us, gs, strict=True))
            rows.append((mode, name, unit, scale / u, scale / g, ratio))
            print(f"# {mode} {name}: ratio {ratio:.4f}", flush=True)
    attnguard.deactivate()
    dev = torch.cuda.get_device_name() if DEV == "cuda" else "CPU"
    shape = "a 2-layer model of width 64 (smoke)" if opts.smoke else "Qwen2-0.5B-shaped"
    print(
        f"device: {dev}, torch {torch.__version__}, transformers "
        f"{__import__('transformers').__version__}; {shape}, random weights, bf16, sdpa; "
        f"prefill {opts.prefill} tokens (batch 1), decode batch {opts.decode_batch} at context "
        f"{opts.prefill}; median of {opts.rounds} rounds x {opts.iters} iters"
    )
    print(f"{'mode':9s} {'phase':8s} {'unit':9s} {'unguarded':>11s} {'guarded':>11s} {'ratio':>7s}")
    for mode, name, unit, u, g, ratio in rows:
        print(f"{mode:9s} {name:8s} {unit:9s} {u:11.1f} {g:11.1f} {ratio:7.4f}")
        if opts.smoke:
            _smoke.ran(f"{mode} {name}, guarded and unguarded")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    ap.add_argument("--smoke", action="store_true", help="CI: tiny, on the CPU, eager only")
    opts = ap.parse_args()
    if opts.smoke:
        global DEV
        DEV = "cpu"
        opts.prefill, opts.decode_batch, opts.rounds, opts.iters = 16, 2, 2, 1
        opts.compile = False
        run(opts)
        _smoke.skipped("the Qwen2-0.5B shape on a CUDA GPU", "smoke size, on the CPU")
        _smoke.skipped("torch.compile'd rounds", "compiling takes minutes on a CPU")
        raise SystemExit(_smoke.done())
    if not torch.cuda.is_available():
        print("bench_forward: needs a CUDA GPU (--smoke runs a tiny CPU version)")
        raise SystemExit(2)
    run(opts)


if __name__ == "__main__":
    main()
