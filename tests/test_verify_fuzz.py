"""The numbers check says no false thing and misses no clear fault, over a few hundred random
calls: shapes (queries longer and shorter than keys, decode, grouped heads, packed rows, KV caches),
dtypes (float16, bfloat16, float32), causal, sliding windows (each side open or closed), softcap,
ALiBi, attention sinks, masks and biases.

* Right computations give 0 mismatches: attnguard's twins against the explicit float64 reference
  (the twins compute every flash-attn call on a CPU), the twins as the kernel against themselves
  in float64, xformers' and transformers' sdpa entries against the explicit reference.
* Wrong ones are caught on every call where they differ: a twin with flash-attn 3's window rule
  standing for flash-attn 2 (the rules differ where the query is longer than the keys and one
  window side is open: the fault a red-team round found in a flash-attn 3 twin), a kernel whose
  window is one key too wide.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import attnguard
from attnguard import callguard, kernels, runtime, verify
from attnguard.fallback import FLASH_FUNCTIONS, xformers_memory_efficient_attention
from attnguard.integrations.flash_attn.entries import (
    FLASH_HEAD_AXIS,
    FLASH_KVCACHE_AUX,
    FLASH_TENSOR_PARAMS,
)
from attnguard.kernel_identity import Family
from attnguard.observability import numerics

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(autouse=True)
def _fresh_counts() -> Iterator[None]:
    verify.reset()
    callguard.reset_latches()
    yield
    verify.reset()
    callguard.reset_latches()


def flash(name: str, original: Any = None, twin: Any = None) -> Any:
    twin = twin or FLASH_FUNCTIONS[name]
    if name == "flash_attn_with_kvcache":
        tensors, aux = ("q",), FLASH_KVCACHE_AUX
    else:
        tensors, aux = FLASH_TENSOR_PARAMS[name], ("alibi_slopes",)
    entry = callguard.Entry(
        name,
        kernels.EntryKind.FLASH_KERNEL,
        original or twin,
        tensors=tensors,
        twin=twin,
        site=f"flash_attn.{name}",
        aux=aux,
        head_axis=FLASH_HEAD_AXIS[name],
        in_force=runtime.IN_FORCE,
        family=Family.FA2,
    )
    return callguard.wrap_direct(entry)


def _randn(rng: random.Random, *shape: int, dtype: torch.dtype, mult: float = 1.0) -> Any:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    return (torch.randn(*shape, generator=g) * mult).to(dtype)


def one_flash_call(rng: random.Random, entries: dict[str, Any]) -> None:
    dtype = rng.choice(DTYPES)
    d, hk = rng.choice([8, 16, 32, 64]), rng.choice([1, 2])
    h, b = hk * rng.choice([1, 2, 3]), rng.choice([1, 2])
    sq = rng.choice([1, 2, 7, 19, 33])
    sk = rng.choice([1, 4, 19, 40]) if rng.random() < 0.5 else sq
    mult = rng.choice([0.5, 1.0, 3.0])
    kw: dict[str, Any] = {
        "softmax_scale": rng.choice([None, None, 0.1, 0.5]),
        "causal": rng.random() < 0.5,
        "window_size": (-1, -1)
        if rng.random() < 0.4
        else (rng.choice([-1, 0, 2, 6, 50]), rng.choice([-1, 0, 3, 50])),
        "softcap": rng.choice([0.0, 0.0, 0.0, 5.0]),
    }
    if rng.random() < 0.15:
        kw["alibi_slopes"] = torch.rand(h) * 0.3
    q = _randn(rng, b, sq, h, d, dtype=dtype, mult=mult)
    k = _randn(rng, b, sk, hk, d, dtype=dtype, mult=mult)
    v = _randn(rng, b, sk, hk, d, dtype=dtype)
    kind = rng.choice(["func", "func", "varlen", "kvcache", "kvpacked"])
    if kind == "func":
        if rng.random() < 0.2:
            kw["s_aux"] = torch.randn(h)
        entries["flash_attn_func"](q, k, v, **kw)
    elif kind == "kvpacked":
        entries["flash_attn_kvpacked_func"](q, torch.stack([k, v], dim=2), **kw)
    elif kind == "varlen":
        lq = [rng.randint(0, sq) for _ in range(b)]
        lk = [rng.randint(1, sk) for _ in range(b)]
        cu = [
            torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32)
            for x in (lq, lk)
        ]
        qp = _randn(rng, sum(lq), h, d, dtype=dtype, mult=mult)
        kp = _randn(rng, sum(lk), hk, d, dtype=dtype, mult=mult)
        vp = _randn(rng, sum(lk), hk, d, dtype=dtype)
        entries["flash_attn_varlen_func"](qp, kp, vp, *cu, max(lq + [1]), max(lk), **kw)
    else:
        kw.pop("alibi_slopes", None)
        capacity = sk + 4
        kc = torch.zeros(b, capacity, hk, d, dtype=dtype)
        vc = torch.zeros(b, capacity, hk, d, dtype=dtype)
        old = [rng.randint(0, sk) for _ in range(b)]
        for i in range(b):
            kc[i, : old[i]], vc[i, : old[i]] = k[i, : old[i]], v[i, : old[i]]
        new = rng.choice([0, 1, 2])
        kn = _randn(rng, b, new, hk, d, dtype=dtype, mult=mult) if new else None
        vn = _randn(rng, b, new, hk, d, dtype=dtype) if new else None
        lens = torch.tensor(old, dtype=torch.int32)
        entries["flash_attn_with_kvcache"](q[:, :4], kc, vc, kn, vn, cache_seqlens=lens, **kw)


ENTRY_NAMES = (
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_with_kvcache",
)


@pytest.mark.parametrize(
    ("disable", "seed", "calls", "reference"),
    [("", 1, 160, "explicit_float64"), ("reroute", 2, 100, "twin_float64")],
    ids=["the twins against the explicit reference", "a kernel against its twin"],
)
def test_right_flash_attn_computations_never_mismatch(
    disable: str, seed: int, calls: int, reference: str, captured: list[dict[str, Any]]
) -> None:
    attnguard.activate(log="none", verify="all", disable=disable)
    entries = {n: flash(n) for n in ENTRY_NAMES}
    rng = random.Random(seed)
    for _ in range(calls):
        one_flash_call(rng, entries)
    counts = numerics.snapshot()
    assert counts == {"checked": calls, "mismatched": 0, "skipped": {}}, counts
    assert [e for e in captured if e["event"] in ("numerics_mismatch", "internal_error")] == []


def test_right_xformers_and_sdpa_entries_never_mismatch(captured: list[dict[str, Any]]) -> None:
    pytest.importorskip("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnguard.integrations.transformers import attention

    attnguard.activate(log="none", verify="all")
    xf = callguard.wrap_direct(
        callguard.Entry(
            "memory_efficient_attention",
            kernels.EntryKind.XFORMERS,
            xformers_memory_efficient_attention,
            tensors=("query", "key", "value"),
            twin=xformers_memory_efficient_attention,
            mask="attn_bias",
            site="xformers.memory_efficient_attention",
            in_force=runtime.IN_FORCE,
            family=Family.XFORMERS,
        )
    )
    sdpa = attention.wrap_registry_entry("sdpa", sdpa_attention_forward)
    module = torch.nn.Module()
    rng = random.Random(3)
    n = 0
    for _ in range(80):
        dtype = rng.choice(DTYPES)
        b, h, d = rng.choice([1, 2]), rng.choice([1, 2, 4]), rng.choice([8, 16, 32])
        sq, sk = rng.choice([1, 5, 17]), rng.choice([5, 17, 30])
        q = _randn(rng, b, sq, h, d, dtype=dtype)
        k, v = (_randn(rng, b, sk, h, d, dtype=dtype) for _ in range(2))
        bias = None
        if rng.random() < 0.5:
            bias = _randn(rng, b, h, sq, sk, dtype=dtype)
        xf(q, k, v, attn_bias=bias, scale=rng.choice([None, 0.2]))
        module.is_causal = rng.random() < 0.5
        hk = rng.choice([g for g in (1, 2, 4) if h % g == 0])
        mask = None
        if rng.random() < 0.5:
            mask = torch.rand(b, 1, sq, sk) < 0.8
            if rng.random() < 0.5:  # transformers' float form: 0 or the dtype's minimum
                mask = torch.zeros(b, 1, sq, sk, dtype=dtype).masked_fill(
                    ~mask, torch.finfo(dtype).min
                )
        module.num_key_value_groups = h // hk
        sdpa(
            module,
            q.transpose(1, 2),
            k[:, :, :hk].transpose(1, 2),
            v[:, :, :hk].transpose(1, 2),
            mask,
        )
        n += 2
    counts = numerics.snapshot()
    assert counts == {"checked": n, "mismatched": 0, "skipped": {}}, counts
    assert [e for e in captured if e["event"] in ("numerics_mismatch", "internal_error")] == []


# --- wrong computations: caught wherever they differ -------------------------------------------


def _explicit_fa(q, k, v, causal, window, *, fa3_rule: bool, wider: int = 0):
    """(B, S, H, D) attention in float32, bottom-right aligned; window normalised by flash-attn
    3's rule (an open side stays open) or flash-attn 2's (one facing a closed side closes at
    seqlen_k); ``wider``: the left side that many keys wider."""
    sq, sk = q.shape[1], k.shape[1]
    left, right = window
    if fa3_rule:
        left = -1 if left >= sk - 1 else left
        right = -1 if right >= sq - 1 else right
        right = 0 if causal else right
    else:
        left = -1 if left >= sk else left
        right = -1 if right >= sk else right
        right = 0 if causal else right
        if left >= 0 and right < 0:
            right = sk
        if right >= 0 and left < 0:
            left = sk
    if left >= 0:
        left += wider
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    h, hk = q.shape[2], k.shape[2]
    kf, vf = (x.float().repeat_interleave(h // hk, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * q.shape[-1] ** -0.5
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~keep, -math.inf), -1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, vf).to(q.dtype)


def _kernel(fa3_rule: bool, wider: int = 0) -> Any:
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                        window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                        deterministic=False, return_attn_probs=False):  # fmt: skip
        return _explicit_fa(q, k, v, causal, tuple(window_size), fa3_rule=fa3_rule, wider=wider)

    return flash_attn_func


def _difference(q, k, v, causal, window, **wrong: Any) -> float:
    a = _explicit_fa(q, k, v, causal, window, fa3_rule=False).float()
    b = _explicit_fa(q, k, v, causal, window, **wrong).float()
    return float((a - b).abs().max())


@pytest.mark.parametrize(
    ("disable", "wrong", "code"),
    [
        ("", {"fa3_rule": True}, "twin_numbers_differ"),
        ("reroute", {"fa3_rule": False, "wider": 1}, "kernel_numbers_differ"),
    ],
    ids=["a twin with flash-attn 3's window rule", "a kernel with a window one key wider"],
)
def test_a_wrong_rule_is_caught_on_every_call_where_it_differs(
    disable: str, wrong: dict[str, Any], code: str, captured: list[dict[str, Any]]
) -> None:
    """Every call whose output the fault moves by more than 0.05 is caught; no call it leaves
    exactly as it was is."""
    attnguard.activate(log="none", verify="all", disable=disable)
    bad = _kernel(**wrong)
    twin = bad if not disable else None
    entry = flash("flash_attn_func", original=None if twin else bad, twin=twin)
    rng = random.Random(4)
    clear = caught_clear = caught_same = 0
    for _ in range(80):
        dtype = rng.choice(DTYPES)
        sk = rng.choice([3, 8, 20])
        sq = sk + rng.choice([2, 5, 9]) if rng.random() < 0.8 else rng.choice([1, sk])
        window = rng.choice([(2, -1), (4, -1), (6, -1), (-1, 1), (1, 2)])
        causal = rng.random() < 0.15
        q, k, v = (_randn(rng, 1, s, 2, 16, dtype=dtype) for s in (sq, sk, sk))
        moved = _difference(q, k, v, causal, window, **wrong)
        before = numerics.snapshot().get("mismatched", 0)
        entry(q, k, v, causal=causal, window_size=window)
        caught = numerics.snapshot()["mismatched"] > before
        clear += moved > 0.05
        caught_clear += caught and moved > 0.05
        caught_same += caught and moved == 0
    assert clear >= 12, clear  # the draw meets the fault often enough to mean something
    assert (caught_clear, caught_same) == (clear, 0)
    assert numerics.snapshot()["checked"] == 80
    assert {e["reason_code"] for e in captured if e["event"] == "numerics_mismatch"} == {code}
