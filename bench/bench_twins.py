"""GPU benchmark: attnguard's twins against the real flash-attn kernel they replace, in ONE process.

A rescued job (flash-attn broken after a torch upgrade, missing, ...) runs transformers' flash code
path on attnguard's twins (attnguard/fallback). This measures, side by side in one process with
the real flash-attn 2.8.3 importable, the kernel and the twin on the same inputs, alternating
(A B, B A, ...) so clock drift and allocator state hit both alike:

* ``varlen``: ``flash_attn_varlen_func`` on packed rows (bf16, causal, 32/8 heads, head_dim 128):
  64 sequences of 64-512 tokens and 8 sequences of 512-4096, forward and forward+backward;
* ``decode_call``: ``flash_attn_with_kvcache``, one new token, batch 1 and 8, context 1k and 8k;
* ``train``: a padding-free training step (forward, backward, AdamW) of a Qwen2-0.5B-shaped model
  (24 layers, bf16) on one packed row (position_ids restarting per sequence, as
  DataCollatorWithFlattening / TRL padding_free / verl use_remove_padding send it) through
  transformers' flash path: the real kernels vs the twins (switched in this process exactly as
  attnguard switches them when flash-attn's kernel cannot run: transformers' lazy kernel import
  answered with the twins);
* ``generate``: prefill (4 x 2048, no cache) and one decode step (batch 4, context 2048) through
  transformers' flash path, real kernels vs twins;
* ``decode_model``: one decode step of a 24-layer decoder whose attention calls
  ``flash_attn_with_kvcache`` directly (custom models), batch 1 and 8, context 1k and 8k;
* ``cpu`` (no GPU needed): on CPU, transformers' own sdpa against the flash path on the twins
  (attnguard active, flash-attn absent), forward and forward+backward, same weights.

Ratio = real kernel time / twin time (>= 1: the twin is at least as fast), median over rounds of
the per-round ratio [min, max]. Device and torch version are printed first.

    python bench/bench_twins.py [--parts varlen,decode_call,train,generate,decode_model] [--rounds 5] [--iters 10]
    python bench/bench_twins.py --parts cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
os.environ.setdefault("ATTNGUARD_LOG", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench_fallback import qwen2_05b  # noqa: E402  (the Qwen2-0.5B shape every bench uses)

GPU_PARTS = ("varlen", "decode_call", "train", "generate", "decode_model")


# --- timing --------------------------------------------------------------------------------------


def gpu_ms(fn: Callable[[], Any], iters: int, warmup: int = 3) -> float:
    """Median ms of ``iters`` calls (CUDA events) after ``warmup`` calls."""
    import torch

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
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
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
    import flash_attn.flash_attn_interface as fi

    return fi


def pack(lens: list[int], h: int, hk: int, d: int, seed: int = 0) -> tuple[Any, ...]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def t(*shape: int) -> Any:
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)

    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = t(total, h, d), t(total, hk, d), t(total, hk, d)
    return q, k, v, cu.cuda(), max(lens), t(total, h, d)


def lengths(n: int, lo: int, hi: int, seed: int) -> list[int]:
    import random

    rnd = random.Random(seed)
    return [rnd.randint(lo, hi) for _ in range(n)]


PACKS = {
    "64 x 64-512": (64, 64, 512),
    "8 x 512-4096": (8, 512, 4096),
}


def varlen_pair(f: Any, lens: list[int]) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(forward, forward+backward) of ``f`` on one bf16 pack: causal, 32/8 heads, head_dim 128."""
    import torch

    q, k, v, cu, mx, g = pack(lens, 32, 8, 128)
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


def decode_inputs(b: int, ctx: int, h: int = 32, hk: int = 8, d: int = 128) -> tuple[Any, ...]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(b * ctx)
    cap = ctx + 64

    def t(*shape: int) -> Any:
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)

    seqlens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    return (
        t(b, 1, h, d),
        t(b, cap, hk, d),
        t(b, cap, hk, d),
        t(b, 1, hk, d),
        t(b, 1, hk, d),
        seqlens,
    )


