"""Benchmark: what the guard costs where nothing is wrong (CPU).

A fresh interpreter loads a tiny Llama checkpoint with ``attn_implementation="sdpa"`` (nothing to
remedy), on a machine where xformers (the PyPI wheel, whose ops do not load here) and a broken
flash-attn (built without its CUDA extension) are installed: unguarded, and with ``ATTNGUARD=1``
(the start-up hook). Runs alternate (A B B A ...); medians over ``--runs`` pairs.

Measured: the wall time of the whole process and of the ``from_pretrained`` call alone, the
modules the guarded process imported that the unguarded one did not (by top-level package), and
the lines each printed on stderr (console format, default level).

    python bench/bench_quiet.py [--runs 15] [--broken-flash DIR] [--smoke]

``--broken-flash`` (default: $TEST_BROKEN_FLASH_ATTN_DIR, as scripts/test.sh builds it) is put on
the children's PYTHONPATH. attnguard must be installed (``pip install -e .``) for the hook.
``--smoke`` (CI): one pair.
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

import _smoke

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch, transformers
path = sys.argv[1]
t1 = time.perf_counter()
model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
t2 = time.perf_counter()
with torch.no_grad():
    model(input_ids=torch.tensor([[1, 2, 3, 4]]))
print("RESULT" + json.dumps({"load_s": t2 - t1, "modules": sorted(sys.modules)}))
"""


def make_checkpoint(path: Path) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def run(path: Path, guarded: bool, broken: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    env["HF_HUB_OFFLINE"] = "1"
    if broken:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (broken, env.get("PYTHONPATH")) if p)
    if guarded:
        env["ATTNGUARD"] = "1"
        env["ATTNGUARD_LOG_FORMAT"] = "console"
    start = __import__("time").perf_counter()
    res = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)], env=env, capture_output=True, text=True
    )
    wall = __import__("time").perf_counter() - start
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    if res.returncode != 0 or not line:
        raise SystemExit(f"child failed ({res.returncode}): {res.stderr[-2000:]}")
    out = json.loads(line[0][len("RESULT") :])
    noise = [x for x in res.stderr.splitlines() if "it/s]" not in x and x.strip()]
    out.update(wall_s=wall, stderr_lines=noise)
    return out


def top(modules: set[str]) -> list[str]:
    return sorted({m.split(".")[0] for m in modules})


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--broken-flash", default=os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR"))
    ap.add_argument("--smoke", action="store_true", help="CI: one pair of runs")
    args = ap.parse_args()
    if args.smoke:
        args.runs = 1
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny"
        make_checkpoint(path)
        plain, guarded = [], []
        for i in range(args.runs):
            order = (False, True) if i % 2 == 0 else (True, False)
            for g in order:
                (guarded if g else plain).append(run(path, g, args.broken_flash))
    extra = set(guarded[0]["modules"]) - set(plain[0]["modules"])
    for r in guarded[1:]:
        extra &= set(r["modules"]) - set(plain[0]["modules"])

    def med(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows) * 1000

    import platform

    print(f"{platform.machine()} CPU, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(f"broken flash-attn on path: {bool(args.broken_flash)}; runs: {args.runs} pairs")
    print("| | unguarded | ATTNGUARD=1 | added |")
    print("|---|---|---|---|")
    for key, label in (("wall_s", "process wall time, ms"), ("load_s", "from_pretrained, ms")):
        a, b = med(plain, key), med(guarded, key)
        print(f"| {label} (median) | {a:.1f} | {b:.1f} | {b - a:+.1f} |")
    lines = [len(r["stderr_lines"]) for r in guarded]
    print(f"| stderr lines | {max(len(r['stderr_lines']) for r in plain)} | {max(lines)} | |")
    print(f"modules imported by the guarded process only (top-level packages): {top(extra)}")
    print(f"xformers imported: {any(m.startswith('xformers') for m in guarded[0]['modules'])}")
    print(f"flash_attn imported: {any(m.startswith('flash_attn') for m in guarded[0]['modules'])}")
    if max(lines):
        print("guarded stderr:", guarded[0]["stderr_lines"][:10])
    if args.smoke:
        _smoke.ran("one unguarded and one ATTNGUARD=1 load of a tiny Llama")
        if not args.broken_flash:
            _smoke.skipped("the broken flash-attn beside it", "no --broken-flash directory")
        return _smoke.done()
    return 0


if __name__ == "__main__":
    sys.exit(main())
