"""Opt-in kernel selection (ATTNGUARD_KERNEL=fastest) where it can be checked without a GPU.

* the setting: validated like every other, off by default;
* with the switch on and no GPU, a guarded program computes and reports exactly what it does
  with the switch off (the switch only ever touches CUDA flash-attn calls);
* the rules (attnguard.selection.buckets, .race): buckets, what is never touched and why,
  candidates, winner;
* the selection package's place below the call guard.

The decisions, on disk and across ranks: tests/test_kernel_decisions.py; what a decision may be
and how calls are served from it: tests/test_kernel_serving.py.

The races themselves, the cache hit in a second process and agreement with real measurements
are GPU tests (tests/gpu/test_selection_gpu.py).
"""

from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest
import torch
from helpers.packages import STANDINS
from helpers.processes import PY, REPO, subprocess_env
from helpers.selection import (
    FakeCuda,
    dense,
)

import attnguard
from attnguard.selection import buckets, decisions, race
from attnguard.selection.buckets import REQUESTED
from attnguard.selection.race import Measured

# --- the setting ------------------------------------------------------------------------------


def test_the_switch_is_off_by_default_and_validated(monkeypatch, capsys):
    assert attnguard.Settings().kernel == "requested"
    assert attnguard.activate(log="none", kernel="fastest").kernel == "fastest"
    monkeypatch.setenv("ATTNGUARD_KERNEL", "fastest ")
    assert attnguard.activate(log="none").kernel == "fastest"
    with pytest.raises(ValueError) as err:
        attnguard.activate(log="none", kernel="quickest")  # the caller's own argument
    text = str(err.value)
    assert "ATTNGUARD_KERNEL" in text and "'quickest'" in text and "requested | fastest" in text
    # from the environment: one line, and the guard runs with the opt-in off
    attnguard.deactivate()
    capsys.readouterr()
    monkeypatch.setenv("ATTNGUARD_KERNEL", "quickest")
    assert attnguard.activate(log="none").kernel == "requested" and attnguard.is_active()
    (line,) = capsys.readouterr().err.splitlines()
    assert "ATTNGUARD_KERNEL='quickest'" in line and "requested | fastest" in line
    assert line.endswith("(ATTNGUARD_KERNEL=requested is used)")


# --- no GPU: nothing changes --------------------------------------------------------------------

_CPU_PROGRAM = r"""
import json, sys, torch
import attnguard
from attnguard.observability import events
from flash_attn import flash_attn_func, flash_attn_varlen_func
g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(2, 9, 4, 16, generator=g) for _ in range(3))
cu = torch.tensor([0, 4, 9], dtype=torch.int32)
with events.capture() as seen:
    a = flash_attn_func(q, k, v, causal=True)
    b = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, 5, 5, causal=True)
names = sorted({(e["event"], e.get("reason_code")) for e in seen})
torch.save({"a": a, "b": b}, sys.argv[1])
print(json.dumps({"events": names, "kernel": attnguard.settings().kernel}))
"""


