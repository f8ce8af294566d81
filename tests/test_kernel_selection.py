"""Opt-in kernel selection (ATTNGUARD_KERNEL=fastest) where it can be checked without a GPU.

* the setting: validated like every other, off by default;
* with the switch on and no GPU, a guarded program computes and reports exactly what it does
  with the switch off (the switch only ever touches CUDA flash-attn calls);
* the rules (attnguard.selection.buckets, .race): buckets, what is never touched and why,
  candidates, winner;
* the decisions (attnguard.selection.decisions, .cache): a cache file that is corrupt, of
  another GPU or version, another user's, a link or too large is ignored with one ``observed`` event and never trusted;
  the first decision written wins and later ones adopt it; two ranks of a real torchrun job
  (gloo) that measured different winners end with the same one.

The races themselves, the cache hit in a second process and agreement with real measurements
are GPU tests (tests/gpu/test_selection_gpu.py).
"""

from __future__ import annotations

import json
import os
import subprocess
from types import SimpleNamespace

import pytest
import torch
from helpers.packages import STANDINS
from helpers.processes import PY, REPO, subprocess_env

import attnguard
from attnguard.observability import events
from attnguard.selection import buckets, cache, decisions, race
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


class FakeCuda(SimpleNamespace):
    """A tensor's metadata as describe() reads it (it never reads values)."""

    def __init__(self, *shape, dtype=torch.bfloat16, requires_grad=False):
        super().__init__(
            shape=shape,
            dtype=dtype,
            is_cuda=True,
            requires_grad=requires_grad,
            device=torch.device("cuda", 0),
        )


def dense(**kw):
    call = {"q": FakeCuda(4, 4096, 32, 128), "k": FakeCuda(4, 4096, 8, 128), "v": None}
    call.update(kw)
    return buckets.describe("flash_attn_func", call)


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


# --- the decisions on disk and across ranks -------------------------------------------------------

FP = ("f" * 16, {"gpu": "Test GPU", "torch": "2.x", "flash_attn": "2.8.3", "attnguard": "0"})


@pytest.fixture
def disk(tmp_path, monkeypatch, captured):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    decisions.reset()
    monkeypatch.setattr(cache, "fingerprint", lambda version: FP)
    attnguard.activate(log="none")
    call = dense(causal=True)
    folder = cache.Disk(cache.cache_root(), FP)
    path = os.path.join(folder.path, cache.bucket_id(call.bucket) + ".json")
    yield SimpleNamespace(call=call, path=path, events=captured, dir=folder.path, cache=folder)
    decisions.reset()


def ignored(events):
    return [e for e in events if e["reason_code"] == "kernel_cache_ignored"]


def test_a_decision_written_first_wins_and_reads_back(disk):
    first = decisions.Decision("sdpa", {"sdpa": "1.5x"}, {"sdpa": {"ms": 1.0}})
    second = decisions.Decision(REQUESTED, {REQUESTED: "kept"})
    assert disk.cache.write_first(disk.call, first).winner == "sdpa"
    assert disk.cache.write_first(disk.call, second).winner == "sdpa"  # adopts the first
    assert disk.cache.read(disk.call).as_json() == first.as_json()
    assert oct(os.stat(disk.dir).st_mode & 0o777) == "0o700"
    assert oct(os.stat(disk.path).st_mode & 0o777) == "0o600"
    assert not ignored(disk.events)


def _write(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(data if isinstance(data, str) else json.dumps(data))


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "unreadable"),
        ({"schema": 1, "fingerprint": {**FP[1], "gpu": "Other GPU"}}, "another GPU"),
        ({"schema": 1, "fingerprint": {**FP[1], "attnguard": "9"}}, "another GPU or with other"),
        ({"schema": 7}, "schema"),
        ("x" * (1 << 17), "at most 65536"),
        ("[" * 30000 + "]" * 30000, "unreadable"),  # nesting deeper than Python recurses
    ],
)
def test_bad_cache_files_are_ignored_with_one_event(disk, content, why):
    _write(disk.path, content)
    for _ in range(3):
        assert disk.cache.read(disk.call) is None
    seen = ignored(disk.events)
    assert len(seen) == 1 and seen[0]["event"] == "observed", seen
    assert why in seen[0]["reason"]


