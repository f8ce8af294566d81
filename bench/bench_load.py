"""Benchmark of the load-time guard on a GPU (not a test).

1. Family A: a bf16 checkpoint loaded with ``attn_implementation="flash_attention_2"`` and no
   ``device_map``. attnguard's remedy (``device_map={"": "cuda:LOCAL_RANK"}`` injected: weights go
   straight to the GPU) vs what users do by hand (load on the CPU, then ``.to("cuda")``): load
   time and peak host RSS, each run in a fresh process.
2. Family E: an fp32 checkpoint loaded with flash and nothing else said. The remedied model
   (attnguard injects ``dtype=bfloat16`` and the placement) vs a hand-configured bf16 model
   (``dtype=torch.bfloat16, device_map="cuda:0"``, attnguard not imported): forward throughput,
   and their ratio (target >= 0.98).

The model is a random Qwen2-0.5B-shaped Qwen2ForCausalLM (no download). Without the real
flash-attn, the flash-attn **stand-in** of ``tests/standins`` (torch SDPA behind flash-attn's
API) is put on the children's path; the table says which one ran.

    python bench/bench_load.py [--repeats 3] [--layers 24] [--batch 8] [--seq 1024]

Needs CUDA: on a machine without it, it says so and exits with status 2. ``--smoke`` (CI): the
remedied child on the CPU with a 2-layer model of width 64 (the others are said to be skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
STANDINS = REPO / "tests" / "standins"
FLASH = "flash_attention_2"
DEV = "cuda"  # "cpu" with --smoke


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


class AnonPeak:
    """Peak anonymous RSS (RssAnon) sampled every 5 ms: the host memory a load really takes.
    VmHWM also counts the checkpoint's mmap-ed file pages, which both loading paths touch."""

    def __init__(self) -> None:
        import threading

        self.peak = _status_kib("RssAnon")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _status_kib("RssAnon"))

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_kib("RssAnon"))


def _qwen2_config(layers: int) -> Any:
    import transformers

    if DEV == "cpu":  # smoke size
        size = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
        return transformers.Qwen2Config(**size, num_attention_heads=4, num_key_value_heads=2)
    return transformers.Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )


def make_checkpoints(root: Path, layers: int) -> dict[str, str]:
    import torch
    import transformers

    out = {}
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(_qwen2_config(layers))
    for dtype in ("float32", "bfloat16"):
        path = root / dtype
        model.to(getattr(torch, dtype)).save_pretrained(path)
        out[dtype] = str(path)
    return out


# --- children (one measurement per fresh process) -------------------------------------------------


def child(mode: str, ckpt: str, batch: int, seq: int) -> dict[str, Any]:
    guarded = mode in ("load_remedy", "fwd_remedied")
    if guarded:
        os.environ["ATTNGUARD_LOG"] = "none"
        import attnguard  # noqa: F401  (importing it activates the guard)
    import torch
    import transformers

    auto = transformers.AutoModelForCausalLM

    def sync() -> None:
        if DEV == "cuda":
            torch.cuda.synchronize()

    if DEV == "cuda":
        torch.cuda.init()
        torch.zeros(1, device="cuda")  # the CUDA context is not part of the load
    rss_before = _status_kib("VmRSS")
    anon_before = _status_kib("RssAnon")
    anon = AnonPeak()
    t0 = time.perf_counter()
    if mode == "load_remedy":
        model = auto.from_pretrained(ckpt, attn_implementation=FLASH, dtype=torch.bfloat16)
    elif mode == "load_manual":
        model = auto.from_pretrained(ckpt, attn_implementation=FLASH, dtype=torch.bfloat16)
        model.to("cuda")
    elif mode == "fwd_remedied":
        model = auto.from_pretrained(ckpt, attn_implementation=FLASH)
    elif mode == "fwd_manual":
        model = auto.from_pretrained(
            ckpt, attn_implementation=FLASH, dtype=torch.bfloat16, device_map="cuda:0"
        )
    else:
        raise SystemExit(f"unknown mode {mode}")
    sync()
    load_s = time.perf_counter() - t0
    anon_peak = anon.stop()
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    params = list(model.parameters())
    result: dict[str, Any] = {
        "mode": mode,
        "load_s": load_s,
        "peak_rss_gib": peak_kib / 2**20,
        "rss_added_gib": (peak_kib - rss_before) / 2**20,
        "anon_added_gib": (anon_peak - anon_before) / 2**20,
        "devices": sorted({str(p.device) for p in params}),
        "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in params}),
        "attn": model.config._attn_implementation,
    }
    if mode.startswith("fwd"):
        ids = torch.randint(0, 1000, (batch, seq), device=DEV)
        model.eval()
        warm, timed = (1, 2) if DEV == "cpu" else (10, 40)
        with torch.no_grad():
            for _ in range(warm):
                model(input_ids=ids)
            sync()
            times = []
            for _ in range(timed):
                if DEV == "cpu":
                    t = time.perf_counter()
                    model(input_ids=ids)
                    times.append(time.perf_counter() - t)
                    continue
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                model(input_ids=ids)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
        result["fwd_s_median"] = statistics.median(times)
        result["tokens_per_s"] = batch * seq / result["fwd_s_median"]
        result["tokens_per_s_best"] = batch * seq / min(times)
    return result


