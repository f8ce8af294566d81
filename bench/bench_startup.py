"""Start-up cost of the attnguard hook, whole processes side by side (docs/benchmarks.md).

Fresh venvs, identical but for attnguard: one without it, one with this checkout pip-installed
(its .pth hook runs at every interpreter start), and with ``--baseline DIR`` one with another
checkout (the code before a change). Every venv sees this environment's packages (torch,
transformers, wrapt, structlog) through a .pth file, so only attnguard differs. Each row runs two
commands alternately, ``--pairs`` times, and reports the medians of the wall time and of the
child's peak RSS (``wait4``), and their difference:

* ``python -c pass`` without attnguard vs with it installed and ``ATTNGUARD`` unset
  (budget: < 2 ms);
* ``python -c pass`` with ``ATTNGUARD`` unset vs ``ATTNGUARD=1``: a process that never imports
  transformers, flash_attn or xformers (budget: 5 ms and 1 MiB);
* ``python -c "import transformers"`` with ``ATTNGUARD=0`` vs ``1`` (no model loaded): what
  activation adds once a guarded library is imported;
* with ``--baseline``: the last two rows again for the baseline checkout.

The machine this runs on is shared: run it on a quiet machine or read the medians with the
spread printed beside them.

    python bench/bench_startup.py [--pairs 30] [--baseline /path/to/other/checkout] [--smoke]
        [--no-bytecode]

``--smoke`` (CI): two pairs per row, no baseline.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import _smoke

REPO = Path(__file__).resolve().parent.parent


def make_venv(root: Path, name: str, source: Path | None, compile_: bool = True) -> Path:
    """A venv with ``source`` pip-installed (None: without attnguard; ``compile_``: with its
    bytecode, as pip installs it); this environment's packages on its path through a .pth that
    sorts before attnguard.pth."""
    venv = root / name
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    if source is not None:
        subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps"]
            + ([] if compile_ else ["--no-compile"])
            + [str(source)],
            check=True,
        )
    site = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "_bench_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return py


def run_once(py: Path, code: str, env: dict[str, str]) -> tuple[float, float, float]:
    """Wall seconds, peak RSS (MiB) and CPU seconds (user + system: what a busy machine's other
    work does not inflate as much) of one ``python -c code``."""
    argv = [str(py), "-c", code]
    devnull = [(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_WRONLY, 0) for fd in (1, 2)]
    t0 = time.perf_counter()
    pid = os.posix_spawn(argv[0], argv, env, file_actions=devnull)
    _, status, usage = os.wait4(pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{argv} failed with env {sorted(k for k in env if 'ATTN' in k)}")
    return wall, usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def pairs(
    a: tuple[Path, str, dict[str, str]], b: tuple[Path, str, dict[str, str]], n: int
) -> dict[str, list[float]]:
    for side in (a, b):  # warm the page cache
        run_once(*side)
    out: dict[str, list[float]] = {k: [] for k in ("a_ms", "b_ms", "a_mib", "b_mib")}
    out.update(a_cpu=[], b_cpu=[])
    for _ in range(n):
        for key, side in (("a", a), ("b", b)):
            wall, rss, cpu = run_once(*side)
            out[f"{key}_ms"].append(wall * 1e3)
            out[f"{key}_mib"].append(rss)
            out[f"{key}_cpu"].append(cpu * 1e3)
    return out


def row(label: str, got: dict[str, list[float]]) -> str:
    med = {k: statistics.median(v) for k, v in got.items()}
    diffs = [b - a for a, b in zip(got["a_ms"], got["b_ms"], strict=True)]
    q = statistics.quantiles(diffs, n=4)
    cpu = [b - a for a, b in zip(got["a_cpu"], got["b_cpu"], strict=True)]
    qc = statistics.quantiles(cpu, n=4)
    return (
        f"| {label} | {med['a_ms']:.1f} | {med['b_ms']:.1f} | {med['b_ms'] - med['a_ms']:+.1f} "
        f"| {statistics.median(diffs):+.1f} [{q[0]:+.1f}, {q[2]:+.1f}] "
        f"| {statistics.median(cpu):+.1f} [{qc[0]:+.1f}, {qc[2]:+.1f}] "
        f"| {med['a_mib']:.2f} | {med['b_mib']:.2f} | {med['b_mib'] - med['a_mib']:+.2f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=30)
    ap.add_argument("--baseline", type=Path, help="another attnguard checkout (before)")
    ap.add_argument("--smoke", action="store_true", help="CI: two pairs per row, no baseline")
    ap.add_argument(
        "--no-bytecode",
        action="store_true",
        help="attnguard installed without bytecode and PYTHONDONTWRITEBYTECODE=1 (a container "
        "image that sets it): every process compiles the modules it imports",
    )
    args = ap.parse_args()
    if args.smoke:
        args.pairs, args.baseline = 2, None
    base = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    for var in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE"):  # as installed: bytecode cached
        base.pop(var, None)
    base.update(HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    if args.no_bytecode:
        base["PYTHONDONTWRITEBYTECODE"] = "1"
    off, on = dict(base, ATTNGUARD="0"), dict(base, ATTNGUARD="1")
    tf_code = "import transformers"
    load0 = os.getloadavg()[0]
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        plain = make_venv(Path(tmp), "plain", None)
        compiled = not args.no_bytecode
        this = make_venv(Path(tmp), "this", REPO, compiled)
        baseline = (
            make_venv(Path(tmp), "baseline", args.baseline, compiled) if args.baseline else None
        )
        cases = [("`-c pass`: no attnguard vs installed, unset", plain, this, "pass", base, base)]
        for before, py in (("", this), (", before", baseline)):
            if py is None:
                continue
            cases += [
                (f"`-c pass`: `ATTNGUARD=0` vs `1`{before}", py, py, "pass", off, on),
                (f"`import transformers`: `ATTNGUARD=0` vs `1`{before}", py, py, tf_code, off, on),
            ]
        for label, py_a, py_b, code, env_a, env_b in cases:
            lines.append(row(label, pairs((py_a, code, env_a), (py_b, code, env_b), args.pairs)))
    import transformers as tf

    print(
        f"{datetime.date.today()}, {platform.machine()} CPU ({os.cpu_count()} cores), Python "
        f"{platform.python_version()}, transformers {tf.__version__}; {args.pairs} alternating "
        f"pairs; load average {load0:.1f} at the start, {os.getloadavg()[0]:.1f} at the end; "
        f"attnguard {'without bytecode (PYTHONDONTWRITEBYTECODE=1)' if args.no_bytecode else 'compiled'}"
    )
    print()
    print(
        "| processes (A vs B) | A ms | B ms | B − A ms | per-pair B − A: median [q1, q3] "
        "| per-pair B − A CPU ms: median [q1, q3] | A MiB | B MiB | B − A MiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    if args.smoke:
        _smoke.ran(f"{len(lines)} rows in fresh venvs with and without this checkout")
        _smoke.skipped("the baseline rows", "no --baseline checkout in smoke mode")
        raise SystemExit(_smoke.done())


if __name__ == "__main__":
    main()
