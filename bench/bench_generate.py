"""GPU benchmark: HF ``generate`` without attnguard, with attnguard and nothing to fix, and with
``ATTNGUARD_KERNEL=fastest``, in ONE process, modes alternating round by round.

Decode through transformers is bound by the host (tens of microseconds of Python per layer and
token), and the time of a whole ``generate`` varies from process to process by more than any
guard could cost: comparing separate processes cannot settle a few percent. Here one process
holds one model (Qwen2-0.5B-shaped, 24 layers, bf16, ``attn_implementation="flash_attention_2"``,
the real flash-attn) and switches modes between rounds (``attnguard.activate()`` /
``deactivate()``, which patch and restore transformers' flash path); each round runs every mode
once, in a rotating order. Parts:

* ``generate``: ``generate`` of 1 x 1024 prompt tokens + 64 new tokens, greedy; rounds until the
  95 % confidence interval of each mode's ratio to "off" (mean of the per-round ratios, t
  interval) is narrower than 3 % (``--ci``), at least ``--rounds``, within ``--seconds``.
  Reported: the ratio with its interval, and each mode's median, p90 and max time. Each mode's
  first ``generate`` (its warm-up: fastest's races happen there) is reported apart.
* ``step``: one decode step (1 token, 1024 cached, the cache cropped back each time), wall ms.
* ``host``: host µs per ``flash_attn_func`` call at a decode shape (1 query token, 1024 keys,
  14/2 heads, head_dim 64): flash-attn's own function; through the guard with nothing to fix;
  through the guard under fastest with the bucket decided; and the kernel that serves it
  called directly. The guard's cost = guarded - original, fastest's = guarded fastest - the
  serving kernel. On CPU (``--smoke`` too) the same, with a stub kernel and meta tensors.

    python bench/bench_generate.py [--parts generate,step,host] [--rounds 10] [--seconds 240]
    python bench/bench_generate.py --smoke   # the code on CPU, tiny model: timings meaningless
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
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

PARTS = ("generate", "step", "host")
MODES = ("off", "guarded", "fastest")
DEV = "cuda"
SMOKE = False
_CACHE_DIR = tempfile.mkdtemp(prefix="attnguard-bench-kernels-")


def sync() -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()


def use(mode: str) -> None:
    """Switch this process to ``mode``: off (no attnguard), guarded (nothing to fix), fastest."""
    import attnguard

    if mode == "off":
        attnguard.deactivate()
    elif mode == "guarded":
        attnguard.activate(log="none", kernel="requested")
    else:
        attnguard.activate(log="none", kernel="fastest", kernel_cache=_CACHE_DIR)


def flash_path_reached() -> str:
    """What transformers' flash path calls now: flash-attn's function or attnguard's guard."""
    module = sys.modules.get("transformers.modeling_flash_attention_utils")
    fn = getattr(module, "_flash_fn", None)
    if fn is None:
        return "not resolved"
    return "attnguard's guard" if hasattr(fn, "__attnguard_original__") else "flash-attn's own"


def model_and_prompt() -> tuple[Any, Any]:
    import torch
    from bench_fallback import qwen2_05b
    from transformers import LlamaConfig, Qwen2ForCausalLM

    torch.manual_seed(0)
    if SMOKE:
        from transformers import LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        cfg._attn_implementation = "sdpa"
        model = LlamaForCausalLM(cfg).eval()
        ids = torch.randint(3, 256, (1, 16))
        return model, ids
    cfg = qwen2_05b(24)
    cfg._attn_implementation = "flash_attention_2"
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, 150000, (1, 1024), device="cuda", generator=g)
    return model, ids


# --- statistics -------------------------------------------------------------------------------

# two-sided 95 % quantiles of Student's t, by degrees of freedom
_T95 = {1: 12.71, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}
_T95.update({9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042})


def t95(df: int) -> float:
    if df <= 0:
        return math.inf
    known = [k for k in _T95 if k <= df]
    return _T95[max(known)] if df <= 30 else 1.96 + 2.4 / df


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """(mean, low, high): the 95 % t interval of the mean of ``ratios``."""
    n = len(ratios)
    mean = statistics.fmean(ratios)
    if n < 2:
        return mean, -math.inf, math.inf
    half = t95(n - 1) * statistics.stdev(ratios) / math.sqrt(n)
    return mean, mean - half, mean + half


