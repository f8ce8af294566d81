"""Training stacks where one GPU is lent, with the real flash-attn kernel: a single-GPU HF Trainer
script (last test), and verl's actor with two ranks on one GPU, the two-rank pattern that
once hung under the guard (rank 0 builds the float32 model on the CPU, rank 1 on meta), run where
only one GPU is lent.

torchrun x2 with ``RANKS_SHARE_GPU=1``: both ranks on cuda:0, gloo (nccl refuses ranks that share
a GPU), the CPU tests' worker (tests/workers/ranks_worker.py). FSDP1 with
``sync_module_states=True`` needs its parameters on a GPU, so this is where it can run with two
ranks without a second GPU. What must hold, as on two GPUs (tests/gpu/test_ranks_gpu.py): no hang
(the timeout fails the test), bit-equal losses guarded vs unguarded, float32 weights and optimizer
state, every rank making the same changes (none at load: each observes). Needs the real
flash-attn in $TEST_REAL_FLASH_ATTN_DIR and attnguard's start-up hook installed
(scripts/gpu_suite.sh does both).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.ranks import FLASH, decisions, launch

pytestmark = [pytest.mark.gpu]

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gpuenv  # noqa: E402

SHARE = {"RANKS_SHARE_GPU": "1"}


@pytest.fixture(scope="module", autouse=True)
def real_flash_for_the_workers() -> Iterator[None]:
    with gpuenv.workers_with_real_flash():
        yield


@pytest.mark.parametrize("mode", ["verl_fsdp1", "verl_fsdp2"])
def test_verl_actor_two_ranks_one_gpu_trains_bit_for_bit_as_without_the_guard(
    mode: str, tiny_checkpoint: Any, tmp_path: Path
) -> None:
    path = tiny_checkpoint("llama", "float32")
    plain = launch(mode, path, FLASH, tmp_path / "plain", False, env_extra=SHARE)
    guarded = launch(mode, path, FLASH, tmp_path / "guarded", True, env_extra=SHARE)
    for rank in (0, 1):
        assert guarded[rank]["losses"] == plain[rank]["losses"]
        assert guarded[rank]["loaded_dtypes"] == ["float32"]  # the explicit dtype stands
        assert guarded[rank]["param_dtypes"] == ["float32"]
        assert guarded[rank]["optimizer_state_dtypes"] == ["float32"]
        assert guarded[rank]["param_devices"] == ["cuda:0"]
        assert guarded[rank]["attn_implementation"] == FLASH
    assert guarded[0]["loaded_devices"] == ["cpu"] and guarded[1]["loaded_devices"] == ["meta"]
    said = {r: decisions(tmp_path / "guarded", r) for r in (0, 1)}
    changes = {r: [d for d in said[r] if d[0] != "observed"] for r in (0, 1)}
    assert changes[0] == changes[1] == [], said  # nothing changed on any rank
    assert said[0] and said[1]  # each rank looked, and said why it left things alone


def test_single_gpu_trainer_bf16_keeps_the_fp32_master_weights(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """A fine-tuning script on one GPU: Trainer imported, a float32 checkpoint loaded with flash
    and no dtype, ``TrainingArguments(bf16=True)``. Unguarded it trains float32 master weights
    under bf16 autocast (flash gets bf16 inputs). Guarded the same: no cast at load (one
    ``observed`` event, ``training_script``), the model placed on the GPU, bit-equal losses."""
    path = tiny_checkpoint("llama", "float32")
    plain = launch("trainer", path, FLASH, tmp_path / "plain", False, nproc=1)
    guarded = launch("trainer", path, FLASH, tmp_path / "guarded", True, nproc=1)
    assert guarded[0]["losses"] == plain[0]["losses"]
    assert guarded[0]["loaded_dtypes"] == plain[0]["loaded_dtypes"] == ["float32"]
    assert guarded[0]["param_dtypes"] == ["float32"]
    assert guarded[0]["param_devices"] == plain[0]["param_devices"] == ["cuda:0"]
    said = decisions(tmp_path / "guarded", 0)
    assert ("observed", "training_script", None) in said, said
    assert not [d for d in said if d[0] == "model_cast"], said
