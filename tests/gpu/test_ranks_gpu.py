"""Do no harm on two GPUs with the real flash-attn kernel: verl's actor (FSDP1 and FSDP2), a
plain FSDP2 job and DDP, each run by torchrun x2 with and without ATTNGUARD=1.

The workers are the CPU tests' (tests/workers/ranks_worker.py); on a CUDA machine each rank uses
cuda:LOCAL_RANK and nccl. What must hold: no hang (the timeout fails the test), the same losses,
float32 weights and optimizer state where the program chose float32, and every rank reporting the
same decisions. Needs the real flash-attn in $TEST_REAL_FLASH_ATTN_DIR (scripts/gpu_suite.sh
unpacks the wheel there; this module puts it on the workers' PYTHONPATH) and attnguard's start-up
hook installed (ATTNGUARD=1 must reach torchrun's workers). Skipped with the reason otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.ranks import FLASH, assert_ranks_agree, decisions, launch

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

if torch.cuda.device_count() < 2:
    pytest.skip("needs two or more CUDA GPUs", allow_module_level=True)

import gpuenv  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def real_flash_for_the_workers() -> Iterator[None]:
    with gpuenv.workers_with_real_flash():
        yield


def assert_same_changes(out: Path) -> dict[int, list[tuple[str, str, Any]]]:
    """Every rank made the same changes (events other than ``observed``), none a dtype change.
    What each rank *observed* may differ where the ranks build differently on purpose (verl: rank
    0 under ``torch.device("cpu")`` with an explicit dtype, the others on meta): each says what it
    saw. Returns each rank's observations."""
    said = {r: decisions(out, r) for r in (0, 1)}
    changes = {r: [d for d in said[r] if d[0] != "observed"] for r in (0, 1)}
    assert changes[0] == changes[1], said
    assert not [d for d in changes[0] if d[0] == "model_cast"], said
    return {r: [d for d in said[r] if d[0] == "observed"] for r in (0, 1)}


def both(mode: str, tiny_checkpoint: Any, tmp_path: Path, plain_args: tuple = ()):
    path = tiny_checkpoint("llama", "float32")
    plain = launch(mode, path, FLASH, tmp_path / "plain", guarded=False, extra=plain_args)
    guarded = launch(mode, path, FLASH, tmp_path / "guarded", guarded=True)
    return plain, guarded, tmp_path / "guarded"


@pytest.mark.parametrize("mode", ["verl_fsdp1", "verl_fsdp2"])
def test_verl_actor_trains_bit_for_bit_as_without_the_guard(
    mode: str, tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """Rank 0 under torch.device("cpu"), rank 1 on meta, dtype=float32 on purpose: the guard
    changes nothing at load on any rank (each rank observes, and says why), flash gets bf16 from
    the wrapper's mixed precision, so the very same kernels run: the losses are bit-equal."""
    plain, guarded, out = both(mode, tiny_checkpoint, tmp_path)
    for rank in (0, 1):
        assert guarded[rank]["losses"] == plain[rank]["losses"]
        assert guarded[rank]["loaded_dtypes"] == ["float32"]
        assert guarded[rank]["param_dtypes"] == ["float32"]
        assert guarded[rank]["optimizer_state_dtypes"] == ["float32"]
        assert guarded[rank]["param_devices"] == [f"cuda:{rank}"]
    observed = assert_same_changes(out)
    assert not [d for r in (0, 1) for d in decisions(out, r) if d[0] != "observed"], observed
    assert observed[0] and observed[1]  # each rank looked, and said why it left things alone


def test_ddp_lands_on_each_ranks_gpu(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """Each rank loads in bf16 with flash and no device_map and wraps in DDP without moving the
    model (family A): guarded, the model was loaded onto cuda:LOCAL_RANK; the losses
    equal the hand-fixed run (``model.to(local_rank)`` before DDP, what users wrote)."""
    plain, guarded, out = both("ddp", tiny_checkpoint, tmp_path, plain_args=("hand_fix",))
    for rank in (0, 1):
        assert guarded[rank]["devices_at_wrap"] == [f"cuda:{rank}"]
        assert guarded[rank]["losses"] == plain[rank]["losses"]  # the same kernels, bit-equal
    placed = [d for d in decisions(out, 0) if d[0] == "model_placed"]
    assert placed == [("model_placed", "flash_needs_gpu", True)]
    assert [d for d in decisions(out, 1) if d[0] == "model_placed"] == placed


def test_fsdp2_with_an_fp32_load(tiny_checkpoint: Any, tmp_path: Path) -> None:
    """Every rank loads the float32 checkpoint with nothing chosen (5.x: "auto"), then FSDP2
    with bf16 mixed precision. Several ranks: the dtype is never changed at load (observed; the
    call-time guard carries flash), each rank's replica is loaded onto its GPU."""
    plain, guarded, out = both("fsdp2", tiny_checkpoint, tmp_path)
    for rank in (0, 1):
        assert guarded[rank]["loaded_dtypes"] == ["float32"]
        assert guarded[rank]["param_dtypes"] == plain[rank]["param_dtypes"] == ["float32"]
        assert guarded[rank]["optimizer_state_dtypes"] == ["float32"]
        assert guarded[rank]["losses"] == pytest.approx(plain[rank]["losses"], rel=2e-2)
        said = decisions(out, rank)
        assert ("observed", "multi_rank", None) in said
        assert ("model_placed", "flash_needs_gpu", True) in said
    assert_ranks_agree(out)
