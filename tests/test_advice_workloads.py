"""The exit summary's advice for real workloads, each checked against what transformers' sdpa (or
eager) path computes for the same job, measured in the test:

* padding-free training (TRL's ``SFTTrainer(padding_free=True)``, and its collator's batches in a
  plain loop): packed rows reach the twins without a cache; where transformers' own mask code
  holds such rows apart (recognised by its shape), sdpa is advised and its losses are the twins';
  where it does not, flash is kept and sdpa's losses differ;
* a forward with a cache: packed rows that transformers' sdpa path mixes: flash is kept;
* model classes that refuse sdpa (PegasusX, Gemma2, and every such class of the installed
  transformers): sdpa is never advised; what is advised loads.
"""

from __future__ import annotations

import importlib.util
import inspect
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import tiny_config

import attnguard
from attnguard.integrations.transformers import twin_calls
from attnguard.observability import advice, summary, workload
from attnguard.observability.advice import Facts
from attnguard.observability.reasons import REASONS

SDPA = 'attn_implementation="sdpa"'
EAGER = 'attn_implementation="eager"'
LENGTHS = (5, 9, 7, 4, 11, 6, 8, 3)  # eight sequences: two padding-free batches of four
STEPS = 3


def _hint() -> str:
    """The advice of this process's one flash fallback row, as its exit summary prints it."""
    fields = summary.local_fields()
    rows = summary.advice(fields["keys"], Facts.of(fields["facts"]))
    (row,) = [r for r in rows if r["event"] == "backend_fallback"]
    return row["hint"]


def _masks_hold_packed_rows_apart() -> bool:
    """By the shape of transformers' mask code: it looks for packed sequences in position_ids
    (where no cache is in use) and its masks then hold them apart."""
    masks = importlib.import_module("transformers.masking_utils") if _has_masks() else None
    prepare = getattr(masks, "_preprocess_mask_arguments", None)
    return prepare is not None and "find_packed_sequence_indices" in prepare.__code__.co_names


def _has_masks() -> bool:
    return importlib.util.find_spec("transformers.masking_utils") is not None


@pytest.fixture(scope="module")
def llama(tiny_checkpoint: Any) -> Path:
    return tiny_checkpoint("llama")


def _load(path: Path, attn: str) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn)


def _sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 128, (n,), generator=gen).tolist() for n in LENGTHS]


def padding_free_batch(examples: list[list[int]]) -> dict[str, Any]:
    """What TRL's ``DataCollatorForLanguageModeling(padding_free=True)`` (TRL 1.16) makes of
    tokenized examples: one row, position_ids restarting at each sequence, no attention mask,
    labels -100 at each sequence's first token, the varlen boundaries; and ``use_cache=False``,
    which ``SFTTrainer.compute_loss`` adds."""
    ids = torch.cat([torch.tensor(e) for e in examples])[None]
    positions = torch.cat([torch.arange(len(e)) for e in examples])[None]
    labels = ids.clone()
    labels[positions == 0] = -100
    starts = (positions[0] == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([positions.size(1)])]).to(torch.int32)
    longest = int(cu.diff().max())
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": positions,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": longest,
        "max_length_k": longest,
        "use_cache": False,
    }


