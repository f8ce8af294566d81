"""The exit summary's advice is computed from what happened: the device, and what reached
attnguard's twins of transformers' flash path (packed rows, sliding windows). A hint that cannot
be followed on the machine, or that would change the numbers, is not given.

Real models: a tiny Llama and Qwen2 loaded with ``flash_attention_2`` where flash-attn cannot run
(the twins serve transformers' flash path), fed a packed row (padding-free: ``position_ids``
restarting at 0, no mask), a padded batch, one plain row; the advice is read from the summary's
own fields, as the exit summary computes it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import tiny_config, tiny_inputs, tiny_model_class

import attnguard
from attnguard.observability import advice, eventfiles, summary, workload
from attnguard.observability.advice import Facts
from attnguard.observability.reasons import REASONS

SDPA = 'attn_implementation="sdpa"'
FLASH_UNUSABLE = (
    "package_missing",
    "extension_broken",
    "no_cuda",
    "capability_too_low",
    "version_too_old",
    "probe_failed",
)
CPU = Facts(device="cpu", twin_calls=True)
H100 = Facts(device="cuda", capability=(9, 0), twin_calls=True)
V100 = Facts(device="cuda", capability=(7, 0), twin_calls=True)


@pytest.fixture(autouse=True)
def _fresh_facts() -> Any:
    workload.reset()
    yield
    workload.reset()


def _advice_now() -> dict[str, str]:
    """reason_code -> hint, as this process's exit summary would print it."""
    fields = summary.local_fields()
    rows = summary.advice(fields["keys"], Facts.of(fields["facts"]))
    return {row["reason_code"]: row["hint"] for row in rows}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for family in ("llama", "qwen2"):
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(family)
        tiny_model_class(family)(tiny_config(family)).save_pretrained(path)
        out[family] = path
    return out


def _load(path: Path, attn: str) -> Any:
    import transformers

    # float32 as saved: the default dtype of every release (its keyword differs across them)
    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn).eval()


LENGTHS = (5, 7, 4)


def _packed_row() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 128, (n,), generator=gen) for n in LENGTHS]
    row = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return row, positions, seqs


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_rows_keep_sdpa_out_of_the_advice(
    guard: Any, checkpoints: dict[str, Path], family: str
) -> None:
    """The issue's measurement, kept true: on a packed row the guarded flash path equals the
    sequences run one by one, and transformers' sdpa path (its default use_cache) mixes them;
    so the advice for this run never names sdpa."""
    row, positions, seqs = _packed_row()
    flash = _load(checkpoints[family], "flash_attention_2")
    with torch.no_grad():
        packed = flash(row, position_ids=positions).logits[0]
        alone = torch.cat([flash(s[None]).logits[0] for s in seqs])
    assert (packed - alone).abs().max().item() <= 1e-5
    hint = _advice_now()["package_missing"]
    assert "packed rows reached attnguard's twins" in hint
    assert SDPA not in hint
    assert "nothing to install on this machine" in hint  # no GPU here: nothing to install

    attnguard.deactivate()  # what the removed hint told the user to do
    sdpa = _load(checkpoints[family], "sdpa")
    with torch.no_grad():
        mixed = sdpa(row, position_ids=positions).logits[0]
    assert (mixed - alone).abs().max().item() > 0.1  # measured 0.59 (Llama), 0.51 (Qwen2)


def test_without_packed_rows_sdpa_is_advised_and_computes_the_same(
    guard: Any, checkpoints: dict[str, Path]
) -> None:
    """A padded batch and a plain row (no mask, positions 0..n-1: the flash path's first call
    in this activation, while its check of transformers' flash path runs): no packed rows, and
    sdpa computes what the twins computed, so the advice offers it, as the same numbers."""
    flash = _load(checkpoints["llama"], "flash_attention_2")
    plain = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        flash_plain = flash(plain).logits
        flash_padded = flash(**tiny_inputs("llama")).logits
    hint = _advice_now()["package_missing"]
    assert hint == (
        "flash-attn runs on CUDA GPUs only, so there is nothing to install on this machine: "
        'request attn_implementation="sdpa" (the same numbers: no packed rows or sliding windows '
        "reached attnguard's twins)"
    )
    sdpa = _load(checkpoints["llama"], "sdpa")
    with torch.no_grad():
        assert torch.allclose(sdpa(plain).logits, flash_plain, atol=1e-5)
        mask = tiny_inputs("llama")["attention_mask"].bool()
        got = sdpa(**tiny_inputs("llama")).logits
        assert torch.allclose(got[mask], flash_padded[mask], atol=1e-5)


def test_a_sliding_window_keeps_sdpa_out_of_the_advice(guard: Any, tmp_path: Path) -> None:
    import transformers

    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=3, max_window_layers=0)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(tmp_path)
    model = _load(tmp_path, "flash_attention_2")
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7, 8, 9, 10, 11]]))
    assert workload.seen(workload.SLIDING_WINDOW)
    hint = _advice_now()["package_missing"]
    assert "sliding windows reached attnguard's twins" in hint and SDPA not in hint


def test_a_load_without_calls_offers_sdpa_only_with_its_condition(
    guard: Any, checkpoints: dict[str, Path]
) -> None:
    _load(checkpoints["qwen2"], "flash_attention_2")
    hint = _advice_now()["package_missing"]
    assert f"{SDPA} if no batch packs several sequences into one row" in hint


