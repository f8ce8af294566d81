"""Do no harm on real training stacks: ranks of one job reach the same decisions, an explicit
dtype stands, and sharding / replicating wrappers train exactly as without the guard.

Each case runs the user's program twice under ``torchrun --nproc-per-node=2`` (gloo, CPU): once
without attnguard and ``attn_implementation="sdpa"`` (flash attention cannot run on this machine,
so that is what the user would have had to write), once with ``ATTNGUARD=1`` (the start-up hook)
and ``attn_implementation="flash_attention_2"``, as the stack really asks. The guarded job must
finish (a hang fails the test by its timeout), report the same losses, keep the dtypes the
program chose, and every rank must report the same decisions. The worker is
tests/workers/ranks_worker.py. The two-GPU versions of these runs are in tests/gpu.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from helpers.ranks import DEEPSPEED_DIR, FLASH, assert_ranks_agree, launch


def run_both(mode: str, tiny_checkpoint: Any, tmp_path: Path, dtype: str = "float32"):
    path = tiny_checkpoint("llama", dtype)
    plain = launch(mode, path, "sdpa", tmp_path / "plain", guarded=False)
    guarded = launch(mode, path, FLASH, tmp_path / "guarded", guarded=True)
    return plain, guarded, tmp_path / "guarded"


def assert_same_training(plain: dict, guarded: dict) -> None:
    for rank in (0, 1):
        # the same math on the same weights: flash's code path on the SDPA twins computes what
        # transformers' sdpa path computes for an unpadded batch; only summation order may differ
        assert guarded[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=1e-4)
    assert guarded[0]["losses"] == guarded[1]["losses"]  # the ranks hold the same model


def test_verl_actor_fsdp2_trains_as_without_the_guard(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """verl's actor: rank 0 on the CPU, rank 1 on meta, explicit float32, FSDP2 with bf16 mixed
    precision, rank 0's weights broadcast. Unguarded with flash requested it would not load here;
    guarded it trains like the sdpa run, the weights and AdamW state stay float32."""
    plain, guarded, out = run_both("verl_fsdp2", tiny_checkpoint, tmp_path)
    assert_same_training(plain, guarded)
    for rank in (0, 1):
        assert guarded[rank]["loaded_dtypes"] == ["float32"]  # the explicit dtype stands
        assert guarded[rank]["param_dtypes"] == ["float32"]
        assert guarded[rank]["optimizer_state_dtypes"] == ["float32"]
        assert guarded[rank]["attn_implementation"] == FLASH  # flash's code path is kept
    assert guarded[0]["loaded_devices"] == ["cpu"] and guarded[1]["loaded_devices"] == ["meta"]
    said = assert_ranks_agree(out)
    assert ("backend_fallback", "package_missing", True) in said or (
        "backend_fallback",
        "no_cuda",
        True,
    ) in said


def test_fsdp2_with_nothing_chosen_trains_as_without_the_guard(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    plain, guarded, out = run_both("fsdp2", tiny_checkpoint, tmp_path)
    assert_same_training(plain, guarded)
    for rank in (0, 1):
        assert guarded[rank]["param_dtypes"] == plain[rank]["param_dtypes"] == ["float32"]
        assert guarded[rank]["optimizer_state_dtypes"] == ["float32"]
    assert_ranks_agree(out)


def test_ddp_trains_as_without_the_guard(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """A replicating wrapper: on a GPU machine each rank's model is placed on cuda:LOCAL_RANK
    (tests/gpu); here there is no GPU, so nothing is placed and DDP runs on the CPU."""
    plain, guarded, out = run_both("ddp", tiny_checkpoint, tmp_path)
    assert_same_training(plain, guarded)
    assert_ranks_agree(out)


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(DEEPSPEED_DIR, "deepspeed")),
    reason="TEST_DEEPSPEED_DIR holds no deepspeed (scripts/test.sh installs it there)",
)
def test_deepspeed_zero3_trains_as_without_the_guard(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """The real DeepSpeed package, ZeRO-3 through HfDeepSpeedConfig: the parameters are
    partitioned by DeepSpeed with the guard on, and training matches the unguarded run."""
    plain, guarded, out = run_both("zero3", tiny_checkpoint, tmp_path)
    assert guarded[0]["partitioned"] and guarded[1]["partitioned"]
    assert_same_training(plain, guarded)
    said = assert_ranks_agree(out)
    assert all(d[0] in ("backend_fallback", "observed") for d in said)


def test_verl_fsdp2_on_packed_rows_trains_as_without_the_guard(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """verl's actor with use_remove_padding: one packed row per step (position_ids restarting).
    Guarded, flash_attention_2 runs on the twins' packed-row route; unguarded, the user's
    attn_implementation="sdpa" (without a cache, which holds packed rows apart on 4.53+): the
    same losses within bf16 rounding, the same decisions on both ranks, fp32 master weights."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("4.53"):
        pytest.skip("transformers < 4.53: its sdpa path attends across packed rows (no reference)")
    path = tiny_checkpoint("llama", "float32")
    plain = launch("verl_fsdp2", path, "sdpa", tmp_path / "plain", False, ("packed",))
    guarded = launch("verl_fsdp2", path, FLASH, tmp_path / "guarded", True, ("packed",))
    for rank in (0, 1):
        got, want = guarded[rank]["losses"], plain[rank]["losses"]
        assert max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True)) < 1e-2, (got, want)
        assert guarded[rank]["param_dtypes"] == ["float32"]
    assert_ranks_agree(tmp_path / "guarded")


