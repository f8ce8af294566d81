"""GPU benchmark: the KV-cache twin (``flash_attn_with_kvcache``) against the real kernel, with
every way of computing a decode step measured side by side in ONE process.

A decode step is a few microseconds of GPU work: what it costs is the host's time per call. The
twin's routes and the options weighed for it:

* ``real``: flash-attn 2.8.3's ``flash_attn_with_kvcache`` (one C++ call appends and attends);
* ``twin``: attnguard's twin as it routes (the ``kvcache-decode`` row: one Triton kernel appends
  and attends, the cache split over the GPU; launched directly once compiled);
* ``twin, Triton's launcher``: the same kernel launched through Triton's own entry every call;
* ``twin, torch ops``: the twin's ``kvcache-flash`` row (two ``index_copy_`` appends, the
  lengths, torch's flash kernel with ``seqused_k``): the route where Triton is absent;
* ``torch ops, fewest``: that route written with the fewest torch ops we found (appends by
  ``index_put_`` on int32 positions, aten's op called directly): the floor from torch ops;
* ``CUDA graph``: the torch-ops route captured once and replayed (the caller's inputs copied
  into the graph's buffers, the output copied out: a graph's buffers are overwritten by the
  next replay, so the caller must get a fresh tensor);
* ``varlen_attn``: ``torch.nn.attention.varlen.varlen_attn`` on the cache rows (it has no
  per-sequence key count, so it attends to the whole capacity: host cost only, not a twin).

Parts: ``calls`` (per call, H32/KV8/D128 bf16, one new token, batch 1 and 8, context 1k and 8k:
wall time synchronised per call, and host time with calls queued), ``floor`` (host time of
single torch ops and launches), ``step`` (one decode step of a 24-layer custom model calling
``flash_attn_with_kvcache``, Qwen2-0.5B-shaped), ``numerics`` (the decode kernel vs the real
kernel over head dims, GQA groups, windows, LSE, fp16/bf16, cache splits). Ratio = real time /
other time (>= 1: at least as fast), median of alternating rounds [min, max].

    python bench/bench_kvcache.py [--parts calls,floor,step,numerics] [--rounds 5] [--iters 100]
    python bench/bench_kvcache.py --smoke   # the script's code on CPU, tiny, timings meaningless

``--smoke`` (also ``--dry-run``) runs ``calls`` and ``step`` on CPU with tiny shapes, attnguard's
twins standing in for the real kernel, and asks nothing of a GPU: it checks the script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import _smoke  # noqa: E402
import _twins_models as tm  # noqa: E402  (the decoder model)
import bench_twins as bt  # noqa: E402  (timers, real_flash, the shapes)

PARTS = ("calls", "floor", "step", "numerics")
SMOKE_PARTS = ("calls", "step")
SHAPES = [(1, 1024), (1, 8192), (8, 1024), (8, 8192)]  # (batch, context)
HEADS = (32, 8, 128)


@contextlib.contextmanager
def torch_route() -> Iterator[None]:
    """The twin without its decode kernel: the route it takes where Triton is absent."""
    from attnguard.fallback import triton_decode

    saved = triton_decode.decode
    triton_decode.decode = lambda *a, **k: None
    try:
        yield
    finally:
        triton_decode.decode = saved


@contextlib.contextmanager
def tritons_launcher() -> Iterator[None]:
    """The decode kernel launched through Triton's own entry at every call."""
    from attnguard.fallback import triton_decode

    saved = triton_decode._direct_launch
    triton_decode._direct_launch = lambda compiled: None
    triton_decode._compiled.clear()
    try:
        yield
    finally:
        triton_decode._direct_launch = saved