# --- the advice as a function of the facts (what a GPU run would print) ------------------------


def test_flash_advice_by_machine_and_workload() -> None:
    """What the summary says for package_missing on a GPU that runs flash-attn, an old GPU and
    a CPU, with and without packed rows (the lead checks the GPU rows on a GPU)."""
    hint = REASONS["package_missing"].hint
    assert advice.render(hint, H100) == (
        "install flash-attn for this torch and GPU, or request "
        'attn_implementation="sdpa" (the same numbers: no packed rows or sliding windows reached '
        "attnguard's twins)"
    )
    assert advice.render(hint, Facts(device="cuda", capability=(9, 0), packed_rows=True)) == (
        "install flash-attn for this torch and GPU; not sdpa: packed rows reached attnguard's "
        "twins, which hold the sequences apart as flash-attn does, and transformers' sdpa path "
        "would mix them"
    )
    old = advice.render(hint, V100)
    assert old.startswith("flash-attn 2 runs on sm80 (Ampere) and newer GPUs, this one is sm70")
    assert "install flash-attn" not in old
    assert "install flash-attn" not in advice.render(hint, CPU)


FACT_GRID = [
    Facts(
        device=d,
        capability=c,
        packed_rows=p,
        sliding_window=w,
        twin_calls=t,
        packed_rows_apart=a,
        sdpa_refused=("Gemma2ForCausalLM",) if r else (),
    )
    for d, c in ((None, None), ("cpu", None), ("cuda", (7, 0)), ("cuda", (9, 0)))
    for p, w, t, a, r in itertools.product((False, True), repeat=5)
]


@pytest.mark.parametrize("code", sorted(REASONS))
def test_no_reason_advises_what_cannot_be_done_here_or_changes_numbers(code: str) -> None:
    """Every reason code (those added later too), for every combination of facts: on a
    machine without a GPU no hint says to install or run something on this GPU, and where packed
    rows that transformers' sdpa path would mix, sliding windows, or a model class that refuses
    sdpa none says to request sdpa."""
    for facts in FACT_GRID:
        hint = advice.render(REASONS[code].hint, facts)
        if facts.device == "cpu":
            assert "for this torch and GPU" not in hint, (code, facts, hint)
        if facts.packed_rows or facts.sliding_window or facts.sdpa_refused:
            assert f"request {SDPA}" not in hint, (code, facts, hint)


@pytest.mark.parametrize("code", FLASH_UNUSABLE)
def test_every_flash_reason_names_what_applies_on_a_cpu(code: str) -> None:
    said = advice.render(REASONS[code].hint, CPU)
    assert "nothing to install" in said and f"request {SDPA}" in said


def test_a_cpu_tensors_hint_on_a_machine_without_gpu_keeps_the_twin() -> None:
    hint = REASONS["cpu_tensors"].hint
    assert "pass it tensors on the GPU" not in advice.render(hint, CPU)
    assert advice.render(hint, H100) == "this kernel runs on CUDA only: pass it tensors on the GPU"


# --- facts travel with the summary: ranks and files --------------------------------------------


def test_a_job_summary_advises_from_every_ranks_facts() -> None:
    key = eventfiles.Key(
        "backend_fallback",
        "transformers.load",
        "package_missing",
        1,
        {"applied": 1, "would_have": 0, "observed": 0, "internal_errors": 0},
    )
    record = summary.RankRecord("aa" * 8, [key], {"device": "cuda", "capability": "9.0"})
    packed = summary.RankRecord("bb" * 8, [key], {"device": "cuda", "capability": "8.0"})
    packed.facts["packed_rows"] = True
    fields = summary.aggregate({0: record, 1: packed})
    assert fields["facts"] == {"device": "cuda", "capability": "8.0", "packed_rows": True}
    hint = summary.advice(fields["keys"], Facts.of(fields["facts"]))[0]["hint"]
    assert hint.startswith("install flash-attn for this torch and GPU; not sdpa")


def test_a_rank_record_carries_its_facts_checked() -> None:
    from attnguard.observability.gather import parse_record, record_of

    raw = record_of(1, "exit", "cd" * 8, [], {"device": "cpu", "packed_rows": True})
    assert parse_record(raw, 1)[0].facts == {"device": "cpu", "packed_rows": True}
    odd = record_of(1, "exit", "cd" * 8, [], {"device": "tpu", "packed_rows": "yes"})
    assert parse_record(odd, 1)[0].facts == {}


def test_the_summary_command_advises_from_the_files_facts(tmp_path: Path) -> None:
    line = {
        "schema": 1,
        "event": "summary",
        "site": "process",
        "reason_code": "exit",
        "count": 1,
        "rank": 0,
        "proc": "ab" * 8,
        "mode": "fix",
        "facts": {"device": "cpu", "twin_calls": True, "packed_rows": True},
        "keys": [
            {
                "event": "backend_fallback",
                "site": "transformers.load",
                "reason_code": "package_missing",
                "count": 1,
                "applied": 1,
            }
        ],
    }
    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps(line) + "\n")
    text = eventfiles.render_files([str(path)], as_json=False)
    assert "package_missing: flash-attn runs on CUDA GPUs only" in text
    assert "packed rows reached attnguard's twins" in text and SDPA not in text
