"""Flash attention from the Hugging Face kernel hub on the GPU (the GPU half of
tests/test_hub_kernels.py), each case a pair of fresh programs (tests/workers/hub_worker.py,
``--device cuda``, bf16), unguarded and guarded:

* GPT-OSS with the real flash-attn installed and no ``kernels`` package: transformers routes its
  flash request to ``kernels-community/vllm-flash-attn3`` (flash attention with sinks), which
  cannot load, so the unguarded load fails; guarded, the twins compute that kernel's functions,
  sinks included: its logits' error against the float32 eager model is of the size of the bf16
  eager model's own;
* a stand-in hub kernel with a CUDA build (tests/standins/hub_kernel.py, through
  ``LOCAL_KERNELS``, the real ``kernels`` package from $TEST_KERNELS_DIR): it keeps serving under
  the guard, the same calls and bit-equal logits, no event.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from gpuenv import PY, WORKERS, child_env, require, results_dir
from helpers.packages import hub_standin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORKER = WORKERS / "hub_worker.py"
KERNELS = os.environ.get("TEST_KERNELS_DIR")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hub_gpu")
    res = subprocess.run(
        [PY, str(WORKER), "make", str(path)],
        env=child_env(real=False, TQDM_DISABLE="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return path


def _run(mode: str, root: Path, env: dict[str, str], scenarios: str) -> dict[str, Any]:
    calls = root / f"calls-{mode}-{scenarios}"
    args = [PY, str(WORKER), "run", mode, str(root), str(calls), "--device", "cuda"]
    res = subprocess.run(
        [*args, "--scenarios", scenarios], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, f"hub_worker {mode}:\n{res.stderr[-4000:]}"
    return json.loads(res.stdout.splitlines()[-1])["scenarios"]


def test_gpt_oss_with_flash_attn_and_no_kernels_runs_on_the_twins_with_sinks(
    root: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    require()
    env = child_env(real=True, TQDM_DISABLE="1", ATTNGUARD_LOG="none", HF_HOME=str(root / "hf"))
    env["PYTHONPATH"] = os.pathsep.join(
        e for e in env["PYTHONPATH"].split(os.pathsep) if e != KERNELS
    )
    plain = _run("plain", root, env, "gpt_oss")["gpt_oss"]
    guarded = _run("guarded", root, env, "gpt_oss")["gpt_oss"]
    out = results_dir(tmp_path_factory, "hub_gpu")
    (out / "gpt_oss.json").write_text(json.dumps({"plain": plain, "guarded": guarded}, indent=1))
    if "not_applicable" in plain:
        pytest.skip(plain["not_applicable"])
    assert "error" in plain, "unguarded, transformers' routed hub kernel cannot load"
    assert "error" not in guarded, guarded.get("error")
    assert [(e["event"], e["rule"]) for e in guarded["events"]] == [
        ("backend_fallback", "hub-on-sdpa")
    ]
    assert guarded["events"][0]["hub_kernel"] == guarded["attn"]
    twin, eager = guarded["errors_vs_fp32"], guarded["eager_vs_fp32"]
    print(f"GPT-OSS bf16 vs fp32 eager: twins {twin}, eager bf16 {eager}")
    for batch in ("plain", "padded", "packed"):
        assert twin[batch] <= 2 * eager[batch] + 2e-2, f"{batch}: {twin} vs eager bf16 {eager}"


def test_a_stand_in_hub_kernel_on_the_gpu_keeps_serving(root: Path) -> None:
    if not KERNELS:
        pytest.skip("TEST_KERNELS_DIR is not set (scripts/gpu_suite.sh installs .whl-kernels/)")
    repo = hub_standin().write_repo(root / "standin-cuda", backend="cuda")
    env = child_env(real=False, TQDM_DISABLE="1", ATTNGUARD_LOG="none", HF_HOME=str(root / "hf2"))
    env["PYTHONPATH"] = os.pathsep.join([KERNELS, env["PYTHONPATH"]])
    env["LOCAL_KERNELS"] = f"kernels-community/flash-attn2={repo}"
    plain = _run("plain", root, env, "fallback,explicit")
    guarded = _run("guarded", root, env, "fallback,explicit")
    for scenario in ("fallback", "explicit"):
        p, g = plain[scenario], guarded[scenario]
        if "error" in p:
            pytest.skip(f"the stand-in hub kernel does not load here unguarded: {p['error']}")
        assert "error" not in g, g.get("error")
        assert g["attn"] == p["attn"] == "kernels-community/flash-attn2"
        assert g["calls"] and g["calls"] == p["calls"], scenario
        assert g["errors"] == p["errors"], scenario
        assert g["events"] == [], scenario
