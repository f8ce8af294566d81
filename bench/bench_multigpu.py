"""Benchmark (not a test): one replica per rank vs every rank spread over every GPU (family C).

    python bench/bench_multigpu.py            # on a machine with >= 2 GPUs

Runs ``torchrun --nproc-per-node=2`` twice on the same script, which loads a Qwen2-0.5B-shaped
random model (bf16) with ``device_map="auto"`` after ``torch.cuda.set_device(LOCAL_RANK)`` (the
family C pattern) and generates (batch 8, 64 new tokens, greedy) on every rank at once:

* unguarded (ATTNGUARD=0): every rank spreads its copy over both GPUs;
* guarded (ATTNGUARD=1, attnguard installed): device_map rewritten to one GPU per rank;
* by hand (no attnguard, ``device_map={"": local_rank}``): the user's own fix, for reference.

Prints per-rank generate throughput, the guarded/unguarded ratio (target >= 1.8x; ~1.9x
measured on two H200s with a 7B-shaped model) and peak memory per GPU, with the device names. Guarded and by hand run the same
configuration, so their ratio (target >= 0.97) is measured in ``--rounds`` alternating rounds
(by hand first in even rounds, guarded first in odd ones): the median of the per-round ratios
[min, max]; a single pair of torchrun processes differs by process-to-process noise alone. Exits 0 with a message when fewer
than two GPUs are visible. ``--guard-by-hand`` makes the guarded workers call
attnguard.plan.device_map.plan_from_environment themselves (before the loading wrapper is wired).
``--smoke`` (CI): one guarded ``torchrun --nproc-per-node=2`` on the CPU (gloo) with a 2-layer
model of width 64, and its report; the GPU comparisons are said to be skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# Qwen2-0.5B's shape (random weights): 24 layers, width 896, 14 heads / 2 KV heads, ~494M params
QWEN2_05B = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}


SMOKE_SIZE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
SMOKE_SIZE |= {"num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}


def make_model(path: Path, smoke: bool = False) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**(QWEN2_05B | SMOKE_SIZE if smoke else QWEN2_05B))
    config.torch_dtype = torch.bfloat16
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)


def worker(args: argparse.Namespace) -> None:
    import torch
    from transformers import Qwen2ForCausalLM

    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    rank = int(os.environ.get("RANK", 0))
    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(local_rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    n_gpus = torch.cuda.device_count() if cuda else 0
    device_map: Any = {"": f"cuda:{local_rank}"} if args.per_rank_by_hand else "auto"
    import transformers

    release = tuple(int(x) for x in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if release >= (4, 56) else "torch_dtype"  # dtype= from 4.56
    kwargs: dict[str, Any] = {"device_map": device_map, dtype_kw: torch.bfloat16}
    if args.guard_by_hand:
        from attnguard.plan.device_map import plan_from_environment

        decision = plan_from_environment("auto")
        if decision is not None:
            kwargs["device_map"] = decision.device_map
            if decision.max_memory is not None:
                kwargs["max_memory"] = decision.max_memory
    model = Qwen2ForCausalLM.from_pretrained(args.model, **kwargs).eval()
    g = torch.Generator().manual_seed(rank)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (args.batch, args.prompt), generator=g)
    ids = ids.to(f"cuda:{local_rank}" if cuda else "cpu")
    gen = {
        "max_new_tokens": args.new_tokens,
        "min_new_tokens": args.new_tokens,
        "do_sample": False,
        "pad_token_id": 0,
    }

    # only the GPUs this rank uses: touching another would create a CUDA context there
    used = sorted({p.device.index for p in model.parameters() if p.device.type == "cuda"})
    used = sorted(set(used) | {local_rank}) if cuda else []

    def sync() -> None:
        for i in used:
            torch.cuda.synchronize(i)

    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), **gen)  # warm-up
        times = []
        for _ in range(args.reps):
            torch.distributed.barrier()  # both ranks generate at the same time, as in a job
            sync()
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **gen)
            sync()
            times.append(time.perf_counter() - start)
    new = out.shape[1] - ids.shape[1]
    result = {
        "rank": rank,
        "local_rank": local_rank,
        "attnguard_active": "attnguard" in sys.modules and sys.modules["attnguard"].is_active(),
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "tokens_per_s": args.batch * new / statistics.median(times),
        "times_s": times,
        "new_tokens": new,
        "peak_gib": {f"cuda:{i}": torch.cuda.max_memory_allocated(i) / 2**30 for i in used},
        "device_names": [torch.cuda.get_device_name(i) for i in range(n_gpus)],
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def launch(
    label: str,
    guarded: bool,
    args: argparse.Namespace,
    model: Path,
    base: Path,
    per_rank_by_hand: bool = False,
) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["ATTNGUARD"] = "1" if guarded else "0"
    env["ATTNGUARD_LOG"] = str(base / label / "events-{rank}.jsonl")
    out = base / label
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [__file__, "--worker", "--model", str(model), "--out", str(out)]
    cmd += ["--batch", str(args.batch), "--prompt", str(args.prompt)]
    cmd += ["--new-tokens", str(args.new_tokens), "--reps", str(args.reps)]
    if guarded and args.guard_by_hand:
        cmd.append("--guard-by-hand")
    if per_rank_by_hand:
        cmd.append("--per-rank-by-hand")
    if args.smoke:
        cmd.append("--smoke")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        print(
            f"[{label}] torchrun failed (rc={res.returncode}):\n{(res.stdout + res.stderr)[-4000:]}"
        )
    ranks = {}
    for r in (0, 1):
        path = out / f"rank{r}.json"
        ranks[r] = json.loads(path.read_text()) if path.exists() else None
    return ranks


def report(runs: dict[str, dict], gpus: list[str]) -> None:
    """One row per run and rank: guard, where the parameters are, throughput, peak memory."""
    header = (
        f"{'run':<10} {'rank':>4} {'guard':>5} {'param devices':<16} {'tok/s':>8}  "
        + "  ".join(f"{'peak ' + g + ' GiB':>16}" for g in gpus)
    )
    print(header)
    print("-" * len(header))
    for label, ranks in runs.items():
        for r, res in ranks.items():
            if res is None:
                print(f"{label:<10} {r:>4}   (no result)")
                continue
            peaks = "  ".join(f"{res['peak_gib'].get(g, 0.0):>16.2f}" for g in gpus)
            print(
                f"{label:<10} {r:>4} {str(res['attnguard_active']):>5} "
                f"{','.join(res['param_devices']):<16} {res['tokens_per_s']:>8.1f}  {peaks}"
            )


def smoke(args: argparse.Namespace) -> int:
    import _smoke

    with tempfile.TemporaryDirectory(prefix="bench_multigpu_") as tmp:
        base = Path(tmp)
        model = base / "tiny"
        make_model(model, smoke=True)
        runs = {"guarded": launch("guarded", True, args, model, base)}
    report(runs, [])
    if any(res is None or not res["attnguard_active"] for res in runs["guarded"].values()):
        print("bench_multigpu: the guarded launch did not report from both ranks, guarded")
        return 1
    _smoke.ran("a guarded torchrun x2 launch on the CPU (gloo) and its report")
    for part in ("unguarded launch", "by-hand launches", "the throughput ratios"):
        _smoke.skipped(part, "a comparison of GPU placements: needs 2 CUDA GPUs")
    return _smoke.done()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model")
    parser.add_argument("--out")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="alternating guarded/by-hand rounds")
    parser.add_argument("--guard-by-hand", action="store_true")
    parser.add_argument("--per-rank-by-hand", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--smoke", action="store_true", help="CI: one guarded launch on the CPU")
    args = parser.parse_args()
    if args.smoke:
        args.batch, args.prompt, args.new_tokens, args.reps = 1, 8, 2, 1
    if args.worker:
        worker(args)
        return 0
    if args.smoke:
        return smoke(args)

    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < 2:
        print(
            f"bench_multigpu: needs 2 or more CUDA GPUs, this machine has {n}; nothing to measure"
        )
        return 0
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    with tempfile.TemporaryDirectory(prefix="bench_multigpu_") as tmp:
        base = Path(tmp)
        model = base / "qwen2-0.5b-random"
        make_model(model)
        rounds: list[dict[str, dict]] = []
        for i in range(args.rounds):
            # the user's own fix, for reference: device_map={"": local_rank}, no attnguard
            pair = {
                "guarded": lambda i=i: launch(f"guarded{i}", True, args, model, base),
                "by_hand": lambda i=i: launch(
                    f"by_hand{i}", False, args, model, base, per_rank_by_hand=True
                ),
            }
            order = ["by_hand", "guarded"] if i % 2 == 0 else ["guarded", "by_hand"]
            rounds.append({label: pair[label]() for label in order})
        runs = {
            "unguarded": launch("unguarded", False, args, model, base),
            "guarded": rounds[0]["guarded"],
            "by_hand": rounds[0]["by_hand"],
        }
    print(
        f"\nfamily C, torchrun x2, device_map='auto', Qwen2-0.5B-shaped random model, bf16, "
        f"batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new tokens, "
        f"median of {args.reps}; guarded and by-hand rows from round 1 of {args.rounds}"
    )
    print("GPUs: " + ", ".join(f"cuda:{i} {name}" for i, name in enumerate(names)))
    gpus = [f"cuda:{i}" for i in range(n)]
    report(runs, gpus)
    ratios = []
    by_hand_ratios: dict[int, list[float]] = {}
    for r in (0, 1):
        u, g = runs["unguarded"][r], runs["guarded"][r]
        if u and g:
            ratios.append(g["tokens_per_s"] / u["tokens_per_s"])
        per_round = [
            rd["guarded"][r]["tokens_per_s"] / rd["by_hand"][r]["tokens_per_s"]
            for rd in rounds
            if rd["guarded"][r] and rd["by_hand"][r]
        ]
        by_hand_ratios[r] = per_round
        if per_round:
            med = statistics.median(per_round)
            print(
                f"rank {r}: guarded / by-hand device_map={{'': {r}}}: {med:.3f} "
                f"[{min(per_round):.3f}, {max(per_round):.3f}] over {len(per_round)} rounds "
                f"({'meets' if med >= 0.97 else 'misses'} the 0.97 target)"
            )
    if ratios:
        verdict = "meets" if min(ratios) >= 1.8 else "misses"
        print(
            "guarded / unguarded per rank: "
            + ", ".join(f"rank {r}: {x:.2f}x" for r, x in enumerate(ratios))
            + f" ({verdict} the 1.8x target)"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "gpus": names,
                    "runs": runs,
                    "rounds": rounds,
                    "ratios": ratios,
                    "guarded_by_hand": by_hand_ratios,
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
