"""The opt-in numbers check (``ATTNGUARD_VERIFY``), in this process, through the call guard of a
flash-attn entry point (the closure every entry point gets) around deliberately wrong kernels:
caught at the documented rate, said once per site with counts, raised in strict mode, reported in
warn mode; the call's own output always returned; nothing checked under ``torch.compile``, during
CUDA graph capture or where dropout makes two computations differ; attnguard's own failure inside
the check is one ``internal_error``. The setting's spellings and bad values too.

On a CPU flash-attn's kernels cannot run, so every call would go to attnguard's twin
(``cpu_tensors``); these tests switch rerouting off (``disable="reroute"``) so the stand-in
kernel itself computes, as a GPU kernel would.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import attnguard
from attnguard import callguard, config, kernels, runtime, verify
from attnguard.errors import AttnGuardError
from attnguard.fallback import FLASH_FUNCTIONS
from attnguard.kernel_identity import Family
from attnguard.observability import events, numerics, summary

TWIN = FLASH_FUNCTIONS["flash_attn_func"]


@pytest.fixture(autouse=True)
def _fresh_counts() -> Iterator[None]:
    verify.reset()
    yield
    verify.reset()


def _attend(q, k, v, scale, causal, window):  # flash-attn 2's semantics, float32, on the CPU
    sq, sk, h, hk = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    k = k.float().repeat_interleave(h // hk, dim=2)
    v = v.float().repeat_interleave(h // hk, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
    i = torch.arange(sq)[:, None] + (sk - sq)
    j = torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        keep &= j <= i
    if left >= 0:
        keep &= j >= i - left
    if right >= 0 and not causal:
        keep &= j <= i + right
    p = torch.nan_to_num(torch.softmax(s.masked_fill(~keep, -math.inf), dim=-1), nan=0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v).to(q.dtype)


def kernel(bug: str = "", head_dim: int | None = None) -> Any:
    """A stand-in of flash-attn 2's ``flash_attn_func`` (its signature), right or with ``bug``:
    ``scale`` (1/sqrt(head_dim - 1)), ``window`` (one key more on the left), ``zeros`` (a head's
    output lost); ``head_dim``: the bug only at that head dimension."""

    def flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
    ):  # fmt: skip
        d = q.shape[-1]
        wrong = bug if head_dim in (None, d) else ""
        scale = softmax_scale or (d - 1 if wrong == "scale" else d) ** -0.5
        left, right = window_size
        if wrong == "window" and left >= 0:
            left += 1
        out = _attend(q, k, v, scale, causal, (left, right))
        if wrong == "zeros":
            out[:, :, 0] = 0
        return out

    return flash_attn_func


def guarded(fn: Any) -> Any:
    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        fn,
        tensors=("q", "k", "v"),
        twin=TWIN,
        site="flash_attn.flash_attn_func",
        aux=("alibi_slopes",),
        head_axis=3,
        in_force=runtime.IN_FORCE,
        family=Family.FA2,
    )
    return callguard.wrap_direct(entry)


def qkv(d: int = 16, s: int = 24, dtype: torch.dtype = torch.float16, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, s, 4, d), (2, s, 2, d), (2, s, 2, d)]
    return [torch.randn(*shape, generator=g).to(dtype) for shape in shapes]


def mismatches(captured: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in captured if e["event"] == "numerics_mismatch"]


# --- the setting -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("", ""),
        ("off", ""),
        ("0", ""),
        ("1", "0.001"),
        ("on", "0.001"),
        ("0.001", "0.001"),
        ("1e-2", "0.01"),
        ("1.0", "all"),
        ("ALL", "all"),
        ("first:3", "first:3"),
        (True, "0.001"),
        (False, ""),
        (1, "all"),  # in Python a number is a rate
        (0.25, "0.25"),
    ],
)
def test_the_setting_has_one_spelling_each(given: Any, kept: str) -> None:
    assert attnguard.activate(log="none", verify=given).verify == kept


@pytest.mark.parametrize("bad", ["2", "-0.1", "first:0", "first:x", "often", "nan"])
def test_a_bad_value_is_one_clear_line_and_the_program_runs(
    bad: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match="ATTNGUARD_VERIFY"):
        attnguard.activate(log="none", verify=bad)  # the caller's own argument: an error
    monkeypatch.setenv("ATTNGUARD_VERIFY", bad)
    settings = attnguard.activate(log="none")  # from the environment: one line, the check off
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(lines) == 1 and "ATTNGUARD_VERIFY" in lines[0] and "first:N" in lines[0]
    assert "the numbers check stays off" in lines[0]
    assert settings.enabled and settings.verify == ""  # the guard itself stays on
    assert config.load({"ATTNGUARD_VERIFY": "first:2"}).verify == "first:2"


def test_off_by_default_nothing_is_checked(captured: list[dict[str, Any]]) -> None:
    assert attnguard.activate(log="none", disable="reroute").verify == ""
    wrong = guarded(kernel("scale"))
    for _ in range(5):
        wrong(*qkv(), causal=True)
    assert numerics.snapshot() == {} and mismatches(captured) == []


# --- caught at the documented rate ------------------------------------------------------------------


@pytest.mark.parametrize("bug", ["scale", "window", "zeros"])
def test_a_wrong_kernel_is_caught_at_the_documented_rate(
    bug: str, captured: list[dict[str, Any]]
) -> None:
    """Rate 0.25: every 4th call of a bucket, its first included: calls 0, 4, 8, 12, 16 of 20,
    each a mismatch; one event for the site, counted 5 times; every output the kernel's own."""
    attnguard.activate(log="none", verify=0.25, disable="reroute")
    fn = kernel(bug)
    wrong = guarded(fn)
    for n in range(20):
        q, k, v = qkv(seed=n)
        got = wrong(q, k, v, causal=True, window_size=(5, -1))
        assert torch.equal(got, fn(q, k, v, causal=True, window_size=(5, -1)))
    assert numerics.snapshot() == {"checked": 5, "mismatched": 5, "skipped": {}}
    (said,) = mismatches(captured)
    assert said["reason_code"] == "kernel_numbers_differ" and said["level"] == "error"
    assert said["site"] == "flash_attn.flash_attn_func" and said["computed_by"] == "kernel"
    assert (said["family"], said["dtype"], said["source"]) == ("flash-attn 2", "float16", "package")
    assert said["shapes"] == {"q": [2, 24, 4, 16], "k": [2, 24, 2, 16], "v": [2, 24, 2, 16]}
    assert said["arguments"]["window"] == [5, -1] and said["arguments"]["gqa"] == [4, 2]
    assert said["max_error"] > said["tolerance"]["atol"] and said["failed"]
    assert events.counts()[("numerics_mismatch", said["site"], "kernel_numbers_differ")] == 5