def _train_with_the_collator(path: Path, attn: str) -> list[float]:
    torch.manual_seed(0)
    model = _load(path, attn).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    examples = _sequences()
    losses = []
    for step in range(STEPS):
        batch = padding_free_batch(examples[4 * (step % 2) : 4 * (step % 2) + 4])
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _train_with_trl(path: Path, attn: str) -> list[float]:
    from datasets import Dataset
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 128)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
        pad_token="<pad>",
        eos_token="</s>",
        bos_token="<s>",
    )
    out = tempfile.mkdtemp(prefix="trl-")
    args = SFTConfig(
        output_dir=out,
        padding_free=True,
        max_length=None,  # TRL refuses padding_free without packing otherwise
        per_device_train_batch_size=4,
        max_steps=STEPS,
        logging_steps=1,
        report_to=[],
        learning_rate=1e-3,
        use_cpu=True,
        seed=0,
        save_strategy="no",
        bf16=False,  # float32 throughout: the losses compare exactly
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([{"input_ids": ids} for ids in _sequences()])
    model = _load(path, attn)
    trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("how", ["trl", "collator"])
def test_padding_free_training_gets_sdpa_only_where_sdpa_computes_its_losses(
    guard: Any, llama: Path, how: str
) -> None:
    """The job of the issue: padding-free training with flash_attention_2 where flash-attn cannot
    run. Without a cache, transformers' masks hold packed rows apart (where its mask code is
    shaped so): the advice names sdpa, and sdpa's losses are the twins'."""
    if how == "trl" and importlib.util.find_spec("trl") is None:
        pytest.skip("TRL is not installed here (the collator case runs its batches)")
    train = _train_with_trl if how == "trl" else _train_with_the_collator
    on_twins = train(llama, "flash_attention_2")
    hint = _hint()
    assert workload.seen(workload.PACKED_ROWS_APART) or workload.seen(workload.PACKED_ROWS)
    attnguard.deactivate()  # what the advice tells the user to do, or not to
    with_sdpa = train(llama, "sdpa")
    differs = max(abs(a - b) for a, b in zip(on_twins, with_sdpa, strict=True))
    if _masks_hold_packed_rows_apart():
        assert f"request {SDPA} (the same numbers: the packed rows" in hint, hint
        assert "came without a cache" in hint
        assert differs <= 1e-5, (on_twins, with_sdpa)  # measured: equal to 6 decimals
    else:  # transformers' sdpa path mixes packed rows on this release
        assert SDPA not in hint and "keep the flash attn_implementation" in hint, hint
        assert differs > 1e-3, (on_twins, with_sdpa)


def _packed_row() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    seqs = [torch.tensor(s) for s in _sequences()[:3]]
    row = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    return row, positions, seqs


def test_a_forward_with_a_cache_keeps_flash_and_sdpa_mixes_the_rows(
    guard: Any, llama: Path
) -> None:
    """A packed row with ``use_cache=True``: the twins hold the sequences apart (as flash-attn
    does, cache or not); transformers' sdpa path, with a cache, mixes them: flash is kept."""
    row, positions, seqs = _packed_row()
    flash = _load(llama, "flash_attention_2").eval()
    with torch.no_grad():
        packed = flash(row, position_ids=positions, use_cache=True).logits[0]
        alone = torch.cat([flash(s[None]).logits[0] for s in seqs])
    assert (packed - alone).abs().max().item() <= 1e-5
    hint = _hint()
    assert SDPA not in hint and "keep the flash attn_implementation under attnguard" in hint
    if _masks_hold_packed_rows_apart():
        assert "with a cache in use" in hint, hint
    assert workload.seen(workload.PACKED_ROWS) and not workload.seen(workload.PACKED_ROWS_APART)

    attnguard.deactivate()
    sdpa = _load(llama, "sdpa").eval()
    with torch.no_grad():
        cached = sdpa(row, position_ids=positions, use_cache=True).logits[0]
        uncached = sdpa(row, position_ids=positions, use_cache=False).logits[0]
    assert (cached - alone).abs().max().item() > 0.1  # measured 0.5: mixed
    if _masks_hold_packed_rows_apart():
        assert (uncached - alone).abs().max().item() <= 1e-5  # measured 2e-7: apart


def test_the_same_job_without_a_cache_then_with_one_keeps_flash(guard: Any, llama: Path) -> None:
    """One process, both forwards (a training step, then an evaluation with the cache): the
    advice is for the whole job, so the cache's forward keeps flash."""
    row, positions, _ = _packed_row()
    flash = _load(llama, "flash_attention_2").eval()
    with torch.no_grad():
        flash(row, position_ids=positions, use_cache=False)
        flash(row, position_ids=positions, use_cache=True)  # the same tensor object, reused
    assert workload.seen(workload.PACKED_ROWS)
    assert SDPA not in _hint()


# --- model classes that refuse sdpa ----------------------------------------------------------


def _supports_flash(cls: type) -> bool:
    for attr in ("_supports_flash_attn", "_supports_flash_attn_2"):
        if getattr(cls, attr, None) is not None:
            return bool(getattr(cls, attr))
    return True


def _pegasus_x() -> tuple[type, Any, dict[str, torch.Tensor]]:
    from transformers import PegasusXConfig, PegasusXForConditionalGeneration

    config = PegasusXConfig(
        vocab_size=128,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        block_size=8,
        num_global_tokens=2,
        pad_token_id=0,
        decoder_start_token_id=0,
    )
    ids = torch.randint(3, 128, (1, 16), generator=torch.Generator().manual_seed(2))
    return (
        PegasusXForConditionalGeneration,
        config,
        {"input_ids": ids, "decoder_input_ids": ids[:, :5]},
    )


def _gemma2() -> tuple[type, Any, dict[str, torch.Tensor]]:
    from transformers import Gemma2ForCausalLM

    config = tiny_config("gemma2", head_dim=16, sliding_window=4)
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    return Gemma2ForCausalLM, config, {"input_ids": ids}


@pytest.mark.parametrize("make", [_pegasus_x, _gemma2], ids=["pegasus_x", "gemma2"])
def test_a_model_that_refuses_sdpa_is_never_advised_it(
    guard: Any, tmp_path: Path, make: Any
) -> None:
    cls, config, inputs = make()
    if cls._supports_sdpa:
        pytest.skip(f"{cls.__name__} supports sdpa in this transformers release")
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    model = cls.from_pretrained(tmp_path, attn_implementation="flash_attention_2").eval()
    with torch.no_grad():
        on_twins = model(**inputs).logits
    hint = _hint()
    assert SDPA not in hint, hint
    attnguard.deactivate()
    with pytest.raises(ValueError, match="does not support"):
        cls.from_pretrained(tmp_path, attn_implementation="sdpa")  # what the old advice said
    eager = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        gap = (eager(**inputs).logits - on_twins).abs().max().item()
    if not _supports_flash(cls):  # flash requests for it are model_unsupported (4.x)
        assert "has no flash-attention support" in hint, hint
    elif cls.__name__.startswith("PegasusX"):
        # nothing reached the twins that keeps eager out: it is advised, loads and runs; its
        # numbers are not its flash path's (measured 0.005: transformers runs PegasusX's decoder
        # without causality on the flash path), and the advice does not claim they are
        assert f"{cls.__name__} does not support sdpa: request {EAGER}" in hint, hint
        assert "the same numbers" not in hint
        assert gap > 1e-4
    else:  # Gemma2's sliding windows reached the twins: flash is kept
        assert "sliding windows reached attnguard's twins" in hint, hint
        assert EAGER not in hint


def test_a_refusing_model_loaded_without_calls_is_offered_eager(guard: Any, tmp_path: Path) -> None:
    cls, config, _ = _pegasus_x()
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    cls.from_pretrained(tmp_path, attn_implementation="flash_attention_2")
    hint = _hint()
    assert SDPA not in hint, hint
    if not _supports_flash(cls):
        pytest.skip(f"{cls.__name__} has no flash support in this release (model_unsupported)")
    assert EAGER in hint, hint
    facts = summary.local_fields()["facts"]
    top = [m for m in facts["models"] if not m["part"]]
    assert top == [
        {"model": cls.__name__, "sdpa": False, "flash": True, "flex": True, "part": False}
    ]


def _zoo_classes() -> list[type]:
    """Every model class the installed transformers exports (each imports its model's module)."""
    import transformers
    from transformers import PreTrainedModel

    found = []
    for name in dir(transformers):
        if not (name.endswith("Model") or "For" in name):
            continue
        try:
            cls = getattr(transformers, name)
        except Exception:  # a model whose module needs a package this machine lacks
            continue
        if inspect.isclass(cls) and issubclass(cls, PreTrainedModel):
            found.append(cls)
    return found


GRID = [
    Facts(device=d, capability=c, twin_calls=t, packed_rows_apart=a)
    for d, c in ((None, None), ("cpu", None), ("cuda", (9, 0)), ("cuda", (7, 0)))
    for t in (False, True)
    for a in (False, True)
]


def test_no_class_of_the_zoo_that_refuses_sdpa_is_advised_sdpa() -> None:
    """Over every model class of the installed transformers: each one whose class refuses sdpa
    (as transformers reads it at load), recorded as the gate records it, gets no advice naming
    sdpa, whatever else happened, from any reason code."""
    refusing = [cls for cls in _zoo_classes() if not getattr(cls, "_supports_sdpa", True)]
    assert len(refusing) >= 10  # PegasusX, Gemma2, VaultGemma, GPT-OSS, ... on 5.24
    assert any(cls.__name__ == "PegasusXForConditionalGeneration" for cls in refusing)
    for cls in refusing:
        workload.reset()
        twin_calls.note_model(cls)
        recorded = Facts.of(workload.snapshot())
        assert recorded.sdpa_refused == (cls.__name__,)
        for facts in GRID:
            facts = replace(facts, sdpa_refused=recorded.sdpa_refused)
            for code, reason in REASONS.items():
                hint = advice.render(reason.hint, facts)
                assert SDPA not in hint, (cls.__name__, code, facts, hint)
