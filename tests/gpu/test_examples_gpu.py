"""The GPU halves of the examples: families A and E on one GPU, family C under torchrun x2, each
with the REAL flash-attn and with flash-attn absent.

* real: $TEST_REAL_FLASH_ATTN_DIR (the unpacked real flash-attn 2.8.3 wheel; scripts/gpu_suite.sh
  sets it) on the example's PYTHONPATH, as an installed package would be; skipped with the
  reason when it is unset or ``import flash_attn_2_cuda`` fails there. attnguard places (A),
  casts and places (E), or gives each rank its own replica (C); the flash kernel runs.
* absent: no flash-attn on the example's path. attnguard keeps transformers' flash code path on
  its SDPA twins (``backend_fallback``, reason ``package_missing``) and still gives the model what
  flash would have had: the GPU (A, E), bf16 (E), one replica per rank (C).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.processes import PY

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gpuenv  # noqa: E402
from helpers.examples import EXAMPLES, run_example  # noqa: E402

FLASH_CASES = ["real", "absent"]


@pytest.fixture
def flash_on_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """PYTHONPATH of the examples' children: the real flash-attn first, or none at all
    (run_example and the torchrun launch build the child's path from this process's)."""
    real = request.param == "real"
    if real:
        gpuenv.require()
    monkeypatch.setenv("PYTHONPATH", gpuenv.child_env(real=real)["PYTHONPATH"])
    return request.param


def _fallbacks(caused: list[dict]) -> list[dict]:
    return [e for e in caused if e["event"] == "backend_fallback"]


@pytest.mark.parametrize("flash_on_path", FLASH_CASES, indirect=True)
def test_family_a_loads_the_flash_model_straight_onto_the_gpu(flash_on_path: str) -> None:
    run = run_example("family_a_flash_not_on_gpu.py")
    assert run.events is not None and "model_placed" in run.events
    placed = next(e for e in run.caused() if e["event"] == "model_placed")
    assert placed["device"] == "cuda:0" and placed["reason_code"] == "flash_needs_gpu"
    assert "on cuda:0, torch.bfloat16, attention 'flash_attention_2'" in run.stdout
    assert "without attnguard: " in run.stdout and "ran without an error" not in run.stdout
    if flash_on_path == "real":
        assert "backend_fallback" not in run.events  # the real kernel runs
        assert "transformers' flash code path on the flash-attn kernel" in run.stdout
    else:
        (fallback,) = _fallbacks(run.caused())
        assert fallback["reason_code"] == "package_missing"
        assert fallback["rule"] == "flash-on-sdpa" and fallback["selected"] == "sdpa_twin"


@pytest.mark.parametrize("flash_on_path", FLASH_CASES, indirect=True)
def test_family_e_casts_the_fp32_model_to_bf16_and_places_it(flash_on_path: str) -> None:
    run = run_example("family_e_fp32_flash.py")
    assert run.events is not None
    assert "model_cast" in run.events and "model_placed" in run.events
    cast = next(e for e in run.caused() if e["event"] == "model_cast")
    assert cast["dtype_from"] == "float32" and cast["dtype_to"] == "bfloat16"
    assert "on cuda:0, torch.bfloat16, attention 'flash_attention_2'; first forward ran" in (
        run.stdout
    )
    # unguarded: the real kernel refuses the fp32 model on the CPU; without flash-attn
    # transformers refuses to load it
    assert "without attnguard: " in run.stdout and "ran without an error" not in run.stdout
    if flash_on_path == "real":
        assert "backend_fallback" not in run.events
        assert "transformers' flash code path on the flash-attn kernel" in run.stdout
    else:
        (fallback,) = _fallbacks(run.caused())
        assert fallback["reason_code"] == "package_missing"
        assert "its kernel calls computed by attnguard's SDPA twins" in run.stdout


@pytest.mark.multigpu
@pytest.mark.parametrize("flash_on_path", FLASH_CASES, indirect=True)
def test_family_c_under_torchrun_each_rank_loads_its_own_replica(
    flash_on_path: str, tmp_path: Path
) -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two or more CUDA GPUs")
    env = gpuenv.child_env(
        real=flash_on_path == "real",
        HF_HUB_OFFLINE="1",
        ATTNGUARD_LOG=str(tmp_path / "events-{rank}.jsonl"),
        ATTNGUARD_LOG_FORMAT="json",  # the examples default to console lines
    )
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = subprocess.run(
        [*cmd, str(EXAMPLES / "family_c_torchrun_device_map.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    for rank in (0, 1):
        said = f"rank {rank} of 2: model on ['cuda:{rank}'], attention 'flash_attention_2'"
        assert said in res.stdout, res.stdout[-3000:]
        lines = (tmp_path / f"events-{rank}.jsonl").read_text().splitlines()
        caused = [json.loads(line) for line in lines if line.strip()]
        rewritten = [e for e in caused if e["event"] == "device_map_rewritten"]
        assert len(rewritten) == 1, lines
        assert rewritten[0]["after"]["device_map"] == {"": f"cuda:{rank}"}
        # the words README's "What you see" quotes (from the CPU run's plan)
        said = f"this rank loads it on cuda:{rank}; attnguard: load with device_map="
        assert rewritten[0]["reason"].endswith(said + repr({"": f"cuda:{rank}"}))
        fallbacks = _fallbacks(caused)
        if flash_on_path == "real":
            assert fallbacks == []
        else:
            assert [e["reason_code"] for e in fallbacks] == ["package_missing"], fallbacks