@pytest.mark.parametrize("switch", ["requested", "fastest"])
def test_without_a_gpu_the_switch_changes_nothing(tmp_path, switch):
    """The CPU stand-in of flash-attn refuses CPU tensors like the real kernel; the guard
    reroutes to its twins either way, and the switch adds nothing: same numbers, same events."""
    outs = {}
    for mode in ("requested", switch):
        env = subprocess_env(
            ATTNGUARD="1",
            ATTNGUARD_LOG="none",
            ATTNGUARD_KERNEL=mode,
            PYTHONPATH=f"{STANDINS}:{REPO}",
        )
        res = subprocess.run(
            [PY, "-c", _CPU_PROGRAM, str(tmp_path / f"{mode}.pt")],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        outs[mode] = (json.loads(res.stdout.splitlines()[-1]), torch.load(tmp_path / f"{mode}.pt"))
    (info_off, t_off), (info_on, t_on) = outs["requested"], outs[switch]
    assert info_on["kernel"] == switch
    assert info_on["events"] == info_off["events"]
    assert all(e[0] != "kernel_selected" for e in info_on["events"])
    assert torch.equal(t_on["a"], t_off["a"]) and torch.equal(t_on["b"], t_off["b"])


# --- the rules ----------------------------------------------------------------------------------


def test_buckets_round_shapes_up_to_powers_of_two():
    a = dense(q=FakeCuda(3, 3000, 32, 128), k=FakeCuda(3, 3000, 8, 128), causal=True)
    b = dense(q=FakeCuda(4, 4096, 32, 128), k=FakeCuda(4, 4096, 8, 128), causal=True)
    assert a.bucket == b.bucket and a.skip is None and a.plain
    assert dense(causal=True).bucket != dense(causal=False).bucket
    grad = dense(q=FakeCuda(4, 4096, 32, 128, requires_grad=True))
    assert grad.grad and grad.bucket != dense().bucket
    varlen = buckets.describe(
        "flash_attn_varlen_func",
        {
            "q": FakeCuda(18000, 32, 128),
            "k": FakeCuda(18000, 8, 128),
            "cu_seqlens_q": torch.zeros(65, dtype=torch.int32),
            "max_seqlen_q": 512,
            "max_seqlen_k": 512,
            "causal": True,
        },
    )
    assert varlen.skip is None and varlen.bucket[10:12] == ("T", 32768)


def test_packs_of_varying_lengths_share_a_bucket():
    """A padding-free job: every step packs another number of sequences into about as many
    tokens; the packs share one decision (one race), not one per sequence count."""

    def pack(lengths):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        total = int(cu[-1])
        call = {"q": FakeCuda(total, 14, 64), "k": FakeCuda(total, 2, 64), "causal": True}
        call.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths))
        call["max_seqlen_k"] = max(lengths)
        return buckets.describe("flash_attn_varlen_func", call).bucket

    g = torch.Generator().manual_seed(0)
    packs = [torch.randint(64, 513, (n,), generator=g).tolist() for n in (60, 70, 90, 110)]
    packs = [p for p in packs if 16384 < sum(p) <= 32768 and max(p) > 256]
    assert len(packs) >= 3 and len({pack(p) for p in packs}) == 1


@pytest.mark.parametrize(
    "kw, why",
    [
        ({"dropout_p": 0.1}, "dropout"),
        ({"deterministic": True}, "deterministic"),
        ({"alibi_slopes": object()}, "ALiBi"),
        ({"softcap": 30.0}, "softcap"),
        ({"q": FakeCuda(4, 64, 8, 64, dtype=torch.float32)}, "float32"),
    ],
)
def test_calls_the_switch_never_touches(kw, why):
    assert why in dense(**kw).skip
    cpu = {"q": torch.zeros(1, 4, 2, 8), "k": torch.zeros(1, 4, 2, 8)}
    assert buckets.describe("flash_attn_func", cpu).skip == "not a CUDA flash-attention call"
    kv = {"q": FakeCuda(2, 1, 8, 64), "k_cache": FakeCuda(2, 64, 2, 64), "block_table": 1}
    assert "block_table" in buckets.describe("flash_attn_with_kvcache", kv).skip


def test_candidates_follow_what_each_kernel_can_express():
    plain = buckets.candidates(dense(causal=True), torch_flash_ok=True)
    assert plain == [REQUESTED, "sdpa", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "torch_flash"]
    window = dense(causal=True, window_size=(127, 0))
    assert buckets.candidates(window, torch_flash_ok=False) == [REQUESTED, "sdpa"]
    lse = dense(causal=True, return_attn_probs=True)
    assert buckets.candidates(lse, torch_flash_ok=True) == [REQUESTED, "sdpa", "torch_flash"]


def test_the_winner_is_within_tolerance_and_faster_by_the_margin():
    base = Measured(ms=10.0, out_diff=0.0)
    measured = {
        REQUESTED: base,
        "sdpa": Measured(ms=6.0, out_diff=0.004, grad_diff=0.01),
        "sdpa_cudnn": Measured(ms=5.0, out_diff=0.5),  # fast but wrong
        "sdpa_flash": Measured(ms=9.7, out_diff=0.0),  # within 5 %: not worth it
        "torch_flash": Measured(error="RuntimeError: no"),
    }
    v = race.pick(measured, "bfloat16")
    assert v.winner == "sdpa"
    assert "outputs differ" in v.why["sdpa_cudnn"] and "5%" in v.why["sdpa_flash"]
    assert "failed" in v.why["torch_flash"] and "1.67x" in v.why["sdpa"]
    slow = {REQUESTED: base, "sdpa": Measured(ms=9.8, out_diff=0.0)}
    assert race.pick(slow, "bfloat16").winner == REQUESTED
    noisy = {
        REQUESTED: Measured(ms=10.0, out_diff=0.0, rounds=(10.0, 10.0, 10.0)),
        "sdpa": Measured(ms=9.0, out_diff=0.0, rounds=(9.0, 8.9, 9.8)),  # one round not faster
    }
    assert race.pick(noisy, "bfloat16").winner == REQUESTED
    assert "every timed round" in race.pick(noisy, "bfloat16").why["sdpa"]
    grads_off = {REQUESTED: base, "sdpa": Measured(ms=2.0, out_diff=0.0, grad_diff=0.2)}
    assert "gradients differ" in race.pick(grads_off, "bfloat16").why["sdpa"]
    assert race.pick({REQUESTED: Measured(error="x")}, "bfloat16").winner == REQUESTED


