"""The GPU halves of the examples: families A and E on one GPU, family C under torchrun x2.

flash-attn cannot be had on the GPU image, so A and E run with the flash-attn **stand-in** of
``tests/standins`` on PYTHONPATH (flash-attn 2.8.3's API and contract: CUDA only, fp16/bf16 only;
its dist-info makes transformers see it installed), as an installed package would be. Family C
needs no flash kernel: flash-attn is absent there, so its load also falls back to SDPA.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import PY, STANDINS, subprocess_env
from test_examples import EXAMPLES, run_example

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)


def test_family_a_loads_the_flash_model_straight_onto_the_gpu() -> None:
    run = run_example("family_a_flash_not_on_gpu.py", STANDINS)  # stand-in flash-attn
    assert run.events is not None and "model_placed" in run.events
    assert "backend_fallback" not in run.events
    placed = next(e for e in run.caused() if e["event"] == "model_placed")
    assert placed["device"] == "cuda:0" and placed["reason_code"] == "flash_needs_gpu"
    assert "on cuda:0, torch.bfloat16, attention 'flash_attention_2'" in run.stdout


def test_family_e_casts_the_fp32_model_to_bf16_and_places_it() -> None:
    run = run_example("family_e_fp32_flash.py", STANDINS)  # stand-in flash-attn
    assert run.events is not None
    assert "model_cast" in run.events and "model_placed" in run.events
    cast = next(e for e in run.caused() if e["event"] == "model_cast")
    assert cast["dtype_from"] == "float32" and cast["dtype_to"] == "bfloat16"
    assert "on cuda:0, torch.bfloat16, attention 'flash_attention_2'; first forward ran" in (
        run.stdout
    )


@pytest.mark.multigpu
def test_family_c_under_torchrun_each_rank_loads_its_own_replica(tmp_path: Path) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two or more CUDA GPUs")
    env = subprocess_env(
        HF_HUB_OFFLINE="1",
        ATTNGUARD_LOG=str(tmp_path / "events-{rank}.jsonl"),
        ATTNGUARD_LOG_FORMAT="json",  # the examples default to console lines
    )
    cmd = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2"]
    res = subprocess.run(
        [*cmd, str(EXAMPLES / "family_c_torchrun_device_map.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2: model on ['cuda:{rank}']" in res.stdout
        lines = (tmp_path / f"events-{rank}.jsonl").read_text().splitlines()
        rewritten = [e for e in map(json.loads, lines) if e["event"] == "device_map_rewritten"]
        assert len(rewritten) == 1, lines
        assert rewritten[0]["after"]["device_map"] == {"": f"cuda:{rank}"}
