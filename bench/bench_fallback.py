"""GPU benchmark: the run a user gets from ``from_pretrained(fp32_checkpoint,
attn_implementation="flash_attention_2")`` (no dtype, no device_map: family E's call) with
attnguard, against the run they would write by hand with a working flash-attn.

Scenarios, each in a fresh process (flash-attn's availability is a per-process fact):

* ``hand_fa2``: unguarded, real flash-attn, ``dtype=torch.bfloat16, device_map="cuda:0"`` — the
  hand-fixed reference every ratio is taken against;
* ``guarded_fa2``: attnguard, real flash-attn usable (attnguard casts and places);
* ``guarded_broken``: attnguard, flash-attn installed but its CUDA extension failing to import
  (a ``flash_attn_2_cuda`` that raises ImportError, as a build for another torch does): the flash
  code path on the SDPA twins, cast to bf16 and placed on cuda:0 (the run flash would have had);
* ``guarded_absent``: attnguard, flash-attn not installed (same remedy);
* ``hand_sdpa``: unguarded ``attn_implementation="sdpa"`` in bf16 on cuda:0, for context.

Measured per scenario: prefill (``--batch`` x ``--seq`` tokens, one forward, no cache) and decode
(``--batch`` sequences, one token per step against a ``--seq``-token KV cache), median ms over
``--iters`` timed iterations after warm-up (CUDA events). Ratios are hand_fa2 time / scenario
time (>= 1.0: at least as fast as the hand-fixed flash run).

    python bench/bench_fallback.py [--layers 24] [--batch 4] [--seq 2048] [--iters 20]

Needs CUDA and the real flash-attn on PYTHONPATH (scripts/gpu_suite.sh); exits 2 without CUDA.
``--smoke`` (CI): a 2-layer model of width 64 on the CPU, the ``guarded_broken`` scenario (the
others need a GPU, or run the same code), wall-clock times; the others are said to be skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
FLASH = "flash_attention_2"
DEV = "cuda"  # "cpu" with --smoke
SCENARIOS = ("hand_fa2", "guarded_fa2", "guarded_broken", "guarded_absent", "hand_sdpa")
# ab_fa2 (run last): the guard switched off and on in one process over a hand-fixed FA2 model


def qwen2_05b(layers: int) -> Any:
    from transformers import Qwen2Config

    if DEV == "cpu":  # smoke size
        size = dict(vocab_size=150001, hidden_size=64, intermediate_size=128)
        return Qwen2Config(
            **size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
        )
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    )


def make_checkpoint(path: Path, layers: int) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = qwen2_05b(layers)
    cfg._attn_implementation = "sdpa"
    with torch.device(DEV):
        model = Qwen2ForCausalLM(cfg)  # float32: the checkpoint family E's users have
    model.save_pretrained(path)


def time_ms(fn: Any, iters: int) -> float:
    """Median of ``iters`` timed calls (CUDA events) after 3 warm-up calls."""
    import time

    import torch

    if DEV == "cpu":  # smoke: wall clock
        fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]
    for _ in range(3):
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
    times.sort()
    return times[len(times) // 2]


def workloads(model: Any, batch: int, seq: int) -> tuple[Any, Any]:
    """(prefill, decode): a ``batch`` x ``seq`` forward without cache, and one decode step per
    sequence against a ``seq``-token KV cache (cropped back after each step, so every step sees
    the same context length). Call under ``torch.no_grad()``."""
    import torch
    from transformers import DynamicCache

    g = torch.Generator(device=DEV).manual_seed(0)
    ids = torch.randint(3, 150000, (batch, seq), device=DEV, generator=g)
    cache = DynamicCache()
    model(input_ids=ids, past_key_values=cache, use_cache=True)
    step = ids[:, -1:]

    def prefill() -> None:
        model(input_ids=ids, use_cache=False)

    def decode() -> None:
        model(input_ids=step, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # back to the same context length (a negative count: every release)

    return prefill, decode


def child(scenario: str, path: str, batch: int, seq: int, iters: int) -> dict[str, Any]:
    """One scenario, in this process: load as the user would, then time prefill and decode."""
    import torch

    if scenario.startswith("guarded"):
        os.environ["ATTNGUARD_LOG"] = "none"
        import attnguard  # noqa: F401  (importing activates)
        from attnguard.observability import events

        events.reset_counts()
    from transformers import AutoModelForCausalLM

    if scenario == "hand_fa2":
        kw: dict[str, Any] = {"attn_implementation": FLASH, "dtype": torch.bfloat16}
        kw["device_map"] = "cuda:0"
    elif scenario == "hand_sdpa":
        kw = {"attn_implementation": "sdpa", "dtype": torch.bfloat16, "device_map": "cuda:0"}
    else:
        kw = {"attn_implementation": FLASH}  # the seed call: nothing else said
    model = AutoModelForCausalLM.from_pretrained(path, **kw).eval()
    p = next(model.parameters())
    info: dict[str, Any] = {
        "scenario": scenario,
        "attn_implementation": model.config._attn_implementation,
        "dtype": str(p.dtype).replace("torch.", ""),
        "device": str(p.device),
    }
    if scenario.startswith("guarded"):
        info["events"] = sorted({f"{k[0]}:{k[2]}" for k in events.counts() if k[0] != "activated"})
    try:
        import flash_attn_2_cuda  # noqa: F401

        info["flash_attn_kernel"] = "importable"
    except ImportError as exc:
        info["flash_attn_kernel"] = f"not importable ({type(exc).__name__})"
    if p.device.type != DEV:
        info["error"] = f"the model is not on the {DEV}"
        return info
    with torch.no_grad():
        prefill, decode = workloads(model, batch, seq)
        info["prefill_ms"] = time_ms(prefill, iters)
        info["decode_ms"] = time_ms(decode, iters)
    return info


def child_ab(path: str, batch: int, seq: int, iters: int, rounds: int = 9) -> dict[str, Any]:
    """The guard's cost on the real kernel, in one process: a hand-fixed FA2 model timed with the
    guard switched off and on in alternating rounds (A B, B A, ...), so clock drift and process
    differences hit both alike. Returns medians and the median of per-round ratios."""
    import statistics

    import torch

    os.environ["ATTNGUARD_LOG"] = "none"
    import attnguard

    attnguard.deactivate()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, attn_implementation=FLASH, dtype=torch.bfloat16, device_map="cuda:0"
    ).eval()
    with torch.no_grad():
        prefill, decode = workloads(model, batch, seq)
        out: dict[str, Any] = {"scenario": "ab_fa2"}
        for name, fn in (("prefill", prefill), ("decode", decode)):
            off, on, ratios = [], [], []
            for r in range(rounds):
                pair = {}
                for guarded in (r % 2 == 1, r % 2 == 0):
                    if guarded:
                        attnguard.activate(log="none")
                    else:
                        attnguard.deactivate()
                    pair[guarded] = time_ms(fn, iters)
                off.append(pair[False])
                on.append(pair[True])
                ratios.append(pair[False] / pair[True])
            out[f"{name}_off_ms"] = statistics.median(off)
            out[f"{name}_on_ms"] = statistics.median(on)
            out[f"{name}_ratio"] = statistics.median(ratios)
            out[f"{name}_ratio_range"] = [min(ratios), max(ratios)]
    attnguard.deactivate()
    return out


def run_scenario(scenario: str, path: Path, args: argparse.Namespace, broken: Path) -> dict:
    env = dict(os.environ)
    paths = env.get("PYTHONPATH", "").split(os.pathsep)
    if scenario == "guarded_absent":
        # no flash-attn at all: drop the unpacked wheel's directory from the path
        paths = [p for p in paths if p and not (Path(p) / "flash_attn").is_dir()]
    if scenario == "guarded_broken":
        paths = [str(broken), *paths]
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in paths if p]])
    env["HF_HUB_OFFLINE"] = "1"
    env.pop("ATTNGUARD", None)
    cmd = [sys.executable, __file__, "--child", scenario, "--path", str(path)]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq), "--iters", str(args.iters)]
    cmd += ["--smoke"] if args.smoke else []
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    if res.returncode != 0 or not lines:
        return {"scenario": scenario, "error": (res.stderr or res.stdout)[-1500:]}
    return json.loads(lines[-1])


def make_broken(root: Path) -> Path:
    """A flash_attn_2_cuda that fails to import, as a build for another torch does."""
    broken = root / "broken"
    broken.mkdir()
    (broken / "flash_attn_2_cuda.py").write_text(
        "raise ImportError('flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so: undefined "
        "symbol: _ZN3c104cuda9SetDeviceEi (a build for another torch)')\n"
    )
    return broken


def smoke(args: argparse.Namespace) -> int:
    """The scenarios that need no GPU, tiny, on the CPU: loading and running for real."""
    import _smoke

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "tiny-fp32"
        make_checkpoint(ckpt, args.layers)
        broken = make_broken(Path(tmp))
        for scenario in ("guarded_broken",):
            r = run_scenario(scenario, ckpt, args, broken)
            if "prefill_ms" not in r:
                print(f"{scenario}: error: {r.get('error', '?')[-1500:]}")
                return 1
            print(
                f"| {scenario} | {r['attn_implementation']}, {r['dtype']}, {r['device']} "
                f"| {r['flash_attn_kernel']} | prefill {r['prefill_ms']:.2f} ms "
                f"| decode {r['decode_ms']:.2f} ms | events: {', '.join(r['events'])} |"
            )
            _smoke.ran(f"{scenario}: load, prefill and decode on the CPU")
    for scenario in ("hand_fa2", "guarded_fa2", "hand_sdpa", "ab_fa2"):
        _smoke.skipped(scenario, "needs a CUDA GPU and the real flash-attn")
    _smoke.skipped("guarded_absent", "the same code as guarded_broken; one CPU process is enough")
    return _smoke.done()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--child")
    ap.add_argument("--path")
    ap.add_argument("--smoke", action="store_true", help="CI: tiny, on the CPU, no-GPU scenarios")
    args = ap.parse_args()
    if args.smoke:
        global DEV
        DEV = "cpu"
        args.batch, args.seq, args.iters, args.rounds = 1, 16, 1, 1
    if args.child == "ab_fa2":
        print(json.dumps(child_ab(args.path, args.batch, args.seq, args.iters)))
        return 0
    if args.child:
        print(json.dumps(child(args.child, args.path, args.batch, args.seq, args.iters)))
        return 0
    import torch

    if args.smoke:
        return smoke(args)
    if not torch.cuda.is_available():
        print("bench_fallback: needs a CUDA GPU (--smoke runs a tiny CPU version)")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "qwen2-0.5b-fp32"
        make_checkpoint(ckpt, args.layers)
        broken = make_broken(Path(tmp))
        # Fresh processes differ by more than the scenarios do (GPU clocks, allocator state):
        # run the scenarios in --rounds rounds, each in another order, and take each scenario's
        # ratio against hand_fa2 of the same round.
        rounds = []
        for i in range(args.rounds):
            order = SCENARIOS[i % len(SCENARIOS) :] + SCENARIOS[: i % len(SCENARIOS)]
            got = {s: run_scenario(s, ckpt, args, broken) for s in order}
            rounds.append([got[s] for s in SCENARIOS])
        results = rounds[0]
        ab = run_scenario("ab_fa2", ckpt, args, broken)
    print(f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}")
    print(
        f"Qwen2-0.5B shape, {args.layers} layers, fp32 checkpoint; prefill {args.batch}x{args.seq}"
    )
    print(f"tokens, decode batch {args.batch} at context {args.seq}; medians of {args.iters}")
    print(
        f"{args.rounds} round(s) of fresh processes; ms: median over rounds; ratio: hand_fa2 ms /"
    )
    print("scenario ms within each round, median over rounds [min, max]")
    head = "| scenario | loaded as | flash kernel | prefill ms | ratio | decode ms | ratio |"
    print(head)
    print("|---|---|---|---|---|---|---|")
    for k, r in enumerate(results):
        if any("prefill_ms" not in rnd[k] for rnd in rounds):
            err = next(rnd[k] for rnd in rounds if "prefill_ms" not in rnd[k])
            print(f"| {r['scenario']} | error: {err.get('error', '?')[-300:]!r} | | | | | |")
            continue
        loaded = f"{r['attn_implementation']}, {r['dtype']}, {r['device']}"
        cells = []
        for phase in ("prefill_ms", "decode_ms"):
            ms = statistics.median(rnd[k][phase] for rnd in rounds)
            ratios = [rnd[0][phase] / rnd[k][phase] for rnd in rounds if "prefill_ms" in rnd[0]]
            if ratios:
                cells += [
                    f"{ms:.2f}",
                    f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]",
                ]
            else:
                cells += [f"{ms:.2f}", "nan"]
        print(f"| {r['scenario']} | {loaded} | {r['flash_attn_kernel']} | {' | '.join(cells)} |")
    for r in results:
        if r.get("events"):
            print(f"{r['scenario']} events: {', '.join(r['events'])}")
    if "decode_ratio" in ab:
        print(
            "guard on vs off, same process, hand-fixed FA2 model, alternating rounds "
            "(unguarded time / guarded time, median of per-round ratios [min, max]):"
        )
        for name in ("prefill", "decode"):
            lo, hi = ab[f"{name}_ratio_range"]
            print(
                f"  {name}: off {ab[f'{name}_off_ms']:.2f} ms, on {ab[f'{name}_on_ms']:.2f} ms, "
                f"ratio {ab[f'{name}_ratio']:.3f} [{lo:.3f}, {hi:.3f}]"
            )
    else:
        print(f"ab_fa2 error: {ab.get('error', '?')[-500:]}")
    print(json.dumps([*(r for rnd in rounds for r in rnd), ab]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
