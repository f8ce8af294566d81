"""ATTNGUARD_KERNEL=fastest on a GPU with the REAL flash-attn 2.8.3 (H100/H200).

* race correctness: whatever wins serves calls whose outputs and gradients are within the
  dtype's rounding of the real kernel's — dense (training shapes), packed rows, windowed; a
  softcapped call is left to the real kernel (bit-identical) and the event says why;
* one ``kernel_selected`` event per bucket, carrying every candidate's time and difference;
* the disk cache: a second process makes the same decision without racing ("disk cache");
* the race budget: a first process with an empty cache races every bucket of the shape
  sequence (4 x 4096 -> 1 x 16384 -> 1 x 32768, training and prefill), none ``not_raced``;
* two ranks of a torchrun job (gloo, both on this GPU) end with the same winner;
* ``torch.compile(fullgraph=True)`` of a function calling flash_attn_func with the switch on:
  one graph, the decided kernel, the same numbers as eager.

Run: TEST_REAL_FLASH_ATTN_DIR=/tmp/flashsite pytest -m gpu tests/gpu/test_selection_gpu.py
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

import gpuenv  # noqa: E402

import attnguard  # noqa: E402
from attnguard.observability import events  # noqa: E402
from attnguard.selection import decisions  # noqa: E402
from attnguard.selection.buckets import TOLERANCE  # noqa: E402

BF16 = torch.bfloat16
CUDA = "cuda"


@pytest.fixture
def fastest(tmp_path, monkeypatch):
    """The switch on (fix mode), a fresh disk cache, the real flash_attn guarded; yields
    (guarded module, events seen)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    decisions.reset()
    attnguard.activate(log="none", kernel="fastest")
    flash = gpuenv.import_in_process()
    assert getattr(flash.flash_attn_func, "__attnguard_original__", None) is not None
    with events.capture() as seen:
        yield flash, seen
    attnguard.deactivate()
    decisions.reset()


def randn(*shape, seed=0, grad=False):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    t = torch.randn(*shape, device=CUDA, generator=g, dtype=torch.float32).to(BF16)
    return t.requires_grad_(grad)


def rel(a, b):
    return (a.float() - b.float()).abs().max().item() / max(b.float().abs().max().item(), 1e-6)


def selected(seen):
    return [e for e in seen if e["event"] == "kernel_selected"]


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)


CASES = {
    "dense_training_4x2048": ("flash_attn_func", (4, 2048, 16, 4, 128), {"causal": True}),
    "dense_window": (
        "flash_attn_func",
        (2, 2048, 16, 4, 128),
        {"causal": True, "window_size": (255, 0)},
    ),
    "packed_64_short": (
        "flash_attn_varlen_func",
        [64 + (53 * i) % 449 for i in range(64)],
        {"causal": True},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_served_kernel_matches_the_real_one(fastest, case):
    flash, seen = fastest
    name, shape, kw = CASES[case]
    guarded = getattr(flash, name)
    real = guarded.__attnguard_original__
    if name == "flash_attn_func":
        b, s, h, hk, d = shape
        q = randn(b, s, h, d, seed=1, grad=True)
        k, v = randn(b, s, hk, d, seed=2, grad=True), randn(b, s, hk, d, seed=3, grad=True)
        args = (q, k, v)
    else:
        total = sum(shape)
        q = randn(total, 16, 128, seed=1, grad=True)
        k, v = randn(total, 4, 128, seed=2, grad=True), randn(total, 4, 128, seed=3, grad=True)
        cu = _cu(shape)
        args = (q, k, v, cu, cu, max(shape), max(shape))
    out = guarded(*args, **kw)  # the first call races and is served by the winner
    ref = real(*args, **kw)
    g = torch.randn_like(ref)
    got_grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    tol = TOLERANCE["bfloat16"]
    said = selected(seen)
    assert len(said) == 1, said
    ev = said[0]
    assert rel(out, ref) <= tol, (rel(out, ref), ev)
    grad_err = max(rel(a, b) for a, b in zip(got_grads, ref_grads, strict=True))
    assert grad_err <= tol, (grad_err, ev)
    assert ev["reason_code"] in ("faster_kernel", "requested_kept"), ev
    assert "requested" in ev["candidates"] and len(ev["candidates"]) >= 2
    assert all(c.get("ms") or c.get("error") for c in ev["candidates"].values())
    guarded(*args, **kw)  # the same bucket: decided, not raced again, not said again
    assert len(selected(seen)) == 1
    print(f"{case}: {ev['selected']} ({ev['why'].get(ev['selected'], '')}); {ev['candidates']}")


def test_a_softcapped_call_is_left_to_the_real_kernel(fastest):
    flash, seen = fastest
    q, k, v = (
        randn(2, 512, 8, 64, seed=4),
        randn(2, 512, 2, 64, seed=5),
        randn(2, 512, 2, 64, seed=6),
    )
    out = flash.flash_attn_func(q, k, v, causal=True, softcap=30.0)
    ref = flash.flash_attn_func.__attnguard_original__(q, k, v, causal=True, softcap=30.0)
    assert torch.equal(out, ref)
    assert not selected(seen)


_PROGRAM = r"""
import json, sys, torch
import attnguard
from attnguard.observability import events
from flash_attn import flash_attn_func
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
with events.capture() as seen:
    flash_attn_func(q, k, v, causal=True)
ev = [e for e in seen if e["event"] == "kernel_selected"]
print("RESULT " + json.dumps({"source": ev[0]["source"], "selected": ev[0]["selected"]}))
"""


def _fastest_process(program: str, cache: object) -> object:
    """Run ``program`` in a fresh process with the switch on and the cache directory ``cache``;
    returns what it printed after ``RESULT ``."""
    gpuenv.require()
    env = gpuenv.child_env(
        real=True,
        ATTNGUARD="1",
        ATTNGUARD_LOG="none",
        ATTNGUARD_KERNEL="fastest",
        XDG_CACHE_HOME=str(cache),
    )
    res = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))[7:])


