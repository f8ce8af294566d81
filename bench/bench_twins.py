"""GPU benchmark: attnguard's twins against the real flash-attn kernel they replace, in ONE process.

A rescued job (flash-attn broken after a torch upgrade, missing, ...) runs transformers' flash code
path on attnguard's twins (attnguard/fallback). This measures, side by side in one process with
the real flash-attn 2.8.3 importable, the kernel and the twin on the same inputs, alternating
(A B, B A, ...) so clock drift and allocator state hit both alike:

* ``decode_call``: ``flash_attn_with_kvcache``, one new token (32/8 heads, head_dim 128, bf16),
  batch 1 and 8, context 1k and 8k: wall time per call (synchronised after each call) and host
  time per call (calls queued back to back, the time until each returns: what the CPU spends);
* ``deterministic``: forward+backward with ``deterministic=True`` on both sides (flash-attn's
  bitwise-reproducible backward; the twin on torch's flash kernel in its deterministic mode),
  dense 4 x 4096 and the two packs below; beside it the twin with ``deterministic=False`` vs
  ``True`` (what determinism costs the twin);
* ``varlen``: ``flash_attn_varlen_func`` on packed rows (bf16, causal, 32/8 heads, head_dim 128):
  64 sequences of 64-512 tokens and 8 sequences of 512-4096, forward and forward+backward;
* ``train``: a padding-free training step (forward, backward, AdamW) of a Qwen2-0.5B-shaped model
  (24 layers, bf16) on one packed row (position_ids restarting per sequence, as
  DataCollatorWithFlattening / TRL padding_free / verl use_remove_padding send it) through
  transformers' flash path: the real kernels vs the twins (switched in this process exactly as
  attnguard switches them when flash-attn's kernel cannot run: transformers' lazy kernel import
  answered with the twins);
* ``generate``: prefill (4 x 2048, no cache) and one decode step (batch 4, context 2048) through
  transformers' flash path, real kernels vs twins;
* ``decode_model``: one decode step of a 24-layer decoder whose attention calls
  ``flash_attn_with_kvcache`` directly (custom models), batch 1 and 8, context 1k and 8k, wall
  and host time per step;
* ``cpu`` (no GPU needed): on CPU, transformers' own sdpa against the flash path on the twins
  (attnguard active, flash-attn absent), forward and forward+backward, same weights.

Ratio = real kernel time / twin time (>= 1: the twin is at least as fast), median over rounds of
the per-round ratio [min, max]. Device and torch version are printed first.

    python bench/bench_twins.py [--parts decode_call,deterministic,decode_model,varlen,train,generate] [--rounds 5] [--iters 10]
    python bench/bench_twins.py --parts cpu
    python bench/bench_twins.py --dry-run   # every GPU part's code on CPU, tiny shapes, no timing worth reading

``--dry-run`` runs the parts decode_call, deterministic, decode_model and varlen on CPU with tiny
shapes, attnguard's twins standing in for the real kernel: it checks the script, not the speed.

The parts with a model (``train``, ``generate``, ``decode_model``) are in bench/_twins_models.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("ATTNGUARD_LOG", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# the parts this numbers come from first: the suite stops the script at its time limit
GPU_PARTS = ("decode_call", "deterministic", "decode_model", "varlen", "train", "generate")
DRY_PARTS = ("decode_call", "deterministic", "decode_model", "varlen")
DEV = "cuda"  # "cpu" with --dry-run
DRY = False


def sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


# --- timing --------------------------------------------------------------------------------------


def gpu_ms(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median ms of ``iters`` calls (CUDA events) after ``warmup`` calls."""
    import torch

    if DEV != "cuda":
        return wall_ms(fn, iters, warmup)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(True), torch.cuda.Event(True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def wall_ms(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median wall ms per call (with a GPU: synchronised), for host-bound work."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def host_us(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Host µs per call: ``iters`` calls queued back to back, the time until the last returns,
    divided by ``iters`` (synchronised before and after, not in between). What the CPU spends
    per call while the GPU keeps up (where the GPU is slower, the queue fills and this becomes
    the GPU's time per call)."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        times.append((time.perf_counter() - t) / iters * 1e6)
        sync()
    return statistics.median(times)


def ab(
    real: Callable[[], Any],
    twin: Callable[[], Any],
    rounds: int,
    iters: int,
    timer: Callable[..., float] = gpu_ms,
) -> dict[str, Any]:
    """Alternating rounds; returns medians and the median per-round ratio real / twin."""
    r_ms, t_ms, ratios = [], [], []
    for i in range(rounds):
        got = {}
        for name in ("real", "twin") if i % 2 == 0 else ("twin", "real"):
            got[name] = timer(real if name == "real" else twin, iters)
        r_ms.append(got["real"])
        t_ms.append(got["twin"])
        ratios.append(got["real"] / got["twin"])
    return {
        "real_ms": statistics.median(r_ms),
        "twin_ms": statistics.median(t_ms),
        "ratio": statistics.median(ratios),
        "range": [min(ratios), max(ratios)],
    }


def row(name: str, res: dict[str, Any]) -> str:
    lo, hi = res["range"]
    return (
        f"| {name} | {res['real_ms']:.3f} | {res['twin_ms']:.3f} | "
        f"{res['ratio']:.3f} [{lo:.3f}, {hi:.3f}] |"
    )


# --- kernels -------------------------------------------------------------------------------------


def real_flash() -> Any:
    """flash-attn's functions; with --dry-run attnguard's twins stand in (on CPU)."""
    if DRY:
        from attnguard import fallback

        return fallback
    import flash_attn.flash_attn_interface as fi

    return fi


def pack(lens: list[int], h: int, hk: int, d: int, seed: int = 0) -> tuple[Any, ...]:
    import torch

    g = torch.Generator(device=DEV).manual_seed(seed)
    total = sum(lens)

    def t(*shape: int) -> Any:
        return torch.randn(*shape, device=DEV, generator=g, dtype=torch.bfloat16)

    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = t(total, h, d), t(total, hk, d), t(total, hk, d)
    return q, k, v, cu.to(DEV), max(lens), t(total, h, d)


def lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randint(lo, hi) for _ in range(n)]


PACKS = {
    "64 x 64-512": (64, 64, 512),
    "8 x 512-4096": (8, 512, 4096),
}
HEADS = (32, 8, 128)  # query heads, kv heads, head_dim of the kernel rows
DECODE_SHAPES = [(1, 1024), (1, 8192), (8, 1024), (8, 8192)]  # (batch, context)
DENSE_SHAPES = {"dense 4 x 4096": (4, 4096)}
# the custom model of decode_model: layers, hidden, heads, kv heads, head_dim (Qwen2-0.5B-like)
DECODER = (24, 896, 14, 2, 64)


def tiny_shapes() -> None:
    """--dry-run: shapes a CPU computes in a moment."""
    global HEADS, DECODE_SHAPES, DENSE_SHAPES, DECODER
    PACKS.clear()
    PACKS.update({"4 x 8-32": (4, 8, 32)})
    HEADS = (4, 2, 16)
    DECODE_SHAPES = [(1, 32), (2, 48)]
    DENSE_SHAPES = {"dense 2 x 64": (2, 64)}
    DECODER = (2, 64, 4, 2, 16)


def varlen_pair(f: Any, lens: list[int]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward, forward+backward) of ``f`` on one bf16 pack: causal, 32/8 heads, head_dim 128."""
    import torch

    q, k, v, cu, mx, g = pack(lens, *HEADS)
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def fwd() -> Any:
        with torch.no_grad():
            return f(q, k, v, cu, cu, mx, mx, causal=True)

    def fwd_bwd() -> Any:
        out = f(qg, kg, vg, cu, cu, mx, mx, causal=True)
        return torch.autograd.grad(out, (qg, kg, vg), g)

    return fwd, fwd_bwd


def part_varlen(args: argparse.Namespace) -> list[str]:
    from attnguard import fallback

    fi = real_flash()
    lines = []
    for name, (n, lo, hi) in PACKS.items():
        lens = lengths(n, lo, hi, seed=n)
        real_f, real_fb = varlen_pair(fi.flash_attn_varlen_func, lens)
        twin_f, twin_fb = varlen_pair(fallback.flash_attn_varlen_func, lens)
        diff = (real_f() - twin_f()).abs().max().item()
        label = f"varlen {name} ({sum(lens)} tokens)"
        lines.append(row(f"{label} fwd", ab(real_f, twin_f, args.rounds, args.iters)))
        lines.append(row(f"{label} fwd+bwd", ab(real_fb, twin_fb, args.rounds, args.iters)))
        lines.append(f"<!-- {label}: max |twin - kernel| out {diff:.4g} -->")
    return lines


def decode_inputs(b: int, ctx: int) -> tuple[Any, ...]:
    import torch

    h, hk, d = HEADS
    g = torch.Generator(device=DEV).manual_seed(b * ctx)
    cap = ctx + 64

    def t(*shape: int) -> Any:
        return torch.randn(*shape, device=DEV, generator=g, dtype=torch.bfloat16)

    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
    return (
        t(b, 1, h, d),
        t(b, cap, hk, d),
        t(b, cap, hk, d),
        t(b, 1, hk, d),
        t(b, 1, hk, d),
        seqlens,
    )


def kvcache_call(f: Any, b: int, ctx: int) -> tuple[Callable[[], Any], tuple[Any, ...]]:
    """One decode step's call of ``f`` (the new token written at ``ctx`` each time), and its
    inputs (the caches it writes)."""
    inputs = decode_inputs(b, ctx)
    q, kc, vc, kn, vn, sl = inputs
    return (lambda: f(q, kc, vc, kn, vn, cache_seqlens=sl, causal=True)), inputs


def part_decode_call(args: argparse.Namespace) -> list[str]:
    from attnguard import fallback

    fi = real_flash()
    lines = []
    for b, ctx in DECODE_SHAPES:
        real, real_in = kvcache_call(fi.flash_attn_with_kvcache, b, ctx)
        twin, twin_in = kvcache_call(fallback.flash_attn_with_kvcache, b, ctx)
        diff = (real() - twin()).abs().max().item()
        caches = all(a.equal(c) for a, c in zip(real_in[1:3], twin_in[1:3], strict=True))
        iters = args.iters * 10
        wall = ab(real, twin, args.rounds, iters, timer=wall_ms)
        host = ab(real, twin, args.rounds, iters, timer=host_us)
        label = f"flash_attn_with_kvcache B{b} ctx {ctx}"
        lines.append(row(f"{label} (wall ms per call)", wall))
        lines.append(row(f"{label} (host µs per call, calls queued)", host))
        lines.append(f"<!-- {label}: max |twin - kernel| out {diff:.4g}, caches equal {caches} -->")
    return lines


# --- deterministic=True ------------------------------------------------------------------------


def dense_fwd_bwd(f: Any, b: int, s: int, deterministic: bool) -> Callable[[], Any]:
    """forward+backward of ``f`` (flash_attn_func) on one bf16 batch: causal, HEADS."""
    import torch

    h, hk, d = HEADS
    g = torch.Generator(device=DEV).manual_seed(b * s)

    def t(*shape: int) -> Any:
        return torch.randn(*shape, device=DEV, generator=g, dtype=torch.bfloat16)

    q, k, v = (t(b, s, n, d).requires_grad_() for n in (h, hk, hk))
    grad = t(b, s, h, d)

    def run() -> Any:
        out = f(q, k, v, causal=True, deterministic=deterministic)
        return out, *torch.autograd.grad(out, (q, k, v), grad)

    return run


def varlen_fwd_bwd(f: Any, lens: list[int], deterministic: bool) -> Callable[[], Any]:
    import torch

    q, k, v, cu, mx, grad = pack(lens, *HEADS)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def run() -> Any:
        out = f(q, k, v, cu, cu, mx, mx, causal=True, deterministic=deterministic)
        return out, *torch.autograd.grad(out, (q, k, v), grad)

    return run


def part_deterministic(args: argparse.Namespace) -> list[str]:
    """deterministic=True on both sides; beside it what determinism costs the twin."""
    from attnguard import fallback

    fi = real_flash()
    cases: dict[str, Callable[[Any, bool], Callable[[], Any]]] = {}
    for name, (b, s) in DENSE_SHAPES.items():
        cases[name] = lambda mod, det, b=b, s=s: dense_fwd_bwd(mod.flash_attn_func, b, s, det)
    for name, (n, lo, hi) in PACKS.items():
        lens = lengths(n, lo, hi, seed=n)
        cases[f"varlen {name} ({sum(lens)} tokens)"] = lambda mod, det, lens=lens: varlen_fwd_bwd(
            mod.flash_attn_varlen_func, lens, det
        )
    lines = []
    iters = max(3, args.iters // 2)
    for name, make in cases.items():
        real, twin, twin_free = make(fi, True), make(fallback, True), make(fallback, False)
        got, ref = twin(), real()
        diffs = ", ".join(
            f"{n} {(a.float() - b.float()).abs().max().item():.3g}"
            for n, a, b in zip(("out", "dq", "dk", "dv"), got, ref, strict=True)
        )
        again = twin()
        same = all(a.equal(b) for a, b in zip(got, again, strict=True))
        lines.append(row(f"{name} fwd+bwd, deterministic=True", ab(real, twin, args.rounds, iters)))
        lines.append(
            row(
                f"{name} fwd+bwd, the twin: deterministic=False (left) vs True (right)",
                ab(twin_free, twin, args.rounds, iters),
            )
        )
        lines.append(f"<!-- {name}: max |twin - kernel| {diffs}; twin repeated bitwise: {same} -->")
    return lines


# --- CPU ------------------------------------------------------------------------------------------


def part_cpu(args: argparse.Namespace) -> list[str]:
    """On CPU: transformers' sdpa vs the flash path on the twins (attnguard active, flash-attn
    absent), same weights, forward and forward+backward."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    import attnguard

    cfg = LlamaConfig(
        vocab_size=1000,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        LlamaForCausalLM(cfg).save_pretrained(tmp)
        sdpa = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="sdpa")
        attnguard.activate(log="none")
        twins = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="flash_attention_2")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 1000, (2, 256), generator=g)
        mask = torch.ones_like(ids)
        mask[0, :40] = 0
        lens = [37, 100, 64, 55]
        packed = {
            "input_ids": torch.randint(3, 1000, (1, sum(lens)), generator=g),
            "position_ids": torch.cat([torch.arange(n) for n in lens]).unsqueeze(0),
        }
        cases = {
            "batch 2 x 256, forward": ({"input_ids": ids}, False),
            "padded batch 2 x 256, forward": ({"input_ids": ids, "attention_mask": mask}, False),
            "padded batch 2 x 256, forward+backward": (
                {"input_ids": ids, "attention_mask": mask},
                True,
            ),
            "packed row (4 sequences, 256 tokens), forward": (packed, False),
        }
        for name, (inputs, backward) in cases.items():

            def run(model: Any, inputs: Any = inputs, backward: bool = backward) -> Callable:
                def go() -> Any:
                    if backward:
                        model(**inputs, labels=inputs["input_ids"]).loss.backward()
                    else:
                        with torch.no_grad():
                            model(**inputs)

                return go

            res = ab(run(sdpa), run(twins), args.rounds, max(3, args.iters // 4), timer=wall_ms)
            lines.append(row(f"CPU {name} (transformers sdpa vs twins, wall ms)", res))
        attnguard.deactivate()
    return lines


def main() -> int:
    global DEV, DRY
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="the GPU parts' code on CPU, tiny")
    ap.add_argument("--smoke", action="store_true", help="CI: --dry-run, one short round")
    args = ap.parse_args()
    if args.smoke:
        args.dry_run, args.rounds, args.iters = True, 1, 1
    if args.dry_run:
        DEV, DRY = "cpu", True
        tiny_shapes()
        args.rounds, args.iters = min(args.rounds, 2), min(args.iters, 2)
    default = DRY_PARTS if DRY else GPU_PARTS
    parts = [p.strip() for p in (args.parts or ",".join(default)).split(",") if p.strip()]
    if DRY and set(parts) - set(DRY_PARTS):
        print(f"bench_twins: --dry-run runs {', '.join(DRY_PARTS)} only")
        return 2
    import platform

    import torch
    import transformers

    import attnguard

    attnguard.deactivate()  # importing it activated it; each part switches it on where it needs
    gpu = any(p in GPU_PARTS for p in parts) and not DRY
    if gpu and not torch.cuda.is_available():
        print("bench_twins: the GPU parts need a CUDA GPU")
        return 2
    device = torch.cuda.get_device_name(0) if gpu else platform.processor() or "CPU"
    print(f"device: {device}; torch {torch.__version__}; transformers {transformers.__version__}")
    if gpu:
        import flash_attn

        print(f"flash-attn {flash_attn.__version__} (the real kernel)")
    if DRY:
        print(
            "DRY RUN on CPU: the twins stand in for the real kernel; no timing here means anything"
        )
    print(f"rounds {args.rounds}, iters {args.iters}; ratio = real (or sdpa) time / twin time")
    print("| measured | real ms | twin ms | ratio [min, max] |")
    print("|---|---|---|---|")
    import _twins_models as models

    table = {
        "varlen": part_varlen,
        "decode_call": part_decode_call,
        "deterministic": part_deterministic,
        "train": models.part_train,
        "generate": models.part_generate,
        "decode_model": models.part_decode_model,
        "cpu": part_cpu,
    }
    results = {}
    for p in parts:
        try:
            lines = table[p](args)
        except Exception as exc:  # report and go on with the other parts
            lines = [f"| {p} | error: {type(exc).__name__}: {str(exc)[:300]} | | |"]
        results[p] = lines
        for line in lines:
            print(line, flush=True)
    print(json.dumps(results))
    if args.smoke:
        import _smoke

        for p, lines in results.items():
            if any(f"| {p} | error:" in line for line in lines):
                return 1
            _smoke.ran(f"{p} (--dry-run: the twins stand in for the real kernel, on the CPU)")
        # train and generate need the GPU; the switch between the kernels they time runs here
        with models.kernels_switch() as use:
            use("twins")
            use("real")
        _smoke.ran("train and generate's switch between flash-attn and the twins")
        for p in sorted(set(GPU_PARTS) - set(DRY_PARTS)):
            _smoke.skipped(p, "needs a CUDA GPU and the real flash-attn")
        return _smoke.done()
    return 0


if __name__ == "__main__":
    # _twins_models reads the settings main() sets (DEV, the shapes) from bench_twins: this script
    sys.modules["bench_twins"] = sys.modules[__name__]
    sys.exit(main())