def test_hf_trainer_trains_as_without_the_guard(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """A fine-tuning script: ``from_pretrained(attn_implementation=...)`` and the HF Trainer,
    which wraps the model in DDP itself (accelerate, gloo). Guarded with flash requested it
    trains like the sdpa run; the dtype nobody chose is not changed with ranks."""
    plain, guarded, out = run_both("trainer", tiny_checkpoint, tmp_path)
    assert_same_training(plain, guarded)
    for rank in (0, 1):
        assert guarded[rank]["loaded_dtypes"] == plain[rank]["loaded_dtypes"] == ["float32"]
        assert guarded[rank]["param_dtypes"] == ["float32"]
        assert guarded[rank]["attn_implementation"] == FLASH
        assert len(guarded[rank]["losses"]) == 3
    assert_ranks_agree(out)


def test_hf_trainer_padding_free_trains_as_without_the_guard(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """The Trainer with DataCollatorWithFlattening (padding-free, as TRL's padding_free): every
    batch one packed row, position_ids restarting. Guarded, flash's packed-row path on the twins;
    unguarded, the user's sdpa without a cache (which holds packed rows apart on 4.53+): the same
    losses, ranks agree."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version("4.53"):
        pytest.skip("transformers < 4.53: its sdpa path attends across packed rows (no reference)")
    path = tiny_checkpoint("llama", "float32")
    plain = launch("trainer", path, "sdpa", tmp_path / "plain", False, ("packed",))
    guarded = launch("trainer", path, FLASH, tmp_path / "guarded", True, ("packed",))
    assert_same_training(plain, guarded)
    assert_ranks_agree(tmp_path / "guarded")


@pytest.mark.skipif(
    not os.path.isdir(os.path.join(DEEPSPEED_DIR, "deepspeed")),
    reason="TEST_DEEPSPEED_DIR holds no deepspeed (scripts/test.sh installs it there)",
)
def test_hf_trainer_with_deepspeed_zero3_trains_as_without_the_guard(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """The HF Trainer with ``TrainingArguments(deepspeed=<ZeRO-3>)`` made before the load, as the
    docs tell users: transformers partitions the model at load (guarded too, nothing cast or
    moved), DeepSpeed trains it, and the losses match the unguarded run."""
    plain, guarded, out = run_both("trainer_zero3", tiny_checkpoint, tmp_path)
    for rank in (0, 1):
        assert guarded[rank]["partitioned"] and plain[rank]["partitioned"]
        assert guarded[rank]["param_dtypes"] == plain[rank]["param_dtypes"]
    assert_same_training(plain, guarded)
    said = assert_ranks_agree(out)
    assert all(d[0] in ("backend_fallback", "observed") for d in said)