def test_a_second_process_takes_the_decision_from_the_disk_cache(tmp_path):
    got = [_fastest_process(_PROGRAM, tmp_path / "cache") for _ in range(2)]
    assert got[0]["source"] == "measured" and got[1]["source"] == "disk cache"
    assert got[0]["selected"] == got[1]["selected"]


@pytest.mark.parametrize("plant", ["not_json", "huge_numbers", "nan_numbers", "link"])
def test_a_planted_or_corrupted_cache_file_costs_no_run(tmp_path, plant):
    """A decision file under XDG_CACHE_HOME replaced after a first process made it (corrupt,
    numbers too large for a float or NaN, a link elsewhere): the next process exits 0 and
    serves the call; what it cannot use it measures again (one ``kernel_cache_ignored``), what
    it adopts carries finite numbers into its events; never an ``internal_error``."""
    cache = tmp_path / "cache"
    first = _fastest_process(_PROGRAM, cache)
    (path,) = cache.glob("attnguard/kernels/*/*.json")
    stored = json.loads(path.read_text())
    if plant == "not_json":
        path.write_text("{corrupt")
    elif plant in ("huge_numbers", "nan_numbers"):
        big = int("9" * 400) if plant == "huge_numbers" else float("nan")
        for entry in stored["measured"].values():
            entry["ms"] = big
        stored["cost"] = {"race_s": big}
        path.write_text(json.dumps(stored))
    else:
        elsewhere = tmp_path / "elsewhere.json"
        elsewhere.write_text(json.dumps(stored))
        path.unlink()
        path.symlink_to(elsewhere)
    got = _fastest_process(_PROGRAM_EVENTS, cache)
    assert got["internal_errors"] == [], got
    if plant in ("not_json", "link"):
        assert got["source"] == "measured" and got["ignored"], got
    else:
        assert got["source"] == "disk cache" and got["selected"] == first["selected"], got


_PROGRAM_EVENTS = _PROGRAM.replace(
    'print("RESULT " + json.dumps({"source": ev[0]["source"], "selected": ev[0]["selected"]}))',
    "line = json.loads(json.dumps(ev[0], default=str), parse_constant=lambda c: 1 / 0)\n"
    'print("RESULT " + json.dumps({"source": ev[0]["source"], "selected": ev[0]["selected"],\n'
    '    "internal_errors": [e for e in seen if e["event"] == "internal_error"],\n'
    '    "ignored": [e for e in seen if e.get("reason_code") == "kernel_cache_ignored"]}, default=str))',
)


_SEQUENCE = r"""
import json, torch
import attnguard  # ATTNGUARD=1: on, from the environment (start-up hook installed or not)
from attnguard.observability import events
from flash_attn import flash_attn_func
g = torch.Generator(device="cuda").manual_seed(0)
def qkv(b, s, grad):
    def t(h):
        x = torch.randn(b, s, h, 64, device="cuda", generator=g).to(torch.bfloat16)
        return x.requires_grad_(grad)
    return t(14), t(2), t(2)  # Qwen2-0.5B's attention: 14 query / 2 kv heads, head_dim 64
with events.capture() as seen:
    for b, s in ((4, 4096), (1, 16384), (1, 32768)):
        for grad in (True, False):  # a training step's call, then a prefill's
            q, k, v = qkv(b, s, grad)
            for _ in range(2):
                out = flash_attn_func(q, k, v, causal=True)
                if grad:
                    out.backward(torch.ones_like(out))
            del q, k, v, out
ev = [e for e in seen if e["event"] == "kernel_selected"]
keep = ("reason_code", "selected", "source", "cost", "bucket")
print("RESULT " + json.dumps([{k: e.get(k) for k in keep} for e in ev]))
"""


