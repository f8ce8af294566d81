"""GPU benchmark: ``ATTNGUARD_KERNEL=fastest`` on vs off, real flash-attn installed and working.

Two measurements (``--parts``; the default runs both in about 250 s on an H200):

* ``fresh`` — what a job gets from its FIRST process on a fresh machine, measured
  in separate processes, each a job of its own on a
  Qwen2-0.5B-shaped model (24 layers, head_dim 64, bf16, ``attn_implementation=
  "flash_attention_2"``, on the GPU). "off" imports no attnguard at all; "on" runs with
  ``ATTNGUARD_KERNEL=fastest`` and an empty decision cache of its own (``ATTNGUARD_KERNEL_CACHE``
  = a fresh directory); "on again" is a second process on that cache (its decisions read from
  disk). Every process runs the shape sequence 4 x 4096 -> 1 x 16384 -> 1 x 32768 (at each shape
  training steps, then prefill: warm-up steps, which include the races of "on", then timed
  steps), then padding-free training steps on one packed row whose sequences, and total length,
  change every step. Rounds alternate the order (round 1 starts with "on", so that on a freshly
  lent machine the guarded process is the machine's first). Ratio = off / on time of the same
  round (>= 1: faster with the switch on), median over rounds [min, max]. The first "on"
  process's ``kernel_selected`` events are listed: what each bucket was decided, from where,
  and what its race cost against the process's race budget.
* ``dense``, ``packed``, ``decode``, ``7b`` — ONE process, a model loaded with
  ``attn_implementation="flash_attention_2"``, timed with the switch off (every call on
  flash-attn) and on (each call bucket served by the race's winner), alternating rounds so drift
  hits both alike: training step (forward, backward, AdamW) and prefill (one forward, no cache,
  last token's logits) at 4 x 4096, 1 x 16384 and 1 x 32768; a padding-free training step on one
  packed row of 64 sequences of 64-512 tokens; a decode step (batch 4, context 2048); a
  7B-shaped model (Qwen2-7B: head_dim 128, 28 heads / 4 kv heads) at 1 x 16384 (``7b``, not in
  the default: prefill with all 28 layers, training step with 8 of them). Each row starts with
  no decision and a fresh race budget; the races are paid in the first "on" warm-up.

    python bench/bench_kernel.py [--parts fresh,dense,packed,decode] [--fresh-rounds 2]
                                 [--rounds 3] [--iters 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
os.environ.setdefault("ATTNGUARD_LOG", "none")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from _twins_models import packed_row  # noqa: E402
from bench_fallback import qwen2_05b  # noqa: E402
from bench_twins import ab, gpu_ms, lengths, row  # noqa: E402

PARTS = ("fresh", "dense", "packed", "decode", "7b")
DEFAULT_PARTS = "fresh,dense,packed,decode"
DEV = "cuda"  # "cpu" with --smoke
DENSE = ((4, 4096), (1, 16384), (1, 32768))  # (batch, tokens) of the dense rows
PACK = (64, 64, 512)  # sequences in the packed row, their shortest and longest
DECODE = (4, 2048)  # batch, context of the decode step


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
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if DEV == "cpu":  # --smoke: 2 layers of width 64
        size = dict(vocab_size=150001, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        cfg = Qwen2Config(**size, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    cfg._attn_implementation = "flash_attention_2"
    with torch.device(DEV):
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


def _one_warm_up(fn: Callable[[], Any], iters: int) -> float:
    return gpu_ms(fn, iters, warmup=1)  # one: the default parts fit in about 250 s


def measure(
    name: str, make: Callable[[], Callable[[], Any]], args: argparse.Namespace
) -> list[str]:
    import torch

    from attnguard.selection import decisions

    decisions.reset()  # each row decides afresh, as a job of that shape would (its own budget)
    try:
        off, on = modes(make)
        res = ab(off, on, args.rounds, args.iters, timer=_one_warm_up)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return [f"| {name} | out of memory on this GPU | | |"]
    # ab() calls the first argument "real": here that is the switch off
    return [row(name, res)]


# --- fresh: separate processes, an empty decision cache ------------------------------------------

FRESH_SHAPES = ((4, 4096), (1, 16384), (1, 32768))
FRESH_WARM, FRESH_TIMED = 2, 3  # steps per shape: warm-up (the races of "on"), then timed
# sequences per packed row, step by step: the first two (warm-up) fall on both sides of 16384
# tokens, so both total-length buckets are decided before the timed steps
FRESH_PACKS = (52, 70, 58, 62, 66, 74)
FRESH_PACKS_WARM = 2


def _step_ms(fn: Callable[[], Any]) -> float:
    import torch

    if DEV == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if DEV == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) * 1e3


def _steps(fn: Callable[[], Any], warm: int, timed: int) -> list[float]:
    for _ in range(warm):
        _step_ms(fn)
    return [_step_ms(fn) for _ in range(timed)]


def child(mode: str, cache_dir: str) -> int:
    """One process of the ``fresh`` part: the shape sequence, then the packed rows; prints one
    ``CHILD {...}`` line."""
    t0 = time.perf_counter()
    seen: list[dict[str, Any]] = []
    capture: Any = contextlib.nullcontext(seen)
    if mode == "on":
        import attnguard
        from attnguard.observability import events

        attnguard.activate(log="none", kernel="fastest", kernel_cache=cache_dir)
        capture = events.capture()
    import torch

    model = build(qwen2_05b(24))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay put
    g = torch.Generator(device=DEV).manual_seed(0)
    rows: dict[str, list[float] | None] = {}

    def row_of(name: str, fn: Callable[[], Any], warm: int, timed: int) -> None:
        try:
            rows[name] = _steps(fn, warm, timed)
        except torch.OutOfMemoryError:
            rows[name] = None
        torch.cuda.empty_cache()

    with capture as seen:
        for b, s in FRESH_SHAPES:
            ids = torch.randint(3, 150000, (b, s), device=DEV, generator=g)
            batch = {"input_ids": ids, "labels": ids}
            model.train()
            row_of(
                f"training step {b} x {s}", train_step(model, opt, batch), FRESH_WARM, FRESH_TIMED
            )
            model.eval()
            row_of(f"prefill {b} x {s}", prefill(model, ids), FRESH_WARM, FRESH_TIMED)
            del ids, batch
        model.train()
        packs = [packed_row(lengths(n, *PACK[1:], seed=164 + n)) for n in FRESH_PACKS]
        totals = [int(p["input_ids"].shape[1]) for p in packs]
        name = f"packed-row training step, total {min(totals)}-{max(totals)} tokens"
        times = [_step_ms(train_step(model, opt, p)) for p in packs]
        rows[name] = times[FRESH_PACKS_WARM:]
    keep = ("reason_code", "selected", "source", "cost", "bucket")
    said = [{k: e.get(k) for k in keep} for e in seen if e["event"] == "kernel_selected"]
    result = {
        "mode": mode,
        "rows": rows,
        "selected": said,
        "wall_s": round(time.perf_counter() - t0, 2),
        "attnguard_imported": "attnguard" in sys.modules,
    }
    print("CHILD " + json.dumps(result, default=str), flush=True)
    return 0


def _run_child(mode: str, cache_dir: str, smoke: bool = False) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--cache", cache_dir]
    cmd += ["--smoke"] if smoke else []
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    line = next((x for x in res.stdout.splitlines() if x.startswith("CHILD ")), None)
    if res.returncode != 0 or line is None:
        raise RuntimeError(f"{mode} process exited {res.returncode}: {res.stderr[-1500:]}")
    got = json.loads(line[6:])
    if got["attnguard_imported"] != (mode == "on"):
        raise RuntimeError(f"{mode} process: attnguard imported = {got['attnguard_imported']}")
    return got


def _ratio_cells(off: list[float | None], on: list[float | None]) -> tuple[str, str]:
    pairs = [(a, b) for a, b in zip(off, on, strict=True) if a and b]
    if not pairs:
        return "out of memory", ""
    ratios = [a / b for a, b in pairs]
    ms = statistics.median(b for _, b in pairs)
    med = statistics.median(ratios)
    return f"{ms:.1f}", f"**{med:.3f}** [{min(ratios):.3f}, {max(ratios):.3f}]"


def fresh_part(args: argparse.Namespace) -> list[str]:
    root = tempfile.mkdtemp(prefix="attnguard-bench-fresh-")
    rounds = []
    for r in range(args.fresh_rounds):
        cache_dir = os.path.join(root, f"round-{r}")  # does not exist yet: an empty cache
        got = {}
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            got[mode] = _run_child(mode, cache_dir)
        got["on again"] = _run_child("on", cache_dir)  # the second process on that cache
        rounds.append(got)
        walls = ", ".join(f"{m} {got[m]['wall_s']} s" for m in got)
        print(f"fresh round {r + 1}: process wall time {walls}", flush=True)

    def per_row(mode: str, name: str) -> list[float | None]:
        """Each round's time of a row: the median step, or for the packed rows (every step
        another pack) the sum of the timed steps."""
        out: list[float | None] = []
        for got in rounds:
            times = got[mode]["rows"].get(name)
            if not times:
                out.append(None)
            else:
                out.append(sum(times) if name.startswith("packed") else statistics.median(times))
        return out

    lines = [
        "",
        f"fresh processes, {args.fresh_rounds} alternating rounds; ratio = off / on (same round)",
        "| measured | off ms | on ms, first process | ratio | on ms, second process | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name in rounds[0]["off"]["rows"]:
        off = per_row("off", name)
        first, second = per_row("on", name), per_row("on again", name)
        off_ms = statistics.median(x for x in off if x) if any(off) else float("nan")
        lines.append(
            f"| {name} | {off_ms:.1f} | {' | '.join(_ratio_cells(off, first))} | "
            f"{' | '.join(_ratio_cells(off, second))} |"
        )
    lines += ["", "the first process's decisions (round 1, kernel_selected):"]
    for e in rounds[0]["on"]["selected"]:
        cost = e.get("cost") or {}
        spent = f"race {cost.get('race_s', 0):.2f} s + warm-up {cost.get('warm_up_s', 0):.2f} s"
        lines.append(
            f"  {'/'.join(str(x) for x in (e.get('bucket') or [])[-8:])}: {e['selected']} "
            f"({e['reason_code']}, {e['source']}; {spent}; process {cost.get('process_races_s')}"
            f" s of {cost.get('process_allowance_s')} s)"
        )
    codes = [e["reason_code"] for e in rounds[0]["on"]["selected"]]
    lines.append(f"  not_raced: {codes.count('not_raced')} of {len(codes)} buckets")
    return lines


def dense_parts(args: argparse.Namespace) -> list[str]:
    import torch

    model = build(qwen2_05b(24))
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)  # lr 0: the weights stay put
    lines = []
    g = torch.Generator(device=DEV).manual_seed(0)
    for b, s in DENSE:
        ids = torch.randint(3, 150000, (b, s), device=DEV, generator=g)
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
    batch = packed_row(lengths(*PACK, seed=164))
    n = batch["input_ids"].shape[1]
    lines = measure(
        f"training step, one packed row of {PACK[0]} sequences ({n} tokens)",
        lambda: train_step(model, opt, batch),
        args,
    )
    return lines


def decode_part(args: argparse.Namespace) -> list[str]:
    import torch
    from transformers import DynamicCache

    model = build(qwen2_05b(24)).eval()
    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(3, 150000, DECODE, device=DEV, generator=g)
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)

    def make() -> Callable[[], Any]:
        def run() -> Any:
            with torch.no_grad():
                model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
            cache.crop(-1)  # back to the context (a negative count: every release)

        return run

    return measure(f"decode step, batch {DECODE[0]}, context {DECODE[1]}", make, args)


def seven_b_prefill(args: argparse.Namespace) -> list[str]:
    import torch

    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(3, 150000, (1, 16384), device=DEV, generator=g)
    model = build(qwen2_7b(28)).eval()
    return measure("7B-shaped (28 layers) prefill 1 x 16384", lambda: prefill(model, ids), args)


def seven_b_train(args: argparse.Namespace) -> list[str]:
    import torch

    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(3, 150000, (1, 16384), device=DEV, generator=g)
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


def smoke_sizes() -> None:
    """--smoke: a 2-layer model of width 64 on the CPU, shapes a CPU computes in a moment."""
    global DEV, DENSE, PACK, DECODE, FRESH_SHAPES, FRESH_PACKS
    import bench_twins

    DEV = bench_twins.DEV = "cpu"
    DENSE, PACK, DECODE = ((1, 32),), (4, 8, 32), (2, 32)
    FRESH_SHAPES, FRESH_PACKS = ((1, 32),), (3, 5, 4)


def smoke(args: argparse.Namespace) -> int:
    """What a CPU can run of this bench: the one-process parts and the first "on" process of
    the fresh part, with attnguard keeping transformers' flash path on its twins."""
    import _smoke

    import attnguard

    args.rounds, args.iters = 2, 1
    attnguard.activate(
        log="none", kernel="requested", kernel_cache=tempfile.mkdtemp(prefix="attnguard-bench-")
    )
    print("| measured | off ms | on ms | ratio [min, max] |")
    print("|---|---|---|---|")
    for part, run in (("dense", dense_parts), ("packed", packed_part), ("decode", decode_part)):
        for line in run(args):
            print(line, flush=True)
        _smoke.ran(f"{part}: the switch off and on, guarded, on the CPU")
    got = _run_child("on", tempfile.mkdtemp(prefix="attnguard-bench-fresh-"), smoke=True)
    for name, times in got["rows"].items():
        print(f"fresh, first process with the switch on: {name}: {times} ms")
    _smoke.ran("fresh: the first process with the switch on and an empty cache")
    _smoke.skipped("fresh: the processes without attnguard", "flash on a CPU raises unguarded")
    _smoke.skipped("the races", "ATTNGUARD_KERNEL=fastest races GPU kernels; a CPU has none")
    _smoke.skipped("7b", "a 7B-shaped model needs a GPU")
    return _smoke.done()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=DEFAULT_PARTS, help=f"of {', '.join(PARTS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--fresh-rounds", type=int, default=2)
    ap.add_argument("--child", choices=("off", "on"), help=argparse.SUPPRESS)
    ap.add_argument("--cache", help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="CI: tiny, on the CPU, guarded only")
    args = ap.parse_args()
    if args.smoke:
        smoke_sizes()
    if args.child:
        return child(args.child, args.cache)
    if args.smoke:
        return smoke(args)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {', '.join(unknown)}; valid: {', '.join(PARTS)}")
    import torch

    if not torch.cuda.is_available():
        print("bench_kernel: needs a CUDA GPU")
        return 2
    t0 = time.perf_counter()
    if "fresh" in parts:  # first: this process has not touched the GPU yet
        try:
            lines = fresh_part(args)
        except Exception as exc:
            lines = [f"fresh: error: {type(exc).__name__}: {str(exc)[:2000]}"]
        print("\n".join(lines), flush=True)
        print(f"(fresh part: {time.perf_counter() - t0:.0f} s)", flush=True)
    parts = [p for p in parts if p != "fresh"]
    if not parts:
        return 0
    import flash_attn
    import transformers

    import attnguard
    from attnguard.observability import events

    # a cache of its own: every decision is measured in this run, none read from an earlier one
    attnguard.activate(
        log="none", kernel="requested", kernel_cache=tempfile.mkdtemp(prefix="attnguard-bench-")
    )
    print(
        f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; transformers "
        f"{transformers.__version__}; flash-attn {flash_attn.__version__}"
    )
    print(f"one process: rounds {args.rounds}, iters {args.iters}; ratio = time switch off / on")
    print("| measured | off ms | on ms | ratio [min, max] |")
    print("|---|---|---|---|")
    table = {"dense": dense_parts, "packed": packed_part, "decode": decode_part, "7b": seven_b_part}
    with events.capture() as seen:
        for part in parts:
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
    print(f"(total: {time.perf_counter() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