@pytest.mark.parametrize("grad", [False, True])
def test_a_race_measures_every_candidate_on_the_calls_inputs(grad):
    """The race's mechanics on CPU stand-ins (attnguard's twin as the "requested" kernel): the
    probe is the requested kernel's warm run; every candidate's warm-up is compared with it and
    kept out of the timing; a candidate that cannot take the call loses with its error."""
    from attnguard import fallback

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 32, generator=g).requires_grad_(grad) for _ in range(3))
    params = ("q", "k", "v", "dropout_p", "softmax_scale", "causal")
    call = SimpleNamespace(entry="flash_attn_func", grad=grad)
    names = [REQUESTED, "sdpa", "sdpa_cudnn"]
    impls = race.implementations("flash_attn_func", fallback.flash_attn_func, params, names)
    run = race.Race(impls, params, (q, k, v), {"causal": True}, call)
    probe = run.probe()
    assert 0 < probe < 10 and run.projected_s() == pytest.approx(probe * race.REPS * 3)
    measured = run.run()
    assert measured["sdpa"].out_diff == 0.0 and len(measured["sdpa"].rounds) == race.REPS
    assert (measured["sdpa"].grad_diff == 0.0) if grad else measured["sdpa"].grad_diff is None
    assert "RuntimeError" in measured["sdpa_cudnn"].error  # no cuDNN on a CPU
    timed = sum(m for name in (REQUESTED, "sdpa") for m in measured[name].rounds) / 1e3
    assert run.timed_s == pytest.approx(probe + timed, rel=1e-6) and run.warm_up_s > 0
    assert q.grad is None  # the caller's tensors are left alone


def test_a_race_the_budget_cannot_afford_stops_after_the_probe():
    from attnguard import fallback

    decisions.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 32, generator=g) for _ in range(3))
    entry = SimpleNamespace(
        name="flash_attn_func", original=fallback.flash_attn_func, params=("q", "k", "v")
    )
    call = SimpleNamespace(entry="flash_attn_func", grad=False, dtype="bfloat16")
    nearly_spent = decisions.Situation((REQUESTED, "sdpa"), spent_s=decisions.FLOOR_S - 1e-6)
    kept = decisions._race(entry, (q, k, v), {}, call, nearly_spent)
    assert kept.winner == REQUESTED and kept.probe_ms > 0 and not kept.measured
    assert "this race would take about" in kept.why[REQUESTED]
    raced = decisions._race(entry, (q, k, v), {}, call, decisions.Situation((REQUESTED, "sdpa")))
    assert set(raced.measured) == {REQUESTED, "sdpa"} and raced.cost["race_s"] > 0
    assert decisions._state.spent_s == pytest.approx(
        kept.probe_ms / 1e3 + raced.cost["race_s"],
        abs=1e-4,  # the cost is kept to 0.1 ms
    )
    decisions.reset()


# --- the package's place ----------------------------------------------------------------------

_ABOVE = ("attnguard", "attnguard.runtime", "attnguard.callguard", "attnguard.doctor")


def _imported(path, package):
    """What a module imports, as dotted targets (``from .. import x`` names ``attnguard.x`` when
    x is a module, else the package ``attnguard`` itself: one of its attributes)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            for alias in node.names:
                target = f"{module}.{alias.name}"
                is_module = (REPO / target.replace(".", "/")).with_suffix(".py").exists() or (
                    REPO / target.replace(".", "/")
                ).is_dir()
                yield target if is_module else module


def test_the_selection_package_sits_below_the_call_guard():
    """One package, entered from the call guard (and doctor): nothing in it imports attnguard's
    package (its ``__init__``), runtime or the call guard; the settings come in as arguments."""
    files = sorted((REPO / "attnguard" / "selection").glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "buckets.py", "decisions.py", "race.py"}
    for path in files:
        targets = set(_imported(path, "attnguard.selection"))
        assert not targets & set(_ABOVE), (path.name, sorted(targets & set(_ABOVE)))
