"""diffusers: what the guard costs where nothing is wrong, and what a backend on attnguard's twins
costs against the kernel it stands for. Unguarded and guarded side by side in one process:
rounds alternate between the two, the median of each is printed with the ratio.

Rows (CPU, always):

* ``dispatch_attention_fn``, native backend, a tiny call: diffusers' dispatcher with its registry
  entry unguarded / guarded (the guard's check on every call);
* the same with a no-op backend function: the guard's own cost, nothing else;
* a tiny Flux transformer forward (``native``), unguarded / guarded: end to end;
* the same model with ``flash`` requested and flash-attn not installed: on attnguard's twin,
  against ``native`` (what the remedy costs against torch's own attention).

On a CUDA GPU (not faked in a smoke run): a Flux-shaped attention call (bf16, 4096 image + 512
text tokens, 24 heads x 128) through ``dispatch_attention_fn`` with ``native``, unguarded /
guarded, and with ``flash`` on the real flash-attn where it is installed, else on the twin.

Usage: PYTHONPATH=. python bench/bench_diffusers.py [--repeats 21] [--number 2000] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _smoke
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "workers"))


def _paired(
    plain: Callable[[], Any], guarded: Callable[[], Any], number: int, repeats: int
) -> tuple[float, float, float]:
    """Median µs per call of each and the median of the per-round differences, rounds
    alternating so drift (clock, other load) hits both alike."""
    a, b = [], []
    for _ in range(repeats):
        a.append(timeit.timeit(plain, number=number) / number * 1e6)
        b.append(timeit.timeit(guarded, number=number) / number * 1e6)
    added = statistics.median(y - x for x, y in zip(a, b, strict=True))
    return statistics.median(a), statistics.median(b), added


def _row(label: str, plain: Callable[[], Any], other: Callable[[], Any], n: int, r: int) -> None:
    plain(), other()  # warm up
    base, with_guard, added = _paired(plain, other, n, r)
    print(f"{label:58s} {base:11.2f} {with_guard:11.2f} {added:+9.2f} {with_guard / base:6.3f}")


def _noop_backend(query: Any, key: Any, value: Any, attn_mask: Any = None, **kw: Any) -> Any:
    return query


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--number", type=int, default=2000)
    ap.add_argument("--smoke", action="store_true", help="CI: every row, a few calls each")
    opts = ap.parse_args()
    if opts.smoke:
        opts.repeats, opts.number = 3, 5
    logging.disable(logging.WARNING)  # diffusers' "experimental feature" warnings
    import attnguard
    from attnguard.integrations.diffusers import calls

    torch.set_num_threads(1)
    attnguard.activate(log="none")
    print(
        f"{datetime.date.today()} device: CPU ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, 1 thread), torch {torch.__version__}; medians over "
        f"{opts.repeats} alternating rounds"
    )
    print(f"{'call':58s} {'plain µs':>11s} {'other µs':>11s} {'added':>9s} {'ratio':>6s}")
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    noop_guarded = calls.wrap("native", _noop_backend)
    kwargs = dict(
        query=q, key=k, value=v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None
    )
    _row(
        "no-op backend function, the dispatcher's kwargs: guard",
        lambda: _noop_backend(**kwargs),
        lambda: noop_guarded(**kwargs),
        opts.number * 5,
        opts.repeats,
    )
    _smoke.ran("no-op backend") if opts.smoke else None
    try:
        import diffusers.models.attention_dispatch as ad
    except Exception as exc:
        if not opts.smoke:
            raise
        _smoke.skipped("the diffusers rows", f"diffusers does not import here ({exc})")
        raise SystemExit(_smoke.done()) from None
    import diffusers_worker as dw

    print(f"diffusers {sys.modules['diffusers'].__version__}")
    registry = ad._AttentionBackendRegistry._backends
    native = ad.AttentionBackendName.NATIVE
    guarded_entry = registry[native]
    original = guarded_entry.__attnguard_original__

    def entry(fn: Any) -> Callable[[], Any]:
        def use() -> None:
            registry[native] = fn

        return use

    def dispatch_with(fn: Any) -> Callable[[], Any]:
        set_it = entry(fn)
        return lambda: (set_it(), ad.dispatch_attention_fn(q, k, v))

    _row(
        "dispatch_attention_fn native (cpu fp32 1x8x2x16): guard",
        dispatch_with(original),
        dispatch_with(guarded_entry),
        opts.number,
        opts.repeats,
    )
    _smoke.ran("dispatch_attention_fn native") if opts.smoke else None
    registry[native] = guarded_entry

    model, inputs = dw.tiny_flux(), dw.flux_inputs()
    n = max(1, opts.number // 100)
    _row(
        "tiny Flux forward, native: guard",
        lambda: (entry(original)(), dw.run(model, inputs)),
        lambda: (entry(guarded_entry)(), dw.run(model, inputs)),
        n,
        opts.repeats,
    )
    registry[native] = guarded_entry
    _smoke.ran("tiny Flux forward") if opts.smoke else None
    if ad.flash_attn_func is None or "attnguard" in str(
        getattr(ad.flash_attn_func, "__module__", "")
    ):
        flash = ad.AttentionBackendName.FLASH
        ad._check_attention_backend_requirements(flash)  # flash-attn missing: the twins
        with_native = lambda: dw.run(model, inputs)  # noqa: E731

        def with_flash() -> Any:
            with ad.attention_backend(flash):
                return dw.run(model, inputs)

        _row("tiny Flux forward: flash on the twin vs native", with_native, with_flash, n, 3)
        _smoke.ran("flash on the twin") if opts.smoke else None
    elif opts.smoke:
        _smoke.skipped("flash on the twin", "flash-attn is installed here")
    if not _smoke.has_cuda():
        if opts.smoke:
            _smoke.skipped("GPU rows", "no CUDA device")
            raise SystemExit(_smoke.done())
        return
    _gpu_rows(ad, original, guarded_entry, opts)
    if opts.smoke:
        raise SystemExit(_smoke.done())


def _gpu_rows(ad: Any, original: Any, guarded_entry: Any, opts: Any) -> None:
    registry = ad._AttentionBackendRegistry._backends
    native = ad.AttentionBackendName.NATIVE
    print(f"device: {torch.cuda.get_device_name()}, ms per call (CUDA events)")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 4608, 24, 128) if not opts.smoke else (1, 256, 4, 64)
    q, k, v = (torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qkv")

    def timed(fn: Callable[[], Any], number: int) -> float:
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(number):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / number

    number = 3 if opts.smoke else 50
    results: dict[str, list[float]] = {}
    flash = ad.AttentionBackendName.FLASH
    ad._check_attention_backend_requirements(flash)
    where = "real flash-attn" if "attnguard" not in str(ad.flash_attn_func.__module__) else "twin"
    cases = {
        "native unguarded": (original, None),
        "native guarded": (guarded_entry, None),
        f"flash ({where})": (guarded_entry, flash),
    }
    for _ in range(opts.repeats if not opts.smoke else 1):
        for label, (fn, backend) in cases.items():
            registry[native] = fn
            ms = timed(lambda b=backend: ad.dispatch_attention_fn(q, k, v, backend=b), number)
            results.setdefault(label, []).append(ms)
    registry[native] = guarded_entry
    base = statistics.median(results["native unguarded"])
    for label, values in results.items():
        ms = statistics.median(values)
        print(f"  {label:30s} {ms:8.3f} ms  {ms / base:6.3f} x native unguarded")
    if opts.smoke:
        _smoke.ran("GPU rows")


if __name__ == "__main__":
    main()