def test_the_right_kernel_passes_every_check(captured: list[dict[str, Any]]) -> None:
    attnguard.activate(log="none", verify="all", disable="reroute")
    right = guarded(kernel())
    for n, dtype in enumerate([torch.float16, torch.bfloat16, torch.float32] * 4):
        right(*qkv(dtype=dtype, seed=n), causal=n % 2 == 0, window_size=(n % 5 - 1, -1))
    assert numerics.snapshot() == {"checked": 12, "mismatched": 0, "skipped": {}}
    assert mismatches(captured) == []


def test_first_n_checks_the_first_calls_of_every_bucket() -> None:
    """A bug at one head dimension is met at the first call of that bucket, whatever the rate:
    here the first 2 calls of each of two buckets (head_dim 16 right, 32 wrong)."""
    attnguard.activate(log="none", verify="first:2", disable="reroute")
    wrong = guarded(kernel("zeros", head_dim=32))
    for n in range(6):
        wrong(*qkv(d=16, seed=n), causal=True)
        wrong(*qkv(d=32, seed=n), causal=True)
    assert numerics.snapshot() == {"checked": 4, "mismatched": 2, "skipped": {}}


def test_a_bug_at_one_head_dimension_is_met_at_its_first_call(
    captured: list[dict[str, Any]],
) -> None:
    attnguard.activate(log="none", verify="0.001", disable="reroute")
    wrong = guarded(kernel("scale", head_dim=32))
    for n in range(30):
        wrong(*qkv(d=16, seed=n), causal=True)
    wrong(*qkv(d=32), causal=True)  # the first call at head_dim 32
    assert numerics.snapshot() == {"checked": 2, "mismatched": 1, "skipped": {}}
    (said,) = mismatches(captured)
    assert said["shapes"]["q"][-1] == 32