def kvcache_call(f: Any, b: int, ctx: int) -> Callable[[], Any]:
    q, kc, vc, kn, vn, sl = decode_inputs(b, ctx)
    return lambda: f(q, kc, vc, kn, vn, cache_seqlens=sl, causal=True)


def part_decode_call(args: argparse.Namespace) -> list[str]:
    from attnguard import fallback

    fi = real_flash()
    lines = []
    for b in (1, 8):
        for ctx in (1024, 8192):
            res = ab(
                kvcache_call(fi.flash_attn_with_kvcache, b, ctx),
                kvcache_call(fallback.flash_attn_with_kvcache, b, ctx),
                args.rounds,
                args.iters * 10,
                timer=wall_ms,
            )
            lines.append(row(f"flash_attn_with_kvcache B{b} ctx {ctx} (wall ms per call)", res))
    return lines


# --- through transformers' flash path --------------------------------------------------------


@contextlib.contextmanager
def kernels_switch() -> Iterator[Callable[[str], None]]:
    """Yields use(which): "real" -> flash-attn's kernels, "twins" -> attnguard's twins, both
    through transformers' own flash path; the twins reached exactly as attnguard reaches them
    when flash-attn's kernel cannot run (its lazy-import patch answering with the twins)."""
    import attnguard
    from attnguard import routing
    from attnguard.patches import transformers_kernels as tk

    state = {"broken": False}
    saved = routing.flash_kernel_unusable
    routing.flash_kernel_unusable = lambda impl: "extension_broken" if state["broken"] else None
    attnguard.activate(log="none")

    def use(which: str) -> None:
        broken = which == "twins"
        if broken != state["broken"]:  # switch: transformers resolves its kernels again
            state["broken"] = broken
            tk._clear_lazy_cache(sys.modules[tk.MODULE], tk.wiring())

    try:
        yield use
    finally:
        routing.flash_kernel_unusable = saved
        attnguard.deactivate()


def flash_model(layers: int = 24) -> Any:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = qwen2_05b(layers)
    cfg._attn_implementation = "flash_attention_2"
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    return model