def run_child(mode: str, ckpt: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    cmd = [sys.executable, __file__, "--child", mode, "--ckpt", ckpt]
    cmd += ["--batch", str(args.batch), "--seq", str(args.seq)]
    cmd += ["--smoke"] if args.smoke else []
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    if res.returncode != 0 or not lines:
        raise SystemExit(f"child {mode} failed:\n{res.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULT") :])


def _flash_env() -> tuple[dict[str, str], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    paths = [str(REPO)]
    import importlib.util

    if importlib.util.find_spec("flash_attn") is None:
        paths.insert(0, str(STANDINS))
        which = "flash-attn stand-in (torch SDPA behind flash-attn's API)"
    else:
        which = "flash-attn (installed)"
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env, which


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def smoke(args: argparse.Namespace) -> int:
    """The guarded child, tiny, on the CPU: the load and the forward of the remedied model."""
    import _smoke

    env, which = _flash_env()
    print(f"flash: {which}")
    with tempfile.TemporaryDirectory() as root:
        ckpts = make_checkpoints(Path(root), args.layers)
        for mode, dtype in (("fwd_remedied", "float32"),):
            r = run_child(mode, ckpts[dtype], args, env)
            shown = {k: v for k, v in r.items() if not k.endswith("_gib")}
            print(f"{mode}: {json.dumps(shown)}")
            _smoke.ran(f"{mode} ({r['attn']}, {','.join(r['dtypes'])} on {','.join(r['devices'])})")
    for mode in ("load_manual", "fwd_manual"):
        _smoke.skipped(mode, "the hand-made load puts the model on a CUDA GPU")
    _smoke.skipped("load_remedy", "its load is fwd_remedied's (one CPU process is enough)")
    _smoke.skipped("the placement and cast remedies", "no CUDA GPU here: nothing to place or cast")
    return _smoke.done()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--ckpt", help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--smoke", action="store_true", help="CI: the remedied child, on the CPU")
    args = parser.parse_args()
    if args.smoke:
        global DEV
        DEV = "cpu"
        args.batch, args.seq = 1, 16
    if args.child:
        print("RESULT" + json.dumps(child(args.child, args.ckpt, args.batch, args.seq)))
        return 0

    import torch

    if args.smoke:
        return smoke(args)
    if not torch.cuda.is_available():
        print("bench_load.py needs a CUDA GPU; none is visible here. Nothing measured.")
        return 2
    env, which = _flash_env()
    device = torch.cuda.get_device_name(0)
    with tempfile.TemporaryDirectory() as root:
        ckpts = make_checkpoints(Path(root), args.layers)
        runs: dict[str, list[dict]] = {m: [] for m in ("load_remedy", "load_manual")}
        for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
            for mode in runs:
                runs[mode].append(run_child(mode, ckpts["bfloat16"], args, env))
        fwd: dict[str, list[dict]] = {m: [] for m in ("fwd_remedied", "fwd_manual")}
        for _ in range(args.repeats):
            for mode in fwd:
                fwd[mode].append(run_child(mode, ckpts["float32"], args, env))

    rows = []
    for mode, label in (
        ("load_remedy", "A: attnguard remedy (device_map injected)"),
        ("load_manual", "A: load on CPU, then .to('cuda')"),
    ):
        r = runs[mode]
        rows.append(
            [
                label,
                f"{_median(r, 'load_s'):.2f} s",
                f"{_median(r, 'peak_rss_gib'):.2f} GiB",
                f"{_median(r, 'rss_added_gib'):.2f} GiB",
                f"{_median(r, 'anon_added_gib'):.2f} GiB",
                ",".join(r[0]["devices"]),
            ]
        )
    remedied = _median(fwd["fwd_remedied"], "tokens_per_s")
    manual = _median(fwd["fwd_manual"], "tokens_per_s")
    best_ratio = max(r["tokens_per_s_best"] for r in fwd["fwd_remedied"]) / max(
        r["tokens_per_s_best"] for r in fwd["fwd_manual"]
    )
    print(f"device: {device}; torch {torch.__version__}; flash: {which}")
    print(
        f"model: random Qwen2 ({args.layers} layers, hidden 896), "
        f"median of {args.repeats} fresh processes each"
    )
    print()
    header = [
        "family A load",
        "load time",
        "peak host RSS",
        "RSS added by load",
        "anon RSS added",
        "params on",
    ]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print()
    e = fwd["fwd_remedied"][0]
    print(
        f"family E forward (batch {args.batch} x seq {args.seq}): remedied "
        f"{remedied:,.0f} tok/s ({','.join(e['dtypes'])} on {','.join(e['devices'])}, {e['attn']}) "
        f"vs hand-configured bf16 {manual:,.0f} tok/s -> ratio {remedied / manual:.3f} "
        f"(medians; best-iteration ratio {best_ratio:.3f})"
    )
    print(
        "per process, tok/s: remedied "
        + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in fwd["fwd_remedied"])
        + "; hand-configured "
        + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in fwd["fwd_manual"])
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": device, "flash": which, "load": runs, "forward": fwd}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