def test_a_planted_link_is_not_followed(disk, tmp_path):
    target = tmp_path / "elsewhere.json"
    good = json.loads(cache.record(disk.call, decisions.Decision("sdpa"), FP[1]).decode())
    target.write_text(json.dumps(good))
    os.makedirs(disk.dir, exist_ok=True)
    os.symlink(target, disk.path)
    assert disk.cache.read(disk.call) is None
    assert "symbolic link" in ignored(disk.events)[0]["reason"]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to chown")
def test_another_users_cache_file_is_not_trusted(disk):
    good = json.loads(cache.record(disk.call, decisions.Decision("sdpa"), FP[1]).decode())
    _write(disk.path, good)
    os.chown(disk.path, 65534, 65534)  # nobody
    assert disk.cache.read(disk.call) is None
    assert "another user" in ignored(disk.events)[0]["reason"]


def test_ranks_adopt_the_first_posted_decision_from_the_store(stand_in, monkeypatch):
    store = torch.distributed.HashStore()
    monkeypatch.setattr(cache, "job_store", lambda: store)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert stand_in.serve(causal=True) == "sdpa"  # the first rank raced, and posted its winner
    decisions.reset()  # another rank: a process of its own, the same job store
    events.reset_counts()

    def kept(*args):
        return decisions.Decision(REQUESTED, {REQUESTED: "kept"}, {"requested": {"ms": 1.0}})

    monkeypatch.setattr(decisions, "_race", kept)
    assert stand_in.serve(causal=True) == "sdpa"
    assert said(stand_in.events)[-1]["source"] == "this job"


def test_several_ranks_without_a_group_never_race(stand_in, monkeypatch):
    """No process group to agree through: a race's winner could differ per rank, so none runs;
    a decision already cached on this node (the same file for every rank) is used."""

    def no_race(*a, **k):
        raise AssertionError("raced without a way to agree")

    monkeypatch.setattr(decisions, "_race", no_race)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert stand_in.serve(causal=True) == REQUESTED
    (ev,) = said(stand_in.events)
    assert ev["reason_code"] == "not_raced" and "no process group" in ev["reason"]
    decisions.reset()
    events.reset_counts()
    stand_in.disk_has("sdpa", causal=True)
    assert stand_in.serve(causal=True) == "sdpa"
    assert said(stand_in.events)[-1]["source"] == "disk cache"
    decisions.reset()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # ranks on several nodes: disks differ
    assert stand_in.serve(causal=True) == REQUESTED


_RANK_PROGRAM = r"""
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
import attnguard
from attnguard.selection import buckets, cache, decisions
from types import SimpleNamespace
cache.fingerprint = lambda version: ("e" * 16, {"gpu": "Test GPU"})
attnguard.activate(log="none")
rank = dist.get_rank()
# each rank measured another winner (as timing noise can make them); the job must agree
def fake_race(*args):
    import time
    time.sleep(0.2 * rank)
    winner = "sdpa" if rank == 1 else "requested"
    return decisions.Decision(winner, {winner: f"rank {rank}"}, {winner: {"ms": float(rank)}})
decisions._race = fake_race
cache.Disk.read = lambda self, call, folder=None: None
cache.Disk.write_first = lambda self, call, d: d
class T(SimpleNamespace):
    pass
q = T(shape=(4, 4096, 32, 128), dtype=torch.bfloat16, is_cuda=True, requires_grad=False,
      device=torch.device("cuda", 0))
call = buckets.describe("flash_attn_func", {"q": q, "k": q, "causal": True})
entry = SimpleNamespace(params=("q", "k", "causal"), name="flash_attn_func", original=None)
got = decisions.decide(entry, (q, q, True), {}, call, decisions.Options())
print(json.dumps({"rank": rank, "winner": got.winner, "source": got.source}))
dist.destroy_process_group()
"""


