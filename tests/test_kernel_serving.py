"""Calls served from kernel decisions (ATTNGUARD_KERNEL=fastest), checked without a GPU: a
decision read from the job's store or the disk that is no candidate for the call is not used;
deterministic and warn mode keep the requested kernel; the race budget grows with the time spent
in attention; a decode loop is served by each call's signature, checked again where a tensor
differs.
"""

from __future__ import annotations

import pytest
import torch
from helpers.selection import (
    FP,
    FakeCuda,
    ignored,
    said,
)

import attnguard
from attnguard.observability import events
from attnguard.selection import buckets, cache, decisions, race
from attnguard.selection.buckets import REQUESTED

# --- what a decision read from the store or the disk may be, and when nothing is raced ---------


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
