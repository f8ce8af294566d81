"""GPU benchmark: the opt-in numbers check (``ATTNGUARD_VERIFY``) at its default rate against the
same run without it, in ONE process, modes alternating round by round; and what one checked
call costs.

One process holds one model (Qwen2-0.5B-shaped, 24 layers, bf16,
``attn_implementation="flash_attention_2"``, the real flash-attn) and switches between
``attnguard.activate(verify="off")`` ("guarded": the guard with the check off) and
``attnguard.activate(verify="0.001")`` ("verify": the default rate) between rounds, in a
rotating order. Parts:

* ``step``: training steps (batch 4 x 1024 tokens, forward, backward, AdamW); a round is
  ``--steps`` steps per mode;
* ``generate``: ``generate`` of 1 x 1024 prompt tokens + 64 new tokens, greedy;
* ``call``: the cost of one checked ``flash_attn_func`` call (wall ms, the call checked minus
  the call alone) at a training shape and a decode shape, and the host µs an unsampled call
  pays at the default rate (its bucket counted) over the check off;
* ``counts``: what the check counted over the run (checked, mismatched, skipped): 0 mismatched
  is the real flash-attn's numbers matching their reference.

For ``step`` and ``generate``: rounds until the 95 % confidence interval of the ratio verify /
guarded (mean of the per-round ratios, t interval) is narrower than ``--ci``, at least
``--rounds``, within ``--seconds``; the median of the ratios with a bootstrap interval too.

    python bench/bench_verify.py [--parts step,generate,call,counts] [--rounds 10]
    python bench/bench_verify.py --smoke   # the code on CPU, tiny model: timings meaningless
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _smoke  # noqa: E402

os.environ.setdefault("ATTNGUARD_LOG", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

PARTS = ("step", "generate", "call", "counts")
MODES = ("guarded", "verify")
RATE = "0.001"
DEV = "cuda"
SMOKE = False


# two-sided 95 % quantiles of Student's t, by degrees of freedom (as bench_generate.py)
_T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}
_T95.update({9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042})


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t interval of the mean of ``ratios``."""
    n = len(ratios)
    mean = statistics.fmean(ratios)
    if n < 2:
        return mean, -math.inf, math.inf
    df = n - 1
    t = _T95[max(k for k in _T95 if k <= df)] if df <= 30 else 1.96 + 2.4 / df
    half = t * statistics.stdev(ratios) / math.sqrt(n)
    return mean, mean - half, mean + half


def median_interval(ratios: list[float], resamples: int = 4000) -> tuple[float, float, float]:
    """(median, low, high): the median and its 95 % bootstrap (percentile) interval."""
    import random

    rnd = random.Random(0)
    n = len(ratios)
    meds = sorted(statistics.median(rnd.choices(ratios, k=n)) for _ in range(resamples))
    return statistics.median(ratios), meds[int(0.025 * resamples)], meds[int(0.975 * resamples)]


def tails(ms: list[float]) -> str:
    s = sorted(ms)
    p90 = s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]
    return f"median {statistics.median(s):.1f}, p90 {p90:.1f}, max {s[-1]:.1f}"


def sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def use(mode: str) -> None:
    import attnguard

    attnguard.activate(log="none", verify=RATE if mode == "verify" else "off")


def model(train: bool) -> Any:
    import torch
    from bench_fallback import qwen2_05b
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2ForCausalLM

    torch.manual_seed(0)
    if SMOKE:
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        cfg._attn_implementation = "sdpa"
        return LlamaForCausalLM(cfg).train(train)
    cfg = qwen2_05b(24)
    cfg._attn_implementation = "flash_attention_2"
    with torch.device("cuda"):
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16).train(train)


def ids(batch: int, length: int) -> Any:
    import torch

    g = torch.Generator(device=DEV).manual_seed(0)
    return torch.randint(3, 250 if SMOKE else 150000, (batch, length), device=DEV, generator=g)


def alternate(run: Callable[[], float], args: argparse.Namespace, what: str) -> list[str]:
    """Rounds of ``run`` (wall ms) in each mode, alternating; the ratio verify / guarded."""
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:  # warm-up: the first call of every bucket is checked here
        use(mode)
        run()
    start, rounds = time.monotonic(), 0
    while True:
        for mode in MODES if rounds % 2 == 0 else MODES[::-1]:
            use(mode)
            times[mode].append(run())
        rounds += 1
        ratios = [a / b for a, b in zip(times["verify"], times["guarded"], strict=True)]
        mean, lo, hi = interval(ratios)
        if rounds >= args.rounds and hi - lo < args.ci:
            break
        if rounds >= args.max_rounds or time.monotonic() - start > args.seconds:
            break
    use("guarded")
    med, mlo, mhi = median_interval(ratios)
    return [
        f"| {what}: {rounds} rounds; guarded (check off) ms: {tails(times['guarded'])} | | |",
        f"| {what}: verify ({RATE}) ms: {tails(times['verify'])} | | |",
        f"| {what} time verify / guarded | {mean:.4f} | 95 % CI [{lo:.4f}, {hi:.4f}]; median "
        f"{med:.4f} [{mlo:.4f}, {mhi:.4f}] |",
    ]