def packed_row(lens: list[int]) -> dict[str, Any]:
    import torch

    g = torch.Generator(device="cuda").manual_seed(len(lens))
    total = sum(lens)
    ids = torch.randint(3, 150000, (1, total), device="cuda", generator=g)
    pos = torch.cat([torch.arange(n, device="cuda") for n in lens]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": pos, "labels": ids}


def train_step(model: Any, opt: Any, batch: dict, use: Any, which: str, losses: dict) -> Callable:
    def run() -> Any:
        use(which)
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[which] = out.loss.item()

    return run


def part_train(args: argparse.Namespace) -> list[str]:
    import torch

    model = flash_model()
    model.train()
    # lr 0: AdamW does all its work and the weights stay put, so both kernels see the same
    # model in every step and their losses compare
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    lines = []
    with kernels_switch() as use:
        for name, (n, lo, hi) in PACKS.items():
            lens = lengths(n, lo, hi, seed=100 + n)
            batch = packed_row(lens)
            losses: dict[str, float] = {}
            res = ab(
                train_step(model, opt, batch, use, "real", losses),
                train_step(model, opt, batch, use, "twins", losses),
                args.rounds,
                max(3, args.iters // 4),
            )
            lines.append(row(f"training step, packed row {name} ({sum(lens)} tokens)", res))
            lines.append(f"<!-- loss: real {losses.get('real')}, twins {losses.get('twins')} -->")
    return lines


def part_generate(args: argparse.Namespace) -> list[str]:
    import torch
    from transformers import DynamicCache

    model = flash_model().eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, 150000, (4, 2048), device="cuda", generator=g)
    lines = []
    with kernels_switch() as use, torch.no_grad():
        use("real")
        cache = DynamicCache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step_ids = ids[:, -1:]

        def prefill(which: str) -> Callable[[], Any]:
            def run() -> Any:
                use(which)
                return model(input_ids=ids, use_cache=False)

            return run

        def decode(which: str) -> Callable[[], Any]:
            def run() -> Any:
                use(which)
                model(input_ids=step_ids, past_key_values=cache, use_cache=True)
                cache.crop(2048)

            return run

        lines.append(
            row("prefill 4 x 2048", ab(prefill("real"), prefill("twins"), args.rounds, args.iters))
        )
        lines.append(
            row(
                "decode step, batch 4, context 2048",
                ab(decode("real"), decode("twins"), args.rounds, args.iters),
            )
        )
    return lines


def part_decode_model(args: argparse.Namespace) -> list[str]:
    import torch
    import torch.nn as nn

    from attnguard import fallback

    fi = real_flash()
    layers, hidden, h, hk, d = 24, 896, 14, 2, 64

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(hidden, (h + 2 * hk) * d)
            self.o = nn.Linear(h * d, hidden, bias=False)
            self.up = nn.Linear(hidden, 4864, bias=False)
            self.down = nn.Linear(4864, hidden, bias=False)
            self.norm = nn.RMSNorm(hidden)

        def forward(self, x: Any, kc: Any, vc: Any, seqlens: Any, attend: Any) -> Any:
            b = x.shape[0]
            q, k, v = self.qkv(self.norm(x)).split([h * d, hk * d, hk * d], dim=-1)
            out = attend(
                q.view(b, 1, h, d),
                kc,
                vc,
                k.view(b, 1, hk, d),
                v.view(b, 1, hk, d),
                cache_seqlens=seqlens,
                causal=True,
            )
            x = x + self.o(out.reshape(b, 1, h * d))
            return x + self.down(torch.nn.functional.silu(self.up(x)))

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = nn.ModuleList(Layer() for _ in range(layers)).to(torch.bfloat16)
    lines = []
    for b in (1, 8):
        for ctx in (1024, 8192):
            res = ab(
                decode_step(model, fi.flash_attn_with_kvcache, b, ctx, hk, d, hidden),
                decode_step(model, fallback.flash_attn_with_kvcache, b, ctx, hk, d, hidden),
                args.rounds,
                args.iters,
                timer=wall_ms,
            )
            lines.append(row(f"decode step, 24-layer custom model, B{b} ctx {ctx} (wall ms)", res))
    return lines


def decode_step(
    model: Any, attend: Any, b: int, ctx: int, hk: int, d: int, hidden: int
) -> Callable[[], Any]:
    """One token through every layer, each with its own (b, ctx + 64) KV cache at length ctx."""
    import torch

    kw = {"device": "cuda", "dtype": torch.bfloat16}
    caches = [
        (torch.randn(b, ctx + 64, hk, d, **kw), torch.randn(b, ctx + 64, hk, d, **kw))
        for _ in model
    ]
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    x0 = torch.randn(b, 1, hidden, **kw)

    def run() -> Any:
        x = x0
        with torch.no_grad():
            for layer, (kc, vc) in zip(model, caches, strict=True):
                x = layer(x, kc, vc, seqlens, attend)
        return x

    return run


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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(GPU_PARTS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    import platform

    import torch
    import transformers

    import attnguard

    attnguard.deactivate()  # importing it activated it; each part switches it on where it needs
    gpu = any(p in GPU_PARTS for p in parts)
    if gpu and not torch.cuda.is_available():
        print("bench_twins: the GPU parts need a CUDA GPU")
        return 2
    device = torch.cuda.get_device_name(0) if gpu else platform.processor() or "CPU"
    print(f"device: {device}; torch {torch.__version__}; transformers {transformers.__version__}")
    if gpu:
        import flash_attn

        print(f"flash-attn {flash_attn.__version__} (the real kernel)")
    print(f"rounds {args.rounds}, iters {args.iters}; ratio = real (or sdpa) time / twin time")
    print("| measured | real ms | twin ms | ratio [min, max] |")
    print("|---|---|---|---|")
    table = {
        "varlen": part_varlen,
        "decode_call": part_decode_call,
        "train": part_train,
        "generate": part_generate,
        "decode_model": part_decode_model,
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
