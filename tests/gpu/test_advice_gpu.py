"""The exit summary's advice and doctor's verdict on a GPU: what they say where flash-attn could
be installed (sm80 or newer), with and without packed rows reaching attnguard's twins, and who
serves flash_attention_2 with the real flash-attn on the path and without it.

Children of this checkout (tests/gpu/gpuenv.py): "absent" has no flash-attn on its path, so a
flash_attention_2 load keeps transformers' flash path on the twins (on this GPU); its exit
summary, written to a file, carries the facts it advised from.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gpuenv  # noqa: E402

_SCRIPT = r"""
import sys, tempfile
import attnguard  # activated from the environment (ATTNGUARD_LOG: the summary's file)
import torch, transformers

config = transformers.LlamaConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
)

packed = sys.argv[1] == "packed"
with tempfile.TemporaryDirectory() as path:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="flash_attention_2", dtype=torch.bfloat16, device_map="cuda"
    )
    lengths = (5, 7, 4) if packed else (16,)
    ids = torch.randint(3, 128, (1, sum(lengths)), device="cuda")
    positions = torch.cat([torch.arange(n) for n in lengths])[None].cuda()
    with torch.no_grad():
        model(ids, position_ids=positions)
"""


def _summary(tmp_path: Path, workload: str) -> dict:
    log = tmp_path / f"{workload}.jsonl"
    env = gpuenv.child_env(real=False, ATTNGUARD_LOG=str(log), CUDA_VISIBLE_DEVICES="0")
    res = subprocess.run(
        [gpuenv.PY, "-c", _SCRIPT, workload], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-4000:]
    (summary,) = [
        e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "summary"
    ]
    return summary


@pytest.mark.parametrize("workload", ["plain", "packed"])
def test_the_advice_on_this_gpu(tmp_path: Path, workload: str) -> None:
    major, minor = torch.cuda.get_device_capability(0)
    summary = _summary(tmp_path, workload)
    assert summary["facts"]["device"] == "cuda"
    assert summary["facts"]["capability"] == f"{major}.{minor}"
    assert summary["facts"].get("packed_rows", False) == (workload == "packed")
    hints = {a["reason_code"]: a["hint"] for a in summary["advice"]}
    hint = hints["package_missing"]
    if (major, minor) < (8, 0):
        assert "install flash-attn" not in hint, hint
    elif workload == "packed":
        assert hint.startswith("install flash-attn for this torch and GPU; not sdpa: packed rows")
    else:
        assert hint.startswith(
            'install flash-attn for this torch and GPU, or request attn_implementation="sdpa" '
            "(the same numbers"
        )


@pytest.mark.parametrize("real", [True, False], ids=["real-flash-attn", "absent"])
def test_doctor_verdict_on_this_gpu(real: bool) -> None:
    if real and gpuenv.configured() is None:
        pytest.skip(f"{gpuenv.ENV} is not set: the real flash-attn is needed")
    env = gpuenv.child_env(real=real, CUDA_VISIBLE_DEVICES="0")
    res = subprocess.run(
        [gpuenv.PY, "-m", "attnguard", "doctor"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    first = res.stdout.splitlines()[0]
    if real:
        assert first.startswith(
            "flash_attention_2 requests on this machine: served by flash-attn 2.8.3"
        ), first
    else:
        assert first == (
            "flash_attention_2 requests on this machine: served by attnguard's twins on "
            "transformers' flash code path (flash-attn is not installed)"
        ), first
