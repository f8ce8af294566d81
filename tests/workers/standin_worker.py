"""Run a fixed set of seeded flash-attn calls with whichever ``flash_attn`` is on the path and save
what each returned or raised, for tests/gpu/test_standin_vs_real_gpu.py.

    python standin_worker.py {real|standin} OUT_FILE [--device cuda]

The test runs this twice on the same GPU: once with the real flash-attn 2.8.3 first on
PYTHONPATH, once with the stand-in of tests/standins instead, and compares the two files. The
first argument says which one the caller meant; the worker checks it got that one
(``flash_attn.IS_ATTNGUARD_STANDIN``) and exits 3 otherwise. attnguard is never imported here.

Inputs are drawn from seeded CPU generators (the same numbers in every process), then moved to
the device. Each case saves ``out`` (and ``lse`` where asked for, and the KV caches after
``flash_attn_with_kvcache``) on the CPU, or the exception's type name and full message. OUT_FILE
is a ``torch.save`` dict: ``{"meta": {...}, "cases": {name: {"kind", "tensors", "error",
"inputs_digest"}}}``. ``--device cpu`` only makes sense for the error cases (a dry run).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@dataclass(frozen=True)
class Case:
    """One call. ``fn``: which flash-attn function; ``spec``: shapes and keyword arguments."""

    fn: str
    spec: dict[str, Any]
    error: bool = False  # an error case: the call must raise (the same error in both)
    lse: bool = False  # the call returns (out, lse, ...): compare lse too
    caches: bool = False  # flash_attn_with_kvcache: compare the caches after the call
    dtype: torch.dtype = BF16
    device: str | None = None  # None: the worker's device; "cpu": CPU tensors on purpose
    notes: tuple[str, ...] = field(default=())


def _dense(sq, sk, h, hk, d, **kw):
    return {"b": 2, "sq": sq, "sk": sk, "h": h, "hk": hk, "d": d, "kw": kw}


def _varlen(lens_q, lens_k, h, hk, d=64, **kw):
    return {"lens_q": lens_q, "lens_k": lens_k or lens_q, "h": h, "hk": hk, "d": d, "kw": kw}


def _kv(sq, sn, seqlens, hk=2, **kw):
    return {"sq": sq, "sn": sn, "seqlens": seqlens, "hk": hk, "kw": kw}


LSE = {"return_attn_probs": True}
CASES: dict[str, Case] = {
    # flash_attn_func
    "func_noncausal": Case("func", _dense(128, 128, 8, 8, 64)),
    "func_causal": Case("func", _dense(128, 128, 8, 8, 128, causal=True)),
    "func_causal_bottom_right_gqa": Case(
        "func", _dense(37, 200, 8, 2, 64, causal=True, **LSE), lse=True
    ),
    "func_causal_sq_gt_sk_empty_rows": Case(
        "func", _dense(200, 37, 4, 4, 64, causal=True, **LSE), lse=True
    ),
    "func_window_mqa": Case(
        "func", _dense(128, 160, 8, 1, 128, window_size=(32, 8), **LSE), lse=True
    ),
    "func_causal_window": Case(
        "func", _dense(128, 128, 8, 2, 64, causal=True, window_size=(16, 0))
    ),
    "func_softcap": Case(
        "func", _dense(96, 96, 4, 4, 64, softcap=2.0, causal=True, **LSE), lse=True
    ),
    "func_gqa_lse": Case("func", _dense(64, 64, 8, 2, 64, **LSE), lse=True),
    "func_decode_gqa": Case("func", _dense(1, 300, 8, 2, 128, causal=True, **LSE), lse=True),
    "func_scale": Case("func", _dense(64, 64, 4, 4, 64, softmax_scale=0.2, **LSE), lse=True),
    "func_alibi": Case("func", _dense(64, 100, 4, 2, 64, alibi="heads", **LSE), lse=True),
    "func_alibi_causal": Case(
        "func", _dense(64, 100, 4, 2, 64, alibi="batch", causal=True, **LSE), lse=True
    ),
    "func_fp16_causal_lse": Case(
        "func", _dense(80, 80, 8, 2, 64, causal=True, **LSE), lse=True, dtype=FP16
    ),
    # flash_attn_varlen_func, several lengths
    "varlen_causal_gqa": Case(
        "varlen", _varlen([1, 17, 64, 5, 128], None, 8, 2, causal=True, **LSE), lse=True
    ),
    "varlen_q_shorter_window": Case(
        "varlen",
        _varlen([3, 40, 7], [50, 40, 90], 4, 4, causal=True, window_size=(16, 0), **LSE),
        lse=True,
    ),
    "varlen_softcap_local": Case(
        "varlen", _varlen([64, 31], None, 4, 1, softcap=2.0, window_size=(8, 8), **LSE), lse=True
    ),
    "varlen_noncausal": Case("varlen", _varlen([9, 33, 2], [12, 33, 40], 4, 2, **LSE), lse=True),
    "varlen_fp16_causal": Case("varlen", _varlen([5, 70, 33], None, 8, 2, causal=True), dtype=FP16),
    # the packed dense variants
    "qkvpacked": Case(
        "qkvpacked",
        {"b": 2, "s": 80, "h": 4, "d": 64, "kw": {"causal": True, "window_size": (24, 0), **LSE}},
        lse=True,
    ),
    "kvpacked": Case(
        "kvpacked",
        {"b": 2, "sq": 30, "sk": 90, "h": 8, "hk": 2, "d": 64, "kw": {"causal": True, **LSE}},
        lse=True,
    ),
    # flash_attn_with_kvcache: what the stand-in implements (a contiguous cache; no rotary,
    # cache_batch_idx, cache_leftpad or block_table)
    "kvcache_decode": Case(
        "kvcache", _kv(1, 1, [0, 17, 300, 510], causal=True), lse=True, caches=True
    ),
    "kvcache_decode_mqa": Case(
        "kvcache", _kv(1, 1, [3, 17, 300, 510], hk=1, causal=True), lse=True, caches=True
    ),
    "kvcache_attend_only": Case("kvcache", _kv(1, 0, [5, 17, 300, 511]), lse=True, caches=True),
    "kvcache_chunk_causal": Case(
        "kvcache", _kv(8, 8, [0, 17, 300, 503], causal=True), lse=True, caches=True
    ),
    "kvcache_chunk_not_causal": Case(
        "kvcache", _kv(8, 8, [0, 17, 300, 503]), lse=True, caches=True
    ),
    "kvcache_int_seqlens": Case("kvcache", _kv(4, 4, 100, causal=True), lse=True, caches=True),
    "kvcache_window_softcap": Case(
        "kvcache",
        _kv(8, 8, [0, 17, 300, 503], causal=True, window_size=(32, 0), softcap=2.0),
        lse=True,
        caches=True,
    ),
    "kvcache_fp16": Case(
        "kvcache", _kv(4, 4, [0, 17, 300, 507], causal=True), lse=True, caches=True, dtype=FP16
    ),
    # error cases: the same exception type and the same message text
    "err_fp32_func": Case("func", _dense(32, 32, 4, 4, 64), error=True, dtype=FP32),
    "err_fp32_varlen": Case("varlen", _varlen([16, 16], None, 4, 4), error=True, dtype=FP32),
    "err_fp32_kvcache": Case("kvcache", _kv(1, 1, [4, 4, 4, 4]), error=True, dtype=FP32),
    "err_cpu_func": Case("func", _dense(32, 32, 4, 4, 64), error=True, device="cpu"),
    "err_cpu_varlen": Case("varlen", _varlen([16, 16], None, 4, 4), error=True, device="cpu"),
    "err_cpu_kvcache": Case("kvcache", _kv(1, 1, [4, 4, 4, 4]), error=True, device="cpu"),
    "err_mixed_qv_func": Case("func", _dense(32, 32, 4, 4, 64, mix="v"), error=True),
    "err_mixed_qk_func": Case("func", _dense(32, 32, 4, 4, 64, mix="k"), error=True),
    "err_mixed_qv_varlen": Case("varlen", _varlen([16, 16], None, 4, 4, mix="v"), error=True),
    "err_head_dim_512_func": Case("func", _dense(32, 32, 4, 4, 512), error=True),
    "err_head_dim_512_varlen": Case("varlen", _varlen([16, 16], None, 4, 4, d=512), error=True),
}

# Where the results are expected to differ, and why: read off the real kernel's sources and
# tests/gpu/test_twins_gpu.py, not yet seen on a GPU for the stand-in. The test marks these as
# strict xfails (an unexpected pass fails the run, so the list cannot go stale silently).
EXPECTED_LSE_DIFFERENCES = {
    "func_causal_sq_gt_sk_empty_rows": (
        "rows with no visible key: flash-attn's softmax_lse is +inf there, the stand-in's "
        "logsumexp over an all -inf row is -inf"
    ),
    "func_alibi_causal": (
        "flash-attn's causal ALiBi adds slope * j, not -slope * |i + sk - sq - j|: its lse is the "
        "stand-in's plus slope * (i + sk - sq) per row (out is unaffected)"
    ),
}


def _randn(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=FP32).to(dtype).to(device)


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _cu(lens, device):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return _i32(out, device)


def _mixed(q, k, v, mix):
    if mix == "v":
        v = v.to(FP16)
    elif mix == "k":
        k = k.to(FP16)
    return q, k, v


def build(case: Case, device: str) -> tuple[Callable[[Any], Any], list[torch.Tensor]]:
    """(call(flash_attn) -> result, the input tensors) for one case."""
    dev = case.device or device
    dt, s = case.dtype, case.spec
    kw = dict(s["kw"])
    mix = kw.pop("mix", None)
    if case.fn == "func":
        q = _randn((s["b"], s["sq"], s["h"], s["d"]), dt, dev, 1)
        k = _randn((s["b"], s["sk"], s["hk"], s["d"]), dt, dev, 2)
        v = _randn((s["b"], s["sk"], s["hk"], s["d"]), dt, dev, 3)
        q, k, v = _mixed(q, k, v, mix)
        alibi = kw.pop("alibi", None)
        if alibi is not None:
            slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=dev)[: s["h"]]
            kw["alibi_slopes"] = slopes if alibi == "heads" else torch.stack([slopes, slopes * 3])
        return (lambda fa: fa.flash_attn_func(q, k, v, **kw)), [q, k, v]
    if case.fn == "varlen":
        lq, lk = s["lens_q"], s["lens_k"]
        q = _randn((sum(lq), s["h"], s["d"]), dt, dev, 20)
        k = _randn((sum(lk), s["hk"], s["d"]), dt, dev, 21)
        v = _randn((sum(lk), s["hk"], s["d"]), dt, dev, 22)
        q, k, v = _mixed(q, k, v, mix)
        args = (q, k, v, _cu(lq, dev), _cu(lk, dev), max(lq), max(lk))
        return (lambda fa: fa.flash_attn_varlen_func(*args, **kw)), [q, k, v]
    if case.fn == "qkvpacked":
        qkv = _randn((s["b"], s["s"], 3, s["h"], s["d"]), dt, dev, 10)
        return (lambda fa: fa.flash_attn_qkvpacked_func(qkv, **kw)), [qkv]
    if case.fn == "kvpacked":
        q = _randn((s["b"], s["sq"], s["h"], s["d"]), dt, dev, 11)
        kv = _randn((s["b"], s["sk"], 2, s["hk"], s["d"]), dt, dev, 12)
        return (lambda fa: fa.flash_attn_kvpacked_func(q, kv, **kw)), [q, kv]
    if case.fn == "kvcache":
        b, cap, h, d, hk = 4, 512, 8, 128, s["hk"]
        q = _randn((b, s["sq"], h, d), dt, dev, 50)
        kc = _randn((b, cap, hk, d), dt, dev, 51)
        vc = _randn((b, cap, hk, d), dt, dev, 52)
        seqlens = s["seqlens"]
        kw["cache_seqlens"] = seqlens if isinstance(seqlens, int) else _i32(seqlens, dev)
        kw["return_softmax_lse"] = True
        inputs = [q, kc, vc]
        if s["sn"]:
            kw["k"] = _randn((b, s["sn"], hk, d), dt, dev, 53)
            kw["v"] = _randn((b, s["sn"], hk, d), dt, dev, 54)
            inputs += [kw["k"], kw["v"]]

        def call(fa: Any) -> Any:
            res = fa.flash_attn_with_kvcache(q, kc, vc, **kw)
            return (*res, kc, vc) if isinstance(res, tuple) else (res, None, kc, vc)

        return call, inputs
    raise ValueError(case.fn)


def run_case(fa: Any, case: Case, device: str) -> dict[str, Any]:
    call, inputs = build(case, device)
    digest = [float(t.double().sum()) for t in inputs]
    rec: dict[str, Any] = {"kind": "error" if case.error else "output", "inputs_digest": digest}
    try:
        res = call(fa)
        if case.device is None and device != "cpu":
            torch.cuda.synchronize()
    except Exception as exc:
        rec["error"] = [type(exc).__name__, str(exc)]
        rec["error_traceback"] = traceback.format_exc()[-3000:]
        rec["tensors"] = None
        return rec
    rec["error"] = None
    res = res if isinstance(res, tuple) else (res,)
    names = ["out", "lse", "k_cache", "v_cache"] if case.fn == "kvcache" else ["out", "lse"]
    rec["tensors"] = {
        n: t.detach().cpu() for n, t in zip(names, res, strict=False) if isinstance(t, torch.Tensor)
    }
    return rec


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("impl", choices=["real", "standin"])
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", nargs="*", help="run only these cases (a dry run)")
    args = ap.parse_args()
    import flash_attn

    standin = bool(getattr(flash_attn, "IS_ATTNGUARD_STANDIN", False))
    if standin != (args.impl == "standin"):
        print(f"expected the {args.impl} flash_attn, got {flash_attn.__file__}", file=sys.stderr)
        return 3
    meta = {
        "impl": args.impl,
        "flash_attn_file": flash_attn.__file__,
        "flash_attn_version": getattr(flash_attn, "__version__", None),
        "torch": torch.__version__,
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    cases = {}
    for name, case in CASES.items():
        if args.only and name not in args.only:
            continue
        cases[name] = run_case(flash_attn, case, args.device)
    torch.save({"meta": meta, "cases": cases}, args.out)
    failed = [n for n, r in cases.items() if (r["error"] is None) == CASES[n].error]
    print(f"{args.impl}: {len(cases)} cases, {len(failed)} not as expected: {failed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