def test_a_first_process_races_every_bucket_of_a_job_whose_shapes_change(tmp_path):
    """The shape sequence 4 x 4096 -> 1 x 16384 -> 1 x 32768 (training and prefill
    calls) in a fresh process with an empty cache. Every bucket is raced — none ``not_raced``:
    the first cuDNN call's cold start is a warm-up, outside the race budget — and each event
    says what its race cost."""
    got = _fastest_process(_SEQUENCE, tmp_path / "cache")
    for e in got:
        print(f"{'/'.join(e['bucket'][-6:])} grad={e['bucket'][7]}: {e['selected']} {e['cost']}")
    assert len(got) == 6, got
    assert all(e["reason_code"] in ("faster_kernel", "requested_kept") for e in got), got
    assert all(e["source"] == "measured" and e["cost"]["race_s"] > 0 for e in got), got
    last = got[-1]["cost"]
    assert last["process_races_s"] <= last["process_allowance_s"], last


_RANKS = r"""
import json, os, torch, torch.distributed as dist
dist.init_process_group("gloo")
import attnguard
from attnguard.observability import events
from flash_attn import flash_attn_func
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(4, 4096, 16, 128, device="cuda", generator=g).to(torch.bfloat16) for _ in range(3))
with events.capture() as seen:
    flash_attn_func(q, k, v, causal=True)
ev = [e for e in seen if e["event"] == "kernel_selected"][0]
print("RESULT " + json.dumps({"rank": dist.get_rank(), "selected": ev["selected"], "source": ev["source"]}))
dist.destroy_process_group()
"""


def test_two_ranks_agree_on_the_winner(tmp_path):
    gpuenv.require()
    script = tmp_path / "ranks.py"
    script.write_text(_RANKS)
    env = gpuenv.child_env(
        real=True,
        ATTNGUARD="1",
        ATTNGUARD_LOG="none",
        ATTNGUARD_KERNEL="fastest",
        XDG_CACHE_HOME=str(tmp_path / "cache"),
        CUDA_VISIBLE_DEVICES="0",
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = subprocess.run([*cmd, str(script)], env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [json.loads(x[7:]) for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert len(got) == 2 and got[0]["selected"] == got[1]["selected"], got
    print(f"ranks: {got}")


def test_compile_fullgraph_with_the_switch_on(fastest):
    flash, seen = fastest
    q, k, v = (
        randn(4, 1024, 16, 128, seed=7),
        randn(4, 1024, 4, 128, seed=8),
        randn(4, 1024, 4, 128, seed=9),
    )

    def attend(q, k, v):
        return flash.flash_attn_func(q, k, v, causal=True) * 2.0

    eager = attend(q, k, v)  # the first eager call decides
    assert len(selected(seen)) == 1
    explanation = torch._dynamo.explain(attend)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(attend, fullgraph=True)
    out = compiled(q, k, v)
    assert rel(out, eager) <= TOLERANCE["bfloat16"]
    assert len(selected(seen)) == 1  # nothing said from inside the graph


@pytest.mark.parametrize("call", ["dense", "dense_window", "varlen"])
def test_every_twin_route_on_the_gpu_compiles_whole(call):
    """Which candidate wins a race depends on the GPU's timings, so the test above may not reach
    the twins: here each route a winner (or a rescue) takes on a GPU is compiled on its own, on
    CUDA tensors, and must trace without a graph break."""
    from attnguard import fallback

    q, k, v = (
        randn(2, 512, 16, 128, seed=1),
        randn(2, 512, 4, 128, seed=2),
        randn(2, 512, 4, 128, seed=3),
    )
    eager_first = call != "varlen"  # varlen: the first call is inside the trace
    cu = torch.tensor([0, 100, 612, 1024], dtype=torch.int32, device="cuda")

    def twin(q, k, v):
        if call == "dense":
            return fallback.flash_attn_func(q, k, v, causal=True)
        if call == "dense_window":
            return fallback.flash_attn_func(q, k, v, causal=True, window_size=(127, 0))
        out = fallback.flash_attn_varlen_func(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 512, 512, causal=True
        )
        return out

    if eager_first:
        twin(q, k, v)
    explanation = torch._dynamo.explain(twin)(q, k, v)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    out = torch.compile(twin, fullgraph=True)(q, k, v)
    assert rel(out, twin(q, k, v)) <= TOLERANCE["bfloat16"]