def median_interval(ratios: list[float], resamples: int = 4000) -> tuple[float, float, float]:
    """(median, low, high): the median of ``ratios`` and its 95 % bootstrap (percentile)
    interval: robust to the few slow rounds a busy host gives one mode or another."""
    import random

    rnd = random.Random(0)
    n = len(ratios)
    meds = sorted(statistics.median(rnd.choices(ratios, k=n)) for _ in range(resamples))
    return statistics.median(ratios), meds[int(0.025 * resamples)], meds[int(0.975 * resamples)]


def tails(ms: list[float]) -> str:
    s = sorted(ms)
    p90 = s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]
    return f"median {statistics.median(s):.1f}, p90 {p90:.1f}, max {s[-1]:.1f}"


# --- parts ---------------------------------------------------------------------------------------


def part_generate(args: argparse.Namespace) -> list[str]:
    import torch

    model, ids = model_and_prompt()
    new = 4 if SMOKE else 64
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}

    cpu: dict[str, list[float]] = {m: [] for m in MODES}

    def generate(mode: str = "") -> float:
        gc.collect()
        gc.disable()  # a collection inside one mode's round is noise, not the mode's cost
        try:
            sync()
            t, c = time.perf_counter(), time.process_time()
            with torch.no_grad():
                out = model.generate(ids, **kw)
            sync()
            wall, spent = time.perf_counter() - t, time.process_time() - c
        finally:
            gc.enable()
        assert out.shape[1] == ids.shape[1] + new
        if mode:
            cpu[mode].append(spent * 1e3)
        return wall * 1e3

    lines = []
    for mode in MODES:  # warm-up: compiles, cold kernels, fastest's races
        use(mode)
        first = generate()
        lines.append(
            f"| generate warm-up, {mode}: {first:.1f} ms, flash path: {flash_path_reached()} | | | |"
        )
    times: dict[str, list[float]] = {m: [] for m in MODES}
    start = time.monotonic()
    rounds = 0
    while True:
        order = MODES[rounds % 3 :] + MODES[: rounds % 3]
        for mode in order:
            use(mode)
            times[mode].append(generate(mode))
        rounds += 1
        ratios = {
            m: [a / b for a, b in zip(times[m], times["off"], strict=True)] for m in MODES[1:]
        }
        widths = [interval(r)[2] - interval(r)[1] for r in ratios.values()]
        done = rounds >= args.rounds and max(widths) < args.ci
        if not done and rounds >= args.rounds and rounds % 4 == 0:
            med = [median_interval(r, 1000) for r in ratios.values()]
            done = max(hi - lo for _, lo, hi in med) < args.ci
        if done or rounds >= args.max_rounds or time.monotonic() - start > args.seconds:
            break
    use("off")
    lines.append(f"| generate 1 x {ids.shape[1]} + {new} tokens: {rounds} rounds | | | |")
    for mode in MODES:
        lines.append(f"| generate, {mode} (ms) | {tails(times[mode])} | | |")
    for mode in MODES[1:]:
        c = [a / b for a, b in zip(cpu[mode], cpu["off"], strict=True)]
        mean, lo, hi = interval(c)
        lines.append(
            f"| generate process CPU time {mode} / off | {mean:.4f} | 95 % CI [{lo:.4f}, "
            f"{hi:.4f}] | |"
        )
    for mode, r in ratios.items():
        med, mlo, mhi = median_interval(r)
        lines.append(
            f"| generate time {mode} / off, median of rounds | {med:.4f} | 95 % bootstrap CI "
            f"[{mlo:.4f}, {mhi:.4f}] (width {mhi - mlo:.4f}) | |"
        )
    for mode, r in ratios.items():
        mean, lo, hi = interval(r)
        width = hi - lo
        verdict = "narrower than" if width < args.ci else "NOT narrower than"
        lines.append(
            f"| generate time {mode} / off | {mean:.4f} | 95 % CI [{lo:.4f}, {hi:.4f}] "
            f"(width {width:.4f}, {verdict} {args.ci:g}) | per-round max {max(r):.4f} |"
        )
    return lines