def part_step(args: argparse.Namespace) -> list[str]:
    import torch

    m = model(train=True)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    batch = ids(1, 32) if SMOKE else ids(4, 1024)

    def steps() -> float:
        gc.collect()
        sync()
        t = time.perf_counter()
        for _ in range(args.steps):
            loss = m(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync()
        return (time.perf_counter() - t) * 1e3

    return alternate(steps, args, f"training, {args.steps} steps of {tuple(batch.shape)}")


def part_generate(args: argparse.Namespace) -> list[str]:
    import torch

    m = model(train=False)
    prompt = ids(1, 16) if SMOKE else ids(1, 1024)
    new = 4 if SMOKE else 64
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}

    def generate() -> float:
        gc.collect()
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            out = m.generate(prompt, **kw)
        sync()
        assert out.shape[1] == prompt.shape[1] + new
        return (time.perf_counter() - t) * 1e3

    return alternate(generate, args, f"generate 1 x {prompt.shape[1]} + {new} tokens")


def _flash_call() -> tuple[Callable[..., Any], str]:
    """flash-attn's guarded flash_attn_func (GPU), or on a CPU a guarded entry around
    attnguard's own twin (the kernel stands in: what the check costs is the same code)."""
    if not SMOKE:
        import flash_attn

        return flash_attn.flash_attn_func, "flash-attn"
    from attnguard import callguard, kernels, runtime
    from attnguard.fallback import flash_attn_func
    from attnguard.kernel_identity import Family

    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        flash_attn_func,
        tensors=("q", "k", "v"),
        twin=flash_attn_func,
        site="bench.flash_attn_func",
        aux=("alibi_slopes",),
        head_axis=3,
        in_force=runtime.IN_FORCE,
        family=Family.FA2,
    )
    return callguard.wrap_direct(entry), "attnguard's twin as the kernel (CPU)"


def part_call(args: argparse.Namespace) -> list[str]:
    import torch

    import attnguard

    attnguard.activate(log="none", disable="reroute" if SMOKE else "")
    fn, what = _flash_call()
    shapes = {
        "training (4 x 1024, 14/2 heads, 64)": [(4, 1024, 14, 64), (4, 1024, 2, 64)],
        "decode (1 query, 1024 keys)": [(1, 1, 14, 64), (1, 1024, 2, 64)],
    }
    if SMOKE:
        shapes = {"tiny (1 x 32, 4/2 heads, 16)": [(1, 32, 4, 16), (1, 32, 2, 16)]}
    dtype = torch.bfloat16
    lines = []
    for label, (qs, ks) in shapes.items():
        g = torch.Generator(device=DEV).manual_seed(0)
        q = torch.randn(*qs, device=DEV, generator=g).to(dtype)
        k, v = (torch.randn(*ks, device=DEV, generator=g).to(dtype) for _ in range(2))
        ms: dict[str, float] = {}
        for mode in ("off", "all", "off", "all"):
            attnguard.configure(verify=mode)
            ms[mode] = wall_ms(lambda q=q, k=k, v=v: fn(q, k, v, causal=True), 3 if SMOKE else 20)
        lines.append(
            f"| one {what} call, {label}: {ms['off']:.3f} ms; checked {ms['all']:.3f} ms "
            f"(the check: +{ms['all'] - ms['off']:.3f} ms) | | |"
        )
    n = 200 if SMOKE else 2000
    attnguard.configure(verify="off")
    off = host_us(lambda: fn(q, k, v, causal=True), n)
    attnguard.configure(verify=RATE)
    fn(q, k, v, causal=True)  # the bucket's first call: checked once, then counted only
    on = host_us(lambda: fn(q, k, v, causal=True), n)
    attnguard.configure(verify="off", disable="")
    lines.append(
        f"| host µs per {label} call: check off {off:.2f}; at {RATE}, a call not sampled "
        f"{on:.2f} (+{on - off:.2f}, amortised checks included) | | |"
    )
    return lines


def part_counts(args: argparse.Namespace) -> list[str]:
    from attnguard.observability import numerics

    counts = numerics.snapshot() or {"checked": 0, "mismatched": 0, "skipped": {}}
    return [
        f"| what the check counted in this process | {counts['checked']} checked, "
        f"{counts['mismatched']} mismatched | skipped {counts['skipped'] or 0} |"
    ]


def wall_ms(fn: Callable[[], Any], n: int) -> float:
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def host_us(fn: Callable[[], Any], n: int) -> float:
    for _ in range(10):
        fn()
    sync()
    out = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        out.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(out)


def main() -> int:
    global DEV, SMOKE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument("--rounds", type=int, default=10, help="at least this many rounds")
    ap.add_argument("--max-rounds", type=int, default=200, help="at most this many rounds")
    ap.add_argument("--seconds", type=float, default=240.0, help="at most, per part")
    ap.add_argument("--steps", type=int, default=5, help="training steps per round")
    ap.add_argument("--ci", type=float, default=0.02, help="wanted width of the 95 %% interval")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny: the code only")
    args = ap.parse_args()
    if args.smoke:
        DEV, SMOKE = "cpu", True
        args.rounds, args.max_rounds, args.seconds, args.steps = 2, 3, 20.0, 1
    import torch

    import attnguard

    if not SMOKE and not torch.cuda.is_available():
        print("bench_verify: needs a CUDA GPU and the real flash-attn (--smoke runs on a CPU)")
        return 2
    attnguard.activate(log="none")
    print(
        f"| bench_verify on {torch.cuda.get_device_name() if DEV == 'cuda' else 'CPU'}, torch "
        f"{torch.__version__}, rate {RATE} | value | interval |"
    )
    print("| --- | --- | --- |")
    parts = {"step": part_step, "generate": part_generate, "call": part_call}
    parts["counts"] = part_counts
    for name in args.parts.split(","):
        for line in parts[name](args):
            print(line, flush=True)
        if SMOKE:
            _smoke.ran(name)
    return _smoke.done() if SMOKE else 0


if __name__ == "__main__":
    raise SystemExit(main())
