"""verl's FSDP2 actor on packed rows (use_remove_padding) with flash-attn broken: the rescued job
trains like the job with the real kernel.

torchrun x2: one rank per GPU on a 2-GPU machine (nccl); on one GPU both ranks share it
(``RANKS_SHARE_GPU=1``: cuda:0 and gloo, so FSDP2's collectives go through the host and the step
times say less). Three runs of the same program (tests/workers/ranks_worker.py
``verl_fsdp2 ... packed``):

* unguarded, the real flash-attn 2.8.3: the reference;
* guarded, the real flash-attn: nothing to remedy, bit-equal losses;
* guarded, flash-attn broken (its CUDA extension fails to import, as after a torch upgrade): the
  twins compute transformers' flash path; the losses equal the reference within bf16 rounding,
  and the step-time ratio is reported (results/packed_ranks.json).

Needs the real flash-attn in $TEST_REAL_FLASH_ATTN_DIR and attnguard's start-up hook installed
(scripts/gpu_suite.sh does both).
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.ranks import FLASH, decisions, launch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

# one rank per GPU where two are visible (the suite's multigpu part), else two ranks on one
pytestmark = [pytest.mark.gpu] + ([pytest.mark.multigpu] if torch.cuda.device_count() >= 2 else [])

import gpuenv  # noqa: E402

NPROC = 2
SHARE = {"RANKS_SHARE_GPU": "1"} if torch.cuda.device_count() < 2 else {}
BROKEN = (
    "raise ImportError('flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so: undefined symbol: "
    "_ZN3c104cuda9SetDeviceEi (a build for another torch)')\n"
)


@pytest.fixture(scope="module", autouse=True)
def real_flash_for_the_workers() -> Iterator[None]:
    with gpuenv.workers_with_real_flash():
        yield


def test_packed_rows_with_flash_attn_broken_train_like_the_real_kernel(
    tiny_checkpoint: Any, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tiny_checkpoint("llama", "float32")
    args = ("verl_fsdp2", path, FLASH)
    real = launch(*args, tmp_path / "real", False, ("packed",), nproc=NPROC, env_extra=SHARE)
    guarded = launch(*args, tmp_path / "guarded", True, ("packed",), nproc=NPROC, env_extra=SHARE)
    broken_dir = tmp_path / "broken_ext"
    broken_dir.mkdir()
    (broken_dir / "flash_attn_2_cuda.py").write_text(BROKEN)
    env = {"PYTHONPATH": f"{broken_dir}{os.pathsep}{os.environ['PYTHONPATH']}", **SHARE}
    broken = launch(*args, tmp_path / "broken", True, ("packed",), nproc=NPROC, env_extra=env)
    report: dict[str, Any] = {
        "nproc": NPROC,
        "ranks_share_one_gpu": bool(SHARE),
        "gpu": torch.cuda.get_device_name(0),
    }
    for rank in range(NPROC):
        want = real[rank]["losses"]
        assert guarded[rank]["losses"] == want  # the same kernel: bit-equal
        got = broken[rank]["losses"]
        err = max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))
        assert err < 1e-2, (got, want)
        assert broken[rank]["param_dtypes"] == ["float32"]
        report[f"rank{rank}"] = {
            "losses_real": want,
            "losses_broken": got,
            "max_rel_loss_diff": err,
            # the first step includes warm-up; later steps compare
            "step_s_real": statistics.median(real[rank]["step_s"][1:]),
            "step_s_broken": statistics.median(broken[rank]["step_s"][1:]),
        }
    said = [d for d in decisions(tmp_path / "broken", 0) if d[0] == "backend_fallback"]
    assert said and said[0][1] == "extension_broken", decisions(tmp_path / "broken", 0)
    out = gpuenv.results_dir(tmp_path_factory, "packed_ranks")
    (out / "packed_ranks.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))