def test_a_call_the_guard_unified_is_checked_at_the_precision_it_ran_in(
    captured: list[dict[str, Any]],
) -> None:
    """q float32, k and v float16 (a custom model's mixed dtypes): the guard gives the kernel
    one half dtype; the right kernel's numbers pass against the float64 reference."""
    attnguard.activate(log="none", verify="all", disable="reroute")
    right = guarded(kernel())
    for n in range(6):
        q, k, v = qkv(seed=n)
        right(q.float(), k, v, causal=True, window_size=(n, -1))
    assert numerics.snapshot() == {"checked": 6, "mismatched": 0, "skipped": {}}
    assert [e["event"] for e in captured if e["event"] != "activated"] == ["qkv_unified"]


# --- modes, and what is never changed -----------------------------------------------------------


def test_strict_mode_raises_on_a_mismatch_only() -> None:
    attnguard.activate(log="none", verify="all", disable="reroute", mode="strict")
    guarded(kernel())(*qkv(), causal=True)  # right: no error
    with pytest.raises(AttnGuardError) as raised:
        guarded(kernel("window"))(*qkv(), causal=True, window_size=(3, -1))
    assert raised.value.reason_code == "kernel_numbers_differ"


def test_warn_mode_reports_and_changes_nothing(captured: list[dict[str, Any]]) -> None:
    attnguard.activate(log="none", verify="all", disable="reroute", mode="warn")
    fn = kernel("window")
    out = fn(*qkv(), causal=True, window_size=(3, -1))
    got = guarded(fn)(*qkv(), causal=True, window_size=(3, -1))
    assert torch.equal(got, out)
    (said,) = mismatches(captured)
    assert said["mode"] == "warn" and said["reason_code"] == "kernel_numbers_differ"


def test_the_calls_output_is_the_kernels_own_object() -> None:
    attnguard.activate(log="none", verify="all", disable="reroute")
    made: list[torch.Tensor] = []
    inner = kernel("scale")

    def fn(*args: Any, **kwargs: Any) -> torch.Tensor:
        made.append(inner(*args, **kwargs))
        return made[-1]

    fn.__signature__ = __import__("inspect").signature(inner)  # type: ignore[attr-defined]
    got = guarded(fn)(*qkv(), causal=True)
    assert got is made[-1]


def test_dropout_and_no_reference_are_skipped_and_counted() -> None:
    attnguard.activate(log="none", verify="all", disable="reroute")
    right = guarded(kernel())
    for _ in range(3):
        right(*qkv(), dropout_p=0.1, causal=True)
    own = callguard.Entry(  # a kernel of its own semantics: no reference
        "my_attention",
        kernels.EntryKind.REGISTRY_OTHER,
        lambda module, query, key, value, mask, **kw: (query, None),
        tensors=("query", "key", "value"),
        twin=None,
        mask="attention_mask",
        positions={"query": 1, "key": 2, "value": 3, "attention_mask": 4},
        site="transformers.my_attention",
        in_force=runtime.IN_FORCE,
    )
    q = torch.randn(1, 2, 4, 8)
    callguard.guard(own, lambda a, k: False)(None, q, q, q, None)
    assert numerics.snapshot() == {
        "checked": 0,
        "mismatched": 0,
        "skipped": {"dropout": 3, "no_reference": 1},
    }


def test_cuda_graph_capture_is_skipped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    attnguard.activate(log="none", verify="all", disable="reroute")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    fn = kernel("scale")
    assert torch.equal(guarded(fn)(*qkv(), causal=True), fn(*qkv(), causal=True))
    assert numerics.snapshot() == {
        "checked": 0,
        "mismatched": 0,
        "skipped": {"cuda_graph_capture": 1},
    }


def test_nothing_is_checked_inside_a_compiled_graph(captured: list[dict[str, Any]]) -> None:
    """The check is Python on the eager path: ``torch.compile(fullgraph=True)`` traces the guard
    with the check left out (no graph break), and the compiled calls are neither checked nor
    counted; the same calls run eagerly are."""
    attnguard.activate(log="none", verify="all", disable="reroute")
    fn = kernel("window")
    wrong = guarded(fn)
    q, k, v = qkv(dtype=torch.float32)

    def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return wrong(q, k, v, causal=True, window_size=(3, -1)) * 2

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got = compiled(q, k, v)
    assert torch.allclose(got, fn(q, k, v, causal=True, window_size=(3, -1)) * 2)
    assert numerics.snapshot() == {} and mismatches(captured) == []
    step(q, k, v)  # eagerly: checked
    assert numerics.snapshot()["mismatched"] == 1