def part_step(args: argparse.Namespace) -> list[str]:
    import torch
    from transformers import DynamicCache

    model, ids = model_and_prompt()
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    step_ids = ids[:, -1:]
    n = ids.shape[1]

    def step() -> None:
        with torch.no_grad():
            model(input_ids=step_ids, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # back to the prompt (older releases take only a negative count too)

    got: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:
        use(mode)
        step()
    for r in range(args.rounds):
        for mode in MODES[r % 3 :] + MODES[: r % 3]:
            use(mode)
            got[mode].append(wall_ms(step, 3 if SMOKE else 20))
    lines = []
    for mode in MODES[1:]:  # where attnguard's own Python goes in a decode step
        use(mode)
        lines.append(f"| decode step, {mode}: {profile(step, 10)} | | | |")
    use("off")
    for mode in MODES:
        lines.append(
            f"| decode step (1 token, {n} cached), {mode}: wall ms | {tails(got[mode])} | | |"
        )
    for mode in MODES[1:]:
        r = [a / b for a, b in zip(got[mode], got["off"], strict=True)]
        mean, lo, hi = interval(r)
        med, mlo, mhi = median_interval(r)
        lines.append(
            f"| decode step {mode} / off | {mean:.4f} | 95 % CI [{lo:.4f}, {hi:.4f}] | median "
            f"{med:.4f} [{mlo:.4f}, {mhi:.4f}] |"
        )
    return lines


def profile(fn: Callable[[], Any], n: int) -> str:
    """attnguard's own functions in ``n`` calls of ``fn`` under cProfile: calls and own time
    per call of ``fn`` (profiling inflates every time alike; read them against each other)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in stats.values())
    ours = {k: v for k, v in stats.items() if "/attnguard/" in k[0]}
    own = sum(v[2] for v in ours.values())
    top = sorted(ours.items(), key=lambda kv: -kv[1][2])[:4]
    names = ", ".join(f"{k[2]} {v[2] / n * 1e6:.0f} µs ({v[1] // n} calls)" for k, v in top)
    return (
        f"attnguard's own Python {own / n * 1e6:.0f} µs per step of {total / n * 1e3:.1f} ms "
        f"profiled ({names})"
    )


def wall_ms(fn: Callable[[], Any], n: int) -> float:
    """Median wall ms of ``n`` synchronised calls."""
    out = []
    for _ in range(n):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def host_us(fn: Callable[[], Any], n: int) -> float:
    """Median host µs per call of ``fn`` (calls back to back, 7 batches of ``n``)."""
    for _ in range(20):
        fn()
    sync()
    out = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        sync()
    return statistics.median(out)


def _decided(entry_name: str) -> tuple[str, Any]:
    """The (winner, implementation) fastest serves the one decided bucket of ``entry_name``."""
    from attnguard.selection import decisions

    for (name, winner), impl in decisions._state.impls.items():
        if name == entry_name:
            return winner, impl
    return "requested", None


def part_host(args: argparse.Namespace) -> list[str]:
    """Host µs per flash_attn_func call, decode-shaped: what the guard and fastest add, for a
    call under ``torch.no_grad()`` (as ``generate`` makes it) and one with autograd on."""
    import torch

    lines = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            lines += _host_rows("autograd on" if grad else "no_grad, as in generate")
    return lines


def _host_rows(label: str) -> list[str]:
    import torch

    from attnguard import callguard, kernels, runtime

    lines = []
    n = 2000 if not SMOKE else 200
    kw = {"softmax_scale": 0.125, "causal": True}
    # (a) on this CPU: a stub kernel and meta tensors (the guard's Python, real tensor reads)
    out = torch.empty(1, device="meta")

    def stub(q: Any, k: Any, v: Any, dropout_p: float = 0.0, softmax_scale: Any = None,
             causal: bool = False, window_size: Any = (-1, -1), softcap: float = 0.0,
             alibi_slopes: Any = None, deterministic: bool = False,
             return_attn_probs: bool = False) -> Any:  # fmt: skip
        return out

    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        stub,
        tensors=("q", "k", "v"),
        twin=stub,
        site="flash_attn.flash_attn_func",
        aux=("alibi_slopes",),
        head_axis=3,
        in_force=runtime.IN_FORCE,
    )
    guarded = callguard.wrap_direct(entry)
    meta = [torch.empty(*s, dtype=torch.bfloat16, device="meta") for s in SHAPE_DECODE]
    from attnguard.selection import decisions, served

    def serving(a: Any, k: Any) -> Any:  # a decided bucket's kernel: the stub, one layer down
        return stub(*a, **k)

    results = {}
    use("off")
    results["stub"] = host_us(lambda: stub(*meta, **kw), n * 10)
    use("guarded")
    results["guarded"] = host_us(lambda: guarded(*meta, **kw), n * 10)
    use("fastest")
    guarded(*meta, **kw)  # meta tensors are no CUDA call: seed the served bucket by hand
    sig = served.signature("flash_attn_func", tuple(meta), kw)
    served.remember("flash_attn_func", sig, kw, [0], serving, True)
    results["fastest"] = host_us(lambda: guarded(*meta, **kw), n * 10)
    results["served"] = host_us(lambda: serving(tuple(meta), kw), n * 10)
    decisions.reset()
    use("off")
    lines.append(
        f"| host µs, {label}, this CPU, stub kernel: original {results['stub']:.2f}; guarded "
        f"{results['guarded']:.2f} (+{results['guarded'] - results['stub']:.2f}); fastest, "
        f"decided bucket {results['fastest']:.2f} (+{results['fastest'] - results['served']:.2f} "
        f"over its kernel {results['served']:.2f}) | | | |"
    )
    if SMOKE:
        return lines
    # (b) the real flash-attn on the GPU
    import flash_attn.flash_attn_interface as fi

    original = getattr(fi.flash_attn_func, "__attnguard_original__", fi.flash_attn_func)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(*s, device="cuda", generator=g).to(torch.bfloat16) for s in SHAPE_DECODE)
    real = {}
    use("off")
    real["flash-attn"] = host_us(lambda: original(q, k, v, **kw), n)
    use("guarded")
    guarded_fn = fi.flash_attn_func
    real["guarded"] = host_us(lambda: guarded_fn(q, k, v, **kw), n)
    use("fastest")
    decisions.reset()
    for _ in range(3):
        fi.flash_attn_func(q, k, v, **kw)  # the race decides the bucket
    winner, impl = _decided("flash_attn_func")
    real["fastest"] = host_us(lambda: fi.flash_attn_func(q, k, v, **kw), n)
    serve = (lambda: impl((q, k, v), kw)) if impl is not None else (lambda: original(q, k, v, **kw))
    real["served"] = host_us(serve, n)
    use("off")
    lines.append(
        f"| host µs, {label}, GPU, flash_attn_func decode call: flash-attn "
        f"{real['flash-attn']:.2f}; guarded {real['guarded']:.2f} "
        f"(+{real['guarded'] - real['flash-attn']:.2f}); fastest ({winner} serves) "
        f"{real['fastest']:.2f}, its kernel alone {real['served']:.2f} "
        f"(+{real['fastest'] - real['served']:.2f}) | | | |"
    )
    return lines


SHAPE_DECODE = [(1, 1, 14, 64), (1, 1024, 2, 64), (1, 1024, 2, 64)]


def main() -> int:
    global DEV, SMOKE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"of {', '.join(PARTS)}")
    ap.add_argument("--rounds", type=int, default=10, help="at least this many rounds")
    ap.add_argument("--max-rounds", type=int, default=400, help="at most this many rounds")
    ap.add_argument("--seconds", type=float, default=240.0, help="at most (generate part)")
    ap.add_argument("--ci", type=float, default=0.03, help="wanted width of the 95 %% interval")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--smoke", "--dry-run", action="store_true", help="CPU, tiny: the code only")
    args = ap.parse_args()
    if args.smoke:
        DEV, SMOKE = "cpu", True
        args.rounds, args.max_rounds, args.seconds = 2, 3, 20.0
    import torch
    import transformers

    import attnguard

    attnguard.deactivate()  # importing it activated it; the parts switch modes themselves
    if not SMOKE and not torch.cuda.is_available():
        print("bench_generate: needs a CUDA GPU (or --smoke)")
        return 2
    device = torch.cuda.get_device_name(0) if not SMOKE else "CPU (smoke: timings meaningless)"
    print(f"device: {device}; torch {torch.__version__}; transformers {transformers.__version__}")
    if not SMOKE:
        import flash_attn

        print(f"flash-attn {flash_attn.__version__} (the real kernel)")
    print("| measured | value | | |")
    print("|---|---|---|---|")
    table = {"generate": part_generate, "step": part_step, "host": part_host}
    results = {}
    for p in [p.strip() for p in args.parts.split(",") if p.strip()]:
        try:
            lines = table[p](args)
        except Exception as exc:  # report and go on with the other parts
            if SMOKE:
                raise  # a smoke run exists to catch a part that no longer runs
            lines = [f"| {p} | error: {type(exc).__name__}: {str(exc)[:300]} | | |"]
        if SMOKE:
            _smoke.ran(f"{p} (CPU, tiny; timings meaningless)")
        results[p] = lines
        for line in lines:
            print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "rows": results}, indent=1))
    return _smoke.done() if SMOKE else 0


if __name__ == "__main__":
    sys.exit(main())