def test_two_ranks_of_a_job_agree_on_one_winner(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_RANK_PROGRAM)
    env = subprocess_env(OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = [json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")]
    assert len(got) == 2
    assert got[0]["winner"] == got[1]["winner"] == "requested"  # rank 0 posted first
    assert {g["source"] for g in got} == {"measured", "this job"}


# --- what a decision read from the store or the disk may be, and when nothing is raced ---------

FLASH_PARAMS = (
    "q",
    "k",
    "v",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size",
    "softcap",
    "alibi_slopes",
    "deterministic",
    "return_attn_probs",
)


def _requested_kernel(*args, **kwargs):
    raise AssertionError("a stand-in: the test looks at the decision, the kernel is not called")


ENTRY = SimpleNamespace(
    name="flash_attn_func",
    params=FLASH_PARAMS,
    original=_requested_kernel,
    site="flash_attn.flash_attn_func",
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch, captured):
    """The fingerprint and the race stood in on CPU (each race "measures" ``sdpa`` faster and is
    counted); ``serve`` answers with the kernel name that computes a call."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    decisions.reset()
    monkeypatch.setattr(cache, "fingerprint", lambda version: FP)
    raced = []

    def fake_race(*args, **kwargs):
        raced.append(args)
        return decisions.Decision("sdpa", {"sdpa": "1.50x"}, {"sdpa": {"ms": 1.0}})

    monkeypatch.setattr(decisions, "_race", fake_race)
    attnguard.activate(log="none")

    def serve(opts=None, **call):
        args = {"q": FakeCuda(4, 4096, 32, 128), "k": FakeCuda(4, 4096, 8, 128), **call}
        impl = decisions.serve(ENTRY, (), args, opts or decisions.Options(version="0"))
        return REQUESTED if impl is None else _served_name(impl)

    def disk_has(winner, **call):
        args = {"q": FakeCuda(4, 4096, 32, 128), "k": FakeCuda(4, 4096, 8, 128), **call}
        described = buckets.describe("flash_attn_func", args)
        decision = decisions.Decision(winner, {winner: "1.50x"}, {winner: {"ms": 1.0}})
        disk = cache.Disk(cache.cache_root(), FP)
        assert disk.write_first(described, decision).winner == winner
        return described

    yield SimpleNamespace(serve=serve, disk_has=disk_has, raced=raced, events=captured)
    decisions.reset()


def _served_name(impl):
    """Which candidate an implementation returned by serve() is (by identity, from the cache of
    implementations serve() keeps)."""
    names = [n for (entry, n), made in decisions._state.impls.items() if made is impl]
    assert len(names) == 1, names
    return names[0]


def said(events):
    return [e for e in events if e["event"] == "kernel_selected"]


# a causal call with fewer queries than keys that returns the LSE: SDPA's flash backend computes
# neither bottom-right causality nor the LSE (its candidates: requested, sdpa, torch_flash)
LSE_CALL = {
    "q": FakeCuda(2, 100, 8, 64),
    "k": FakeCuda(2, 300, 2, 64),
    "causal": True,
    "return_attn_probs": True,
}


class ForgedStore:
    """A job's store that anyone on the network posted to first: it holds ``raw`` for every
    kernel decision key (the TCPStore has no authentication)."""

    def __init__(self, raw):
        self.raw = raw

    def check(self, keys):
        return True

    def get(self, key):
        return self.raw

    def compare_set(self, key, expected, desired):
        return self.raw


def test_a_posted_decision_that_is_no_candidate_for_the_call_is_not_used(stand_in, monkeypatch):
    described = buckets.describe("flash_attn_func", LSE_CALL)
    forged = cache.record(described, decisions.Decision("sdpa_flash"), FP[1])
    monkeypatch.setattr(cache, "job_store", lambda: ForgedStore(forged))
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert stand_in.serve(**LSE_CALL) == REQUESTED
    assert not stand_in.raced  # every rank judges the posted value alike: nobody races
    (ev,) = said(stand_in.events)
    assert ev["selected"] == "flash_attn_func" and ev["source"] == "this job"
    assert "sdpa_flash" in ev["reason"] and "not a candidate" in ev["reason"]


def test_a_cached_decision_that_is_no_candidate_for_the_call_is_ignored(stand_in):
    stand_in.disk_has("sdpa_flash", **LSE_CALL)
    assert stand_in.serve(**LSE_CALL) == "sdpa"  # measured again
    assert len(stand_in.raced) == 1
    (ignored_ev,) = ignored(stand_in.events)
    assert "sdpa_flash" in ignored_ev["reason"] and "not a candidate" in ignored_ev["reason"]


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


def test_deterministic_mode_keeps_the_requested_kernel_over_a_cached_decision(
    stand_in, deterministic
):
    stand_in.disk_has("sdpa", causal=True)
    assert stand_in.serve(causal=True) == REQUESTED
    assert not stand_in.raced and not said(stand_in.events)
    torch.use_deterministic_algorithms(False)  # switched off: a later call decides
    assert stand_in.serve(causal=True) == "sdpa"
    assert said(stand_in.events)[0]["source"] == "disk cache"


def test_warn_mode_serves_every_bucket_with_the_requested_kernel(stand_in):
    """The mode in force decides, not the mode a bucket was first decided in."""
    from attnguard import callguard

    def serve(mode, **call):
        return stand_in.serve(callguard._selection_options(attnguard.configure(mode=mode)), **call)

    assert serve("fix", causal=True) == "sdpa"
    assert serve("warn", causal=True) == REQUESTED  # decided in fix mode
    assert serve("warn", causal=False) == REQUESTED  # first decided in warn mode
    assert serve("fix", causal=False) == "sdpa"
    assert serve("fix", causal=True) == "sdpa"
    assert len(stand_in.raced) == 2
    first = {e["bucket"][4]: e["applied"] for e in said(stand_in.events)}
    assert first == {"True": True, "False": False}  # each said once, as it was applied then


def test_the_race_budget_grows_with_the_time_spent_in_attention(stand_in, monkeypatch):
    """Races may take a floor plus a share of the attention time so far: once the floor is
    spent, a new bucket keeps the requested kernel (``not_raced``, saying the numbers); after
    the job has spent enough time in attention, a new bucket is raced again."""

    def costly_race(*args):
        decisions._state.spent_s += decisions.FLOOR_S + 0.1  # more than the whole floor
        measured = {"requested": {"ms": 80.0}, "sdpa": {"ms": 50.0}}
        return decisions.Decision("sdpa", {"sdpa": "1.60x"}, measured, {"race_s": 3.0})

    monkeypatch.setattr(decisions, "_race", costly_race)
    assert stand_in.serve(causal=True) == "sdpa"
    first = said(stand_in.events)[0]
    assert first["cost"]["race_s"] == 3.0
    assert first["cost"]["process_allowance_s"] == decisions.FLOOR_S
    batch2 = {"q": FakeCuda(2, 4096, 32, 128), "k": FakeCuda(2, 4096, 8, 128), "causal": True}
    assert stand_in.serve(**batch2) == REQUESTED
    kept = said(stand_in.events)[-1]
    assert kept["reason_code"] == "not_raced" and "race budget is spent" in kept["reason"]
    # 2,000 calls served at 50 ms each: 100 s in attention, 1 % of it is one more second
    for _ in range(2000):
        stand_in.serve(causal=True)
    batch1 = {"q": FakeCuda(1, 4096, 32, 128), "k": FakeCuda(1, 4096, 8, 128), "causal": True}
    assert stand_in.serve(**batch1) == "sdpa"
    assert said(stand_in.events)[-1]["cost"]["process_allowance_s"] == pytest.approx(
        decisions.FLOOR_S + 1.0, rel=1e-3
    )


def test_the_rules_of_the_race_budget():
    s = decisions.Situation(("requested", "sdpa"), spent_s=2.0, attention_s=50.0)
    assert s.allowance_s == decisions.FLOOR_S + 0.5
    assert decisions.why_not("race", s) is None
    assert decisions.why_not("spend", s, projected_s=1.0) is None
    over = decisions.why_not("spend", s, projected_s=2.0)
    assert "2.00 s more" in over and "3.50 s race budget" in over and "50.0 s" in over


def test_the_cache_directory_setting_is_validated(monkeypatch, tmp_path):
    where = tmp_path / "decisions"
    assert attnguard.activate(log="none", kernel_cache=str(where)).kernel_cache == str(where)
    with pytest.raises(ValueError) as err:
        attnguard.activate(log="none", kernel_cache="relative/dir")
    text = str(err.value)
    assert "ATTNGUARD_KERNEL_CACHE" in text and "'relative/dir'" in text
    assert "not an absolute path" in text and "an absolute path of a directory" in text
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="is not a directory"):
        attnguard.activate(log="none", kernel_cache=str(tmp_path / "file"))


def test_decisions_live_in_the_cache_directory_set(stand_in, tmp_path, monkeypatch):
    """ATTNGUARD_KERNEL_CACHE (a shared filesystem): the decision one job measured is the next
    job's (or another node's), under the same file rules; doctor lists it from there."""
    from attnguard import callguard

    shared = tmp_path / "shared" / "kernels"
    opts = callguard._selection_options(attnguard.configure(kernel_cache=str(shared)))
    assert stand_in.serve(opts, causal=True) == "sdpa"
    (folder,) = shared.iterdir()
    (record,) = folder.iterdir()
    assert folder.name == FP[0] and oct(folder.stat().st_mode & 0o777) == "0o700"
    assert oct(record.stat().st_mode & 0o777) == "0o600"
    assert not list((tmp_path / "attnguard").glob("kernels/*/*.json"))  # not the default place
    decisions.reset()  # the next job
    events.reset_counts()
    monkeypatch.setattr(decisions, "_race", lambda *a: pytest.fail("raced again"))
    assert stand_in.serve(opts, causal=True) == "sdpa"
    assert said(stand_in.events)[-1]["source"] == "disk cache"
    env = subprocess_env(ATTNGUARD_KERNEL_CACHE=str(shared), XDG_CACHE_HOME=str(tmp_path / "x"))
    res = subprocess.run(
        [PY, "-m", "attnguard", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    listed = res.stdout.split("Kernel decisions cached on this machine", 1)[1]
    assert f"in {shared}" in listed and "Test GPU: flash_attn_func/bfloat16/128/32/8" in listed
    assert "-> sdpa (1.50x)" in listed


_FORK_PROGRAM = r"""
import os, sys, threading, time
from types import SimpleNamespace
import torch
import attnguard
from attnguard.selection import cache, decisions
attnguard.activate(log="none")
cache.fingerprint = lambda version: ("f" * 16, {"gpu": "Test GPU"})
deciding, release = threading.Event(), threading.Event()

def fake_race(entry, args, kwargs, call, *rest):
    if call.bucket[5]:  # the causal bucket: held until the parent lets it go
        deciding.set()
        release.wait(60)
    return decisions.Decision("requested", {"requested": "kept"})

decisions._race = fake_race
class T(SimpleNamespace):
    pass
def q(*shape):
    return T(shape=shape, dtype=torch.bfloat16, is_cuda=True, requires_grad=False,
             device=torch.device("cuda", 0))
entry = SimpleNamespace(name="flash_attn_func", params=("q", "k", "causal"), original=None,
                        site="flash_attn.flash_attn_func")
def serve(causal):
    return decisions.serve(entry, (q(2, 64, 4, 64), q(2, 64, 4, 64), causal), {},
                           decisions.Options(version="0"))
thread = threading.Thread(target=serve, args=(True,))
thread.start()
assert deciding.wait(60)
pid = os.fork()
if pid == 0:
    serve(False)  # a new bucket in the child, while the parent's thread still decides its own
    os._exit(0)
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.05)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    status = "blocked"
release.set()
thread.join()
print("CHILD", status)
"""


def test_a_child_forked_while_a_bucket_is_decided_decides_its_own(tmp_path):
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [PY, "-c", _FORK_PROGRAM], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-2:] == ["CHILD", "0"], res.stdout


_RANKS_DIFFER = r"""
import json, os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo")
import attnguard
from attnguard.observability import events
from attnguard.selection import cache, decisions
from types import SimpleNamespace
case, rank = sys.argv[1], dist.get_rank()
gpu = "H100 SXM" if case == "gpus differ" and rank == 0 else "H100 PCIe"
cache.fingerprint = lambda version: (gpu.replace(" ", "")[:16], {"gpu": gpu})
attnguard.activate(log="none")
first = 0 if case != "deterministic rank last" else 1
if case.startswith("deterministic") and rank == 0:
    torch.use_deterministic_algorithms(True)