def test_an_error_inside_the_check_is_attnguards_and_the_output_stands(
    monkeypatch: pytest.MonkeyPatch, captured: list[dict[str, Any]]
) -> None:
    attnguard.activate(log="none", verify="all", disable="reroute")

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the reference broke")

    monkeypatch.setattr(verify, "compare", broken)
    fn = kernel()
    assert torch.equal(guarded(fn)(*qkv(), causal=True), fn(*qkv(), causal=True))
    (error,) = [e for e in captured if e["event"] == "internal_error"]
    assert error["site"] == "flash_attn.flash_attn_func.verify"
    assert numerics.snapshot()["skipped"] == {"error": 1}


def test_the_kernels_own_error_propagates_unchanged() -> None:
    attnguard.activate(log="none", verify="all", disable="reroute")

    def failing(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False,
                return_attn_probs=False):  # fmt: skip
        raise KeyError("the kernel's own")

    with pytest.raises(KeyError, match="the kernel's own"):
        guarded(failing)(*qkv())


# --- the counts in the summaries ----------------------------------------------------------------


def test_the_exit_summary_counts_checked_mismatched_and_skipped() -> None:
    attnguard.activate(log="none", verify="all", disable="reroute")
    wrong = guarded(kernel("window"))
    wrong(*qkv(), causal=True, window_size=(3, -1))
    wrong(*qkv(), causal=True, window_size=(3, -1), dropout_p=0.5)
    fields = summary.local_fields()
    assert fields["numerics"] == {"checked": 1, "mismatched": 1, "skipped": {"dropout": 1}}
    assert fields["observed"] == 1  # the mismatch: a finding, never a change
    record = summary._record(1)
    from attnguard.observability.gather import parse_record

    parsed, _ = parse_record(record, 1)
    assert parsed.numerics == fields["numerics"]
    merged = summary.aggregate({0: parsed.__class__(parsed.proc), 1: parsed})
    assert merged["numerics"] == {
        "checked": 1,
        "mismatched": 1,
        "skipped": {"dropout": 1},
        "per_rank": {"1": {"checked": 1, "mismatched": 1, "skipped": {"dropout": 1}}},
    }
    assert summary._level(merged) == "warning"
    said = numerics.headline(merged["numerics"])
    assert "1 mismatched" in said and "dropout 1" in said


def test_a_malformed_record_count_is_left_out() -> None:
    assert numerics.clean({"checked": 1, "mismatched": 2}) == {}
    assert numerics.clean({"checked": -1}) == {}
    assert numerics.clean({"checked": 2, "mismatched": 0, "skipped": {"why": 3}}) == {
        "checked": 2,
        "mismatched": 0,
        "skipped": {},
    }
    assert numerics.clean("nonsense") == {}


def test_the_alert_recipe_pages_once_per_kernel() -> None:
    """docs/observability.md's alert on ``numerics_mismatch``, run as written."""
    import logging
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "observability.md").read_text()
    block = re.search(r"<!-- recipe: numerics-alert -->\s*```python\n(.*?)```", doc, re.S)
    assert block, "docs/observability.md lost its numbers-check alert recipe"
    namespace: dict[str, Any] = {}
    exec(compile(block.group(1), "observability.md", "exec"), namespace)
    pages: list[str] = []
    alert = namespace["alert"]
    alert.page = pages.append
    try:
        attnguard.activate(log="none", verify="all", disable="reroute")
        wrong = guarded(kernel("window"))
        for n in range(3):
            wrong(*qkv(seed=n), causal=True, window_size=(3, -1))
        guarded(kernel())(*qkv(), causal=True)
    finally:
        logging.getLogger("attnguard").removeHandler(alert)
    assert len(pages) == 1 and "flash-attn flash_attn_func (flash-attn 2)" in pages[0]
    assert "kernel_numbers_differ" in pages[0] and "rank 0" in pages[0]