@contextlib.contextmanager
def one_split() -> Iterator[None]:
    """The decode kernel with the cache unsplit: one launch, one program per kv head and
    sequence (no second, combining kernel)."""
    from attnguard.fallback import triton_decode

    saved = triton_decode._layout
    triton_decode._layout = lambda b, hk, cap, dev: (1, -(-cap // 64) * 64)
    triton_decode._layouts.clear()
    try:
        yield
    finally:
        triton_decode._layout = saved
        triton_decode._layouts.clear()


def wrapped(fn: Callable[[], Any], ctx: Callable[[], Any]) -> Callable[[], Any]:
    def run() -> Any:
        with ctx():
            return fn()

    return run


def inputs(b: int, ctx: int, heads: tuple[int, int, int] = HEADS, dtype: Any = None) -> dict:
    import torch

    h, hk, d = heads
    g = torch.Generator(device=bt.DEV).manual_seed(b * ctx + h)
    kw = {"device": bt.DEV, "dtype": dtype or torch.bfloat16}

    def t(*shape: int) -> Any:
        return torch.randn(*shape, generator=g, device=bt.DEV).to(kw["dtype"])

    cap = ctx + 64
    return {
        "q": t(b, 1, h, d),
        "k_cache": t(b, cap, hk, d),
        "v_cache": t(b, cap, hk, d),
        "k": t(b, 1, hk, d),
        "v": t(b, 1, hk, d),
        "cache_seqlens": torch.full((b,), ctx, dtype=torch.int32, device=bt.DEV),
    }


def call(fn: Any, x: dict, **kw: Any) -> Callable[[], Any]:
    """One decode step's call (the new token written at the same place each time)."""
    q, kc, vc, k, v, sl = (x[n] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens"))
    return lambda: fn(q, kc, vc, k, v, cache_seqlens=sl, causal=True, **kw)


def fewest_ops(x: dict) -> Callable[[], Any]:
    """The torch-ops route with the fewest ops: 2 appends, the lengths, aten's flash op."""
    import torch

    q, kc, vc, k, v, sl = (x[n] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens"))
    b, _, h, d = q.shape
    cap, hk = kc.shape[1], kc.shape[2]
    rows = torch.arange(b, dtype=torch.int32, device=q.device)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    cu_k = cu_q * cap
    op = torch.ops.aten._flash_attention_forward.default
    kf, vf = kc.view(-1, hk, d), vc.view(-1, hk, d)
    k3, v3, q3 = k.view(b, hk, d), v.view(b, hk, d), q.view(b, h, d)
    scale = d**-0.5

    def run() -> Any:
        kc.index_put_((rows, sl), k3)
        vc.index_put_((rows, sl), v3)
        out = op(q3, kf, vf, cu_q, cu_k, 1, cap, 0.0, False, False, scale=scale, seqused_k=sl + 1)
        return out[0].view(b, 1, h, d)

    return run


def graphed(fn: Any, x: dict) -> Callable[[], Any]:
    """``fn``'s call captured in a CUDA graph: per call the inputs are copied in, the graph
    replayed, the output copied out (the caller's tensor must outlive the next replay)."""
    import torch

    st = {n: x[n].clone() for n in ("q", "k", "v")}
    args = (st["q"], x["k_cache"], x["v_cache"], st["k"], st["v"])
    kw = {"cache_seqlens": x["cache_seqlens"], "causal": True}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn(*args, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*args, **kw)

    def run() -> Any:
        st["q"].copy_(x["q"])
        st["k"].copy_(x["k"])
        st["v"].copy_(x["v"])
        graph.replay()
        return out.clone()

    return run


def varlen_attn_call(x: dict) -> Callable[[], Any]:
    import torch
    from torch.nn.attention.varlen import varlen_attn

    q, kc, vc = x["q"], x["k_cache"], x["v_cache"]
    b, _, h, d = q.shape
    cap, hk = kc.shape[1], kc.shape[2]
    kr = kc.repeat_interleave(h // hk, dim=2).view(-1, h, d)
    vr = vc.repeat_interleave(h // hk, dim=2).view(-1, h, d)
    cu_q = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    q3 = q.view(b, h, d)
    return lambda: varlen_attn(q3, kr, vr, cu_q, cu_q * cap, 1, cap)


def options(x: dict, real: Any) -> dict[str, Callable[[], Any]]:
    from attnguard import fallback

    twin = call(fallback.flash_attn_with_kvcache, x)
    out = {
        "twin": twin,
        "twin, Triton's launcher": wrapped(twin, tritons_launcher),
        "twin, torch ops": wrapped(twin, torch_route),
        "twin, cache unsplit (one launch)": wrapped(twin, one_split),
    }
    if bt.DEV == "cuda":  # aten's flash op and graphs need a GPU
        out["torch ops, fewest"] = fewest_ops(x)
        with torch_route():
            out["CUDA graph (torch ops)"] = graphed(fallback.flash_attn_with_kvcache, x)
        out["CUDA graph (decode kernel)"] = graphed(fallback.flash_attn_with_kvcache, x)
        out["varlen_attn (whole capacity, host cost only)"] = varlen_attn_call(x)
    return out


def part_calls(args: argparse.Namespace) -> list[str]:
    fi = bt.real_flash()
    lines = []
    for b, ctx in SHAPES:
        x = inputs(b, ctx)
        real = call(fi.flash_attn_with_kvcache, x)
        try:
            opts = options(x, real)
        except Exception as exc:
            lines.append(f"| B{b} ctx {ctx}: options failed: {type(exc).__name__}: {exc} | | | |")
            continue
        for name, fn in opts.items():
            label = f"B{b} ctx {ctx}: real vs {name}"
            try:
                wall = bt.ab(real, fn, args.rounds, args.iters, timer=bt.wall_ms)
                host = bt.ab(real, fn, args.rounds, args.iters, timer=bt.host_us)
            except Exception as exc:
                lines.append(f"| {label} | error: {type(exc).__name__}: {str(exc)[:200]} | | |")
                continue
            lines.append(bt.row(f"{label} (wall ms per call)", wall))
            lines.append(bt.row(f"{label} (host µs per call, queued)", host))
    return lines


def part_floor(args: argparse.Namespace) -> list[str]:
    """Host µs of single ops at the decode shape (B1, ctx 1k): what any route is made of."""
    import torch

    from attnguard.fallback import triton_decode

    x = inputs(1, 1024)
    q, kc, vc, k, v, sl = (x[n] for n in ("q", "k_cache", "v_cache", "k", "v", "cache_seqlens"))
    b, _, h, d = q.shape
    cap, hk = kc.shape[1], kc.shape[2]
    idx = sl.long()
    kf = kc.view(-1, hk, d)
    cu = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    op = torch.ops.aten._flash_attention_forward.default
    q3 = q.view(b, h, d)
    steps: dict[str, Callable[[], Any]] = {
        "torch.empty": lambda: torch.empty((b, 1, h, d), dtype=q.dtype, device=q.device),
        "int32 add (the lengths)": lambda: sl + 1,
        "index_copy_ (one append)": lambda: kf.index_copy_(0, idx, k.view(b, hk, d)),
        "aten _flash_attention_forward (seqused_k)": lambda: op(
            q3, kf, vc.view(-1, hk, d), cu, cu * cap, 1, cap, 0.0, False, False, seqused_k=sl
        ),
        "decode kernel: triton_decode.decode": lambda: triton_decode.decode(
            q, kc, vc, k, v, sl, scale=d**-0.5, window_left=-1, need_lse=False
        ),
    }
    lines = [
        f"| host µs: {name} | | {bt.host_us(fn, args.iters):.2f} | |" for name, fn in steps.items()
    ]
    with tritons_launcher():
        fn = steps["decode kernel: triton_decode.decode"]
        lines.append(
            f"| host µs: decode kernel, Triton's launcher | | {bt.host_us(fn, args.iters):.2f} | |"
        )
    lines.append(f"<!-- decode kernel disabled: {triton_decode.disabled()} -->")
    return lines


def part_step(args: argparse.Namespace) -> list[str]:
    from attnguard import fallback

    fi = bt.real_flash()
    layers, hidden, h, hk, d = bt.DECODER
    model = tm.decoder(layers, hidden, h, hk, d)
    twin = fallback.flash_attn_with_kvcache
    lines = []
    for b, ctx in bt.DECODE_SHAPES:
        real = tm.decode_step(model, fi.flash_attn_with_kvcache, b, ctx, hk, d, hidden)
        for name, run in (
            ("twin", tm.decode_step(model, twin, b, ctx, hk, d, hidden)),
            (
                "twin, torch ops",
                wrapped(tm.decode_step(model, twin, b, ctx, hk, d, hidden), torch_route),
            ),
        ):
            label = f"{layers}-layer decode step B{b} ctx {ctx}: real vs {name}"
            wall = bt.ab(real, run, args.rounds, max(3, args.iters // 10), bt.wall_ms)
            host = bt.ab(real, run, args.rounds, max(3, args.iters // 10), bt.host_us)
            lines.append(bt.row(f"{label} (wall ms)", wall))
            lines.append(bt.row(f"{label} (host µs per step, queued)", host))
    return lines


# (batch, heads, kv heads, head_dim, capacity, lengths, new token, window, lse, int lengths)
CASES = {
    "gqa4 d128": (4, 32, 8, 128, 512, [0, 17, 300, 510], True, (-1, -1), True, False),
    "mha d64": (2, 8, 8, 64, 300, [5, 298], True, (-1, -1), True, False),
    "mqa d256": (3, 16, 1, 256, 400, [399, 0, 128], True, (-1, -1), True, False),
    "gqa7 d64 (Qwen2-0.5B)": (2, 14, 2, 64, 1000, [900, 1], True, (-1, -1), False, False),
    "d80 window": (2, 8, 2, 80, 700, [650, 40], True, (100, 0), True, False),
    "attend only": (2, 8, 2, 128, 600, [599, 3], False, (-1, -1), True, False),
    "int lengths": (3, 8, 2, 128, 256, [200], True, (-1, -1), True, True),
    "whole cache (no lengths)": (2, 8, 2, 128, 256, None, False, (-1, -1), True, False),
    "long split cache": (1, 32, 8, 128, 32768, [30000], True, (-1, -1), True, False),
}


def part_numerics(args: argparse.Namespace) -> list[str]:
    import torch

    from attnguard import fallback
    from attnguard.fallback import routes as twin_routes

    fi = bt.real_flash()
    routes: list[str] = []
    saved = twin_routes.kvcache
    twin_routes.kvcache = lambda **kw: routes.append(saved(**kw)) or routes[-1]
    lines = []
    try:
        for dtype in (torch.bfloat16, torch.float16):
            for name, (b, h, hk, d, cap, lens, new, win, lse, as_int) in CASES.items():
                g = torch.Generator(device=bt.DEV).manual_seed(len(name))

                def t(*s: int, g: Any = g, dtype: Any = dtype) -> Any:
                    return torch.randn(*s, generator=g, device=bt.DEV).to(dtype)

                q, kc, vc = t(b, 1, h, d), t(b, cap, hk, d), t(b, cap, hk, d)
                kw: dict[str, Any] = {"causal": True, "window_size": win}
                kw["return_softmax_lse"] = lse
                if lens is not None:
                    kw["cache_seqlens"] = (
                        lens[0] if as_int else torch.tensor(lens, dtype=torch.int32, device=bt.DEV)
                    )
                if new:
                    kw["k"], kw["v"] = t(b, 1, hk, d), t(b, 1, hk, d)
                kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
                routes.clear()
                got = fallback.flash_attn_with_kvcache(q, kc1, vc1, **kw)
                ref = fi.flash_attn_with_kvcache(q, kc2, vc2, **kw)
                got_o, ref_o = (got[0], ref[0]) if lse else (got, ref)
                err = (got_o.float() - ref_o.float()).abs().max().item()
                rel = err / max(ref_o.float().abs().max().item(), 1e-6)
                lse_err = 0.0
                if lse:
                    a, r = got[1], ref[1]
                    fin = torch.isfinite(r)
                    same_inf = torch.equal(torch.isinf(a), torch.isinf(r))
                    lse_err = (a[fin] - r[fin]).abs().max().item() if fin.any() else 0.0
                    lse_err = lse_err if same_inf else float("inf")
                caches = torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
                ok = rel <= (2e-2 if dtype is torch.bfloat16 else 5e-3) and lse_err <= 1e-3
                lines.append(
                    f"| numerics {name} {str(dtype)[6:]}: route {routes[-1] if routes else '?'} "
                    f"| rel err {rel:.2e} | lse err {lse_err:.2e} | caches equal {caches}, "
                    f"{'ok' if ok and caches else 'FAIL'} |"
                )
    finally:
        twin_routes.kvcache = saved
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=None, help=f"of {', '.join(PARTS)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--smoke", "--dry-run", action="store_true", help="CPU, tiny: the code only")
    args = ap.parse_args()
    global SHAPES, HEADS
    if args.smoke:
        bt.DEV, bt.DRY = "cpu", True
        bt.tiny_shapes()
        SHAPES, HEADS = [(1, 32), (2, 48)], (4, 2, 16)
        args.rounds, args.iters = 2, 3
    parts = [p for p in (args.parts or ",".join(SMOKE_PARTS if args.smoke else PARTS)).split(",")]
    if args.smoke and set(parts) - set(SMOKE_PARTS):
        print(f"bench_kvcache: --smoke runs {', '.join(SMOKE_PARTS)} only")
        return 2
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("bench_kvcache: needs a CUDA GPU (or --smoke)")
        return 2
    import attnguard

    attnguard.deactivate()  # the twins are called directly; the guard stays out of the way
    device = torch.cuda.get_device_name(0) if not args.smoke else "CPU (smoke: meaningless)"
    real = "attnguard's twins standing in" if args.smoke else "flash-attn " + _flash_version()
    print(f"device: {device}; torch {torch.__version__}; real kernel: {real}")
    print(f"rounds {args.rounds}, iters {args.iters}; ratio = real time / other time")
    print("| measured | real | other | ratio [min, max] |")
    print("|---|---|---|---|")
    table = {"calls": part_calls, "floor": part_floor, "step": part_step}
    table["numerics"] = part_numerics
    results = {}
    for p in parts:
        try:
            lines = table[p](args)
        except Exception as exc:  # report and go on with the other parts
            if args.smoke:
                raise  # a smoke run exists to catch a part that no longer runs
            lines = [f"| {p} | error: {type(exc).__name__}: {str(exc)[:300]} | | |"]
        if args.smoke:
            _smoke.ran(f"{p} (CPU, tiny; timings meaningless)")
        results[p] = lines
        for line in lines:
            print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": device, "rows": results}, indent=1))
    return _smoke.done() if args.smoke else 0


def _flash_version() -> str:
    import flash_attn

    return str(flash_attn.__version__)


if __name__ == "__main__":
    sys.exit(main())