def fake_race(*args):
    return decisions.Decision("sdpa" if rank == 1 else "requested", {"x": f"rank {rank}"},
                              {"sdpa": {"ms": 1.0}})
decisions._race = fake_race
class T(SimpleNamespace):
    pass
q = T(shape=(4, 4096, 32, 128), dtype=torch.bfloat16, is_cuda=True, requires_grad=False,
      device=torch.device("cuda", 0))
entry = SimpleNamespace(name="flash_attn_func", params=("q", "k", "causal"), original=None,
                        site="flash_attn.flash_attn_func")
if rank != first:
    dist.barrier()  # the other rank reaches the bucket (and posts) first
with events.capture() as seen:
    impl = decisions.serve(entry, (q, q, True), {}, decisions.Options(version="0"))
if rank == first:
    dist.barrier()
ev = [e for e in seen if e["event"] == "kernel_selected"]
print(json.dumps({"rank": rank, "served": "requested" if impl is None else "another",
                  "said": [(e["level"], e["reason"]) for e in ev]}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("case", ["gpus differ", "deterministic rank first"])
def test_ranks_agree_whatever_their_gpus_and_determinism(tmp_path, case):
    """One rank on another GPU model (another fingerprint), or in deterministic mode: every rank
    computes the bucket with the same kernel (here the requested one, which the first rank to
    reach the bucket posted)."""
    got = _two_ranks(tmp_path, _RANKS_DIFFER, case)
    assert [g["served"] for g in got] == ["requested", "requested"], got


def test_a_deterministic_rank_that_comes_last_says_the_ranks_differ(tmp_path):
    """The other rank already computes with the kernel it posted; this rank's deterministic mode
    keeps the requested kernel, and a warning says the ranks now differ on that bucket."""
    got = _two_ranks(tmp_path, _RANKS_DIFFER, "deterministic rank last")
    assert [g["served"] for g in got] == ["requested", "another"], got
    (level, reason), *_ = got[0]["said"]
    assert level == "warning" and "ranks differ" in reason and "deterministic" in reason


def _two_ranks(tmp_path, program, *argv):
    script = tmp_path / "ranks.py"
    script.write_text(program)
    env = subprocess_env(OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path / "cache"))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    res = subprocess.run([*cmd, *argv], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    got = sorted(
        (json.loads(x) for x in res.stdout.splitlines() if x.startswith("{")),
        key=lambda g: g["rank"],
    )
    assert len(got) == 2, res.stdout
    return got


# --- attnguard doctor reads the cache under the same rules ---------------------------------------


def test_doctor_lists_the_cache_under_the_file_rules(tmp_path):
    """A shared cache directory with another user's plants: a FIFO (an open would block for ever),
    terminal escapes in a record, a link to a file elsewhere, a directory anyone may write.
    doctor finishes, prints no escape and nothing of what the links lead to, and names each."""
    root = tmp_path / "attnguard" / "kernels"
    mine = root / ("a" * 16)
    mine.mkdir(parents=True, mode=0o700)
    os.mkfifo(mine / "fifo.json")
    evil = {"schema": 1, "fingerprint": {"gpu": "\x1b]0;owned\x07GPU"}, "bucket": ["\x1b[2J"]}
    (mine / "escapes.json").write_text(json.dumps({**evil, "winner": "sdpa\x1b[31m"}))
    secret = tmp_path / "secret.txt"
    secret.write_text(json.dumps({"winner": "SECRET-CONTENT", "why": {}}))
    os.symlink(secret, mine / "link.json")
    shared = root / ("b" * 16)
    shared.mkdir(mode=0o700)
    (shared / "planted.json").write_text(json.dumps({"winner": "PLANTED", "why": {}}))
    os.chmod(shared, 0o777)
    env = subprocess_env(XDG_CACHE_HOME=str(tmp_path))
    res = subprocess.run(
        [PY, "-m", "attnguard", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-3000:]
    listed = res.stdout.split("Kernel decisions cached on this machine", 1)[1]
    assert "\x1b" not in res.stdout and "\x07" not in res.stdout
    assert "SECRET-CONTENT" not in listed and "PLANTED" not in listed
    assert "FIFO" in listed and "symbolic link" in listed and "written by other users" in listed
    assert "\\x1b" in listed  # the escapes shown as text


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


# --- a decode loop: calls served by their signature ----------------------------------------


def _meta(*shape):
    """Tensors the guard checks like CUDA ones (not CPU: flash-attn takes them) at no cost."""
    return torch.empty(*shape, dtype=torch.bfloat16, device="meta")


@pytest.fixture
def signed(monkeypatch):
    """A guarded flash_attn_func (a recording kernel) under fastest on CPU: meta tensors stand
    in for CUDA ones, every bucket is decided for a winner that records too, and each bucket
    computed is counted."""
    from attnguard import callguard, kernels, runtime

    ran: list[tuple[str, int]] = []

    def original(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):  # fmt: skip
        ran.append(("requested", q.shape[0]))
        return q

    def winner(a, kw):
        ran.append(("sdpa", a[0].shape[0]))
        return a[0]

    computed = []

    def bucket(entry, named):  # a CUDA call's bucket: the batch decides which one
        computed.append(named["q"].shape[0])
        b = named["q"].shape[0]
        return ("flash_attn_func", "bfloat16", 64, 4, 2, True, (-1, -1), False, False, True, b)

    winners = {1: "sdpa", 2: REQUESTED}
    monkeypatch.setattr(buckets, "bucket", bucket)
    monkeypatch.setattr(
        decisions,
        "decide",
        lambda entry, args, kwargs, call, opts: decisions.Decision(
            winners[call.bucket[-1]], {"sdpa": "test", REQUESTED: "test"}
        ),
    )
    monkeypatch.setattr(race, "implementations", lambda *a: {"sdpa": winner})
    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        original,
        tensors=("q", "k", "v"),
        twin=original,
        site="flash_attn.flash_attn_func",
        aux=("alibi_slopes",),
        head_axis=3,
        in_force=runtime.IN_FORCE,
    )
    decisions.reset()
    attnguard.activate(log="none", kernel="fastest")
    yield callguard.wrap_direct(entry), ran, computed
    decisions.reset()


def test_a_decode_loop_is_served_by_signature_and_new_shapes_are_decided(signed):
    """Under fastest every call of a decided bucket computes on its winner (or the requested
    kernel), each new signature is decided once, repeated ones are served without computing
    a bucket, and the switch reports no error of its own."""
    guarded, ran, computed = signed
    with events.capture() as seen:
        for b in (1, 1, 2, 2, 1, 2, 1):
            guarded(_meta(b, 1, 4, 64), _meta(b, 16, 2, 64), _meta(b, 16, 2, 64), causal=True)
    assert ran == [("sdpa" if b == 1 else "requested", b) for b in (1, 1, 2, 2, 1, 2, 1)]
    # a new signature's bucket is computed once (the call described in one pass) when it is
    # decided; the repeats are served by signature
    assert computed == [1, 2]
    assert not [e for e in seen if e["event"] == "internal_error"], seen
    (count,) = [c for c in decisions._state.calls.values() if c[0] == 4]  # b=1 counted 4 times
    assert count == [4]


def test_a_signature_served_before_is_checked_again_where_a_tensor_differs(signed):
    """A served signature holds every fact the guard checks: a call whose key has another dtype
    than before is not served from it but checked, and remedied (unified), as without the
    switch."""
    guarded, ran, computed = signed
    q, k = _meta(1, 1, 4, 64), _meta(1, 16, 2, 64)
    guarded(q, k, k, causal=True)
    with events.capture() as seen:
        guarded(q, k.float(), k, causal=True)
    assert [e["event"] for e in seen if e["event"] != "kernel_selected"] == ["qkv_unified"]
