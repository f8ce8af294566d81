"""Start-up hook cost when ATTNGUARD is unset (budget: < 2 ms), measured side by side.

Two fresh venvs, identical but for attnguard being pip-installed in one (its .pth hook runs at
every interpreter start). Runs ``python -c pass`` alternately in each, many times, and reports
medians and the difference; also times the .pth line itself in-process.

    python bench/bench_startup.py [--runs 40]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_venv(root: Path, name: str, install: bool) -> Path:
    venv = root / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    if install:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(py),
                "install",
                "-q",
                "--no-deps",
                str(REPO),
            ],
            check=True,
        )
    return py


def time_start(py: Path, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run([str(py), "-c", "pass"], env=env, check=True)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=40)
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory() as tmp:
        plain = make_venv(Path(tmp), "plain", install=False)
        guarded = make_venv(Path(tmp), "guarded", install=True)
        for py in (plain, guarded):  # warm the page cache
            time_start(py, env)
        a, b = [], []
        for _ in range(args.runs):
            a.append(time_start(plain, env))
            b.append(time_start(guarded, env))
        pth = (REPO / "hook" / "attnguard.pth").read_text()
        per_line = min(timeit.repeat(lambda: exec(pth, {}), number=1000, repeat=5)) / 1000
    ma, mb = statistics.median(a) * 1e3, statistics.median(b) * 1e3
    print(
        f"device: {platform.processor() or platform.machine()} CPU, Python {platform.python_version()}"
    )
    print(f"{'interpreter start (python -c pass)':40s} {'median ms':>10s}")
    print(f"{'without attnguard':40s} {ma:10.2f}")
    print(f"{'with attnguard installed, ATTNGUARD unset':40s} {mb:10.2f}")
    print(f"{'difference':40s} {mb - ma:10.2f}   (ratio {mb / ma:.3f})")
    print(f"{'the .pth line alone (in-process)':40s} {per_line * 1e3:10.4f}")


if __name__ == "__main__":
    main()
