"""CPU microbenchmark: cost the call-time guard adds on the fast path (nothing wrong).

Each row times the same call unguarded and guarded, side by side in one process: rounds of a
tight loop alternate between the two, and "added" is the median of the per-round differences.
Rows:

* registry sdpa, real kernel: transformers' sdpa registry function on a tiny CPU call;
* registry sdpa / flash_attention_2, no-op kernel: the guard wrapped around a function that
  returns at once, which isolates the guard's own cost (flash needs CUDA tensors for its fast
  path, so that row uses bf16 tensors on the "meta" device: same checks, no kernel);
* flash_attn_func / xformers memory_efficient_attention direct entry points, no-op kernel, meta;
* ``ATTNGUARD_KERNEL=fastest``, a decided bucket: a decode-shaped ``flash_attn_func`` call (1
  query token, 1024 keys; ``generate``'s) and a ``flash_attn_with_kvcache`` decode call, under
  ``no_grad`` and with autograd on, each against the kernel that serves the bucket called
  directly (here the no-op kernel one layer down, as a winner's implementation calls it). Meta
  tensors are no CUDA call, so the decision is planted as a decided bucket's would be.

Usage: PYTHONPATH=. python bench/bench_call_overhead.py [--repeats 41] [--number 5000] [--smoke]
[--only TEXT] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import platform
import statistics
import time
import timeit
from collections.abc import Callable, Iterator
from typing import Any

import _smoke
import torch

import attnguard
from attnguard import callguard, kernels, runtime
from attnguard.integrations.flash_attn import entries as flash_entries
from attnguard.integrations.transformers import attention
from attnguard.integrations.xformers import entries as xformers_entries

# label, the unguarded call, the guarded one, and what the row runs under (None: as set up)
Row = tuple[str, Callable[[], Any], Callable[[], Any], Callable[[], Any] | None]


def _paired_ns(
    plain: Callable[[], Any],
    guarded: Callable[[], Any],
    number: int,
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[float, float, float]:
    """Median ns per call of each, and the median of the per-round differences.

    The two run alternately, round after round, so drift (clock, other load) hits both alike.
    """
    base, with_guard, added = [], [], []
    for _ in range(repeats):
        p = timeit.timeit(plain, number=number, timer=clock) / number * 1e9
        g = timeit.timeit(guarded, number=number, timer=clock) / number * 1e9
        base.append(p)
        with_guard.append(g)
        added.append(g - p)
    return statistics.median(base), statistics.median(with_guard), statistics.median(added)


def _noop_attention(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
    return query, None


def _noop_flash(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
    return q


def _noop_xformers(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
    return query


def _direct_entry(name: str, kind: str, original: Callable[..., Any]) -> callguard.Entry:
    """The entry the flash_attn / xformers patches build, around a no-op kernel."""
    if kind == kernels.EntryKind.FLASH_KERNEL:
        tensors, mask = flash_entries.FLASH_TENSOR_PARAMS[name], None
    else:
        tensors, mask = xformers_entries.XFORMERS_TENSOR_PARAMS, "attn_bias"
    return callguard.Entry(
        name,
        kind,
        original,
        tensors=tensors,
        twin=original,
        mask=mask,
        site=f"bench.{name}",
        head_axis=flash_entries.FLASH_HEAD_AXIS.get(name, -1),
        in_force=runtime.IN_FORCE,
    )


def _fastest_rows() -> list[Row]:
    """Decode calls, guarded with nothing to fix and under fastest with the bucket decided."""
    from attnguard.selection import served

    out: list[Row] = []
    meta = dict(dtype=torch.bfloat16, device="meta")
    seqlens = torch.empty(1, dtype=torch.int32, device="meta")
    extra = {
        "flash_attn_func": {"softmax_scale": 0.125, "causal": True},
        "flash_attn_with_kvcache": {"cache_seqlens": seqlens, "causal": True},
    }
    for name, kw in extra.items():
        for grad in (False, True):
            q = torch.empty(1, 1, 14, 64, **meta).requires_grad_(grad)
            kv = torch.empty(1, 1024, 2, 64, **meta).requires_grad_(grad)
            args = (q, kv, kv)
            guarded = callguard.wrap_direct(
                _direct_entry(name, kernels.EntryKind.FLASH_KERNEL, _noop_flash)
            )

            def serving(a: tuple[Any, ...], k: dict[str, Any]) -> Any:  # a winner's impl
                return _noop_flash(*a, **k)

            def plant(name: str = name, args: tuple[Any, ...] = args, kw: dict = kw) -> None:
                served.remember(name, served.signature(name, args, kw), kw, [0], serving, True)

            how = "autograd" if grad else "no_grad"
            out.append(
                (
                    f"{name}, guarded, decode, {how} (meta bf16)",
                    lambda a=args, k=kw: _noop_flash(*a, **k),
                    lambda g=guarded, a=args, k=kw: g(*a, **k),
                    functools.partial(torch.set_grad_enabled, grad),
                )
            )
            out.append(
                (
                    f"{name}, fastest, decided, {how} (vs its kernel)",
                    lambda a=args, k=kw: serving(a, k),
                    lambda g=guarded, a=args, k=kw: g(*a, **k),
                    functools.partial(_fastest, grad, plant),
                )
            )
    return out


@contextlib.contextmanager
def _fastest(grad: bool, plant: Callable[[], None]) -> Iterator[None]:
    """Fastest on with the row's bucket decided, autograd as the row says; then as before."""
    attnguard.configure(kernel="fastest")
    try:
        with torch.set_grad_enabled(grad):
            plant()
            yield
    finally:
        from attnguard.selection import decisions

        decisions.reset()
        attnguard.configure(kernel="requested")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=41)
    ap.add_argument("--number", type=int, default=5000)
    ap.add_argument("--smoke", action="store_true", help="CI: every row, a few calls each")
    ap.add_argument("--only", default="", help="the rows whose label holds this text")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: this thread's CPU time (on a shared machine, time others take is not counted)",
    )
    opts = ap.parse_args()
    if opts.smoke:
        opts.repeats, opts.number = 3, 20
    torch.set_num_threads(1)
    attnguard.activate(log="none")

    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Linear(4, 4)
    module.is_causal = True  # type: ignore[assignment]
    cpu = dict(dtype=torch.float32)
    q = torch.randn(1, 2, 8, 16, **cpu)
    k = torch.randn(1, 2, 8, 16, **cpu)
    v = torch.randn(1, 2, 8, 16, **cpu)
    meta = dict(dtype=torch.bfloat16, device="meta")
    mq, mk, mv = (torch.empty(1, 8, 2, 16, **meta) for _ in range(3))
    mq4, mk4, mv4 = (torch.empty(1, 2, 8, 16, **meta) for _ in range(3))
    mask2d = torch.ones(1, 8, dtype=torch.long, device="meta")

    rows: list[Row] = []
    guarded_sdpa = attention.wrap_registry_entry("sdpa", sdpa_attention_forward)
    rows.append(
        (
            "registry sdpa, real kernel (cpu fp32 1x2x8x16)",
            lambda: sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=None),
            lambda: guarded_sdpa(module, q, k, v, None, dropout=0.0, scaling=None),
            None,
        )
    )
    noop_sdpa = attention.wrap_registry_entry("sdpa", _noop_attention)
    rows.append(
        (
            "registry sdpa, no-op kernel (cpu)",
            lambda: _noop_attention(module, q, k, v, None, dropout=0.0, scaling=None),
            lambda: noop_sdpa(module, q, k, v, None, dropout=0.0, scaling=None),
            None,
        )
    )
    noop_flash = attention.wrap_registry_entry("flash_attention_2", _noop_attention)
    rows.append(
        (
            "registry flash_attention_2, no-op kernel (meta bf16, 2D mask)",
            lambda: _noop_attention(module, mq4, mk4, mv4, mask2d, dropout=0.0, scaling=None),
            lambda: noop_flash(module, mq4, mk4, mv4, mask2d, dropout=0.0, scaling=None),
            None,
        )
    )
    flash_direct = callguard.wrap_direct(
        _direct_entry("flash_attn_func", kernels.EntryKind.FLASH_KERNEL, _noop_flash)
    )
    rows.append(
        (
            "flash_attn_func, no-op kernel (meta bf16)",
            lambda: _noop_flash(mq, mk, mv, causal=True),
            lambda: flash_direct(mq, mk, mv, causal=True),
            None,
        )
    )
    xf_direct = callguard.wrap_direct(
        _direct_entry("memory_efficient_attention", kernels.EntryKind.XFORMERS, _noop_xformers)
    )
    rows.append(
        (
            "xformers memory_efficient_attention, no-op kernel (meta bf16)",
            lambda: _noop_xformers(mq, mk, mv, None),
            lambda: xf_direct(mq, mk, mv, None),
            None,
        )
    )

    rows += _fastest_rows()

    cpu_name = platform.processor() or platform.machine()
    print(
        f"device: CPU ({cpu_name}, {os.cpu_count()} cores), torch {torch.__version__}, "
        f"python {platform.python_version()}, 1 thread; medians over {opts.repeats} alternating "
        f"rounds of {opts.number} calls each; clock: {opts.clock}"
    )
    print(f"{'call':68s} {'unguarded ns':>13s} {'guarded ns':>11s} {'added ns':>9s}")
    for label, plain, guarded, context in rows:
        if opts.only not in label:
            continue
        with context() if context is not None else contextlib.nullcontext():
            plain(), guarded()  # warm up
            clock = time.thread_time if opts.clock == "cpu" else time.perf_counter
            base, with_guard, added = _paired_ns(plain, guarded, opts.number, opts.repeats, clock)
        print(f"{label:68s} {base:13.0f} {with_guard:11.0f} {added:9.0f}")
        if opts.smoke:
            _smoke.ran(label)
    if opts.smoke:
        raise SystemExit(_smoke.done())


if __name__ == "__main__":
    main()
