"""diffusers' ``*_hub`` backends on a CUDA GPU (the GPU half of tests/test_diffusers_hub.py): a tiny
Flux transformer in bfloat16 on ``cuda:0`` (tests/workers/diffusers_hub_worker.py), each machine a
pair of fresh programs, unguarded and guarded, with the real ``kernels`` package on their path:

* air-gapped, an empty ``HF_HOME``: unguarded, diffusers cannot load kernels-community/flash-attn2,
  flash-attn3 or flash-attn4 ("Version N of ... is not available in the local cache");
  guarded, ``flash_hub`` / ``flash_varlen_hub`` / ``_flash_3_hub`` / ``_flash_3_varlen_hub`` /
  ``flash_4_hub`` run on the twins, within bf16 rounding of diffusers' ``native`` backend, one
  ``backend_fallback`` per hub kernel;
* stand-in hub kernels with a CUDA build (tests/standins/hub_kernel.py, through ``LOCAL_KERNELS``)
  that load: they keep serving under the guard: the same calls, bit-equal outputs, no event.

Inputs (each test skips with the reason when one is missing): ``$TEST_DIFFUSERS_DIR`` (diffusers
0.42.1, scripts/gpu_suite.sh from ``.whl-diffusers/``) and ``$TEST_KERNELS_DIR`` (the ``kernels``
package, from ``.whl-kernels/``; diffusers accepts any release from 0.12). What was measured goes
to $GPU_RESULTS/diffusers_hub/.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from gpuenv import PY, WORKERS, child_env, results_dir
from helpers.packages import hub_standin

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

WORKER = WORKERS / "diffusers_hub_worker.py"
TWINNED = ("flash_hub", "flash_varlen_hub", "_flash_3_hub", "_flash_3_varlen_hub", "flash_4_hub")
LOADABLE = TWINNED[:4]
REL = 3e-2  # bf16 rounding of a two-block model, relative to max |native|


def _env(root: Path, name: str) -> dict[str, str]:
    diffusers = os.environ.get("TEST_DIFFUSERS_DIR", "")
    kernels = os.environ.get("TEST_KERNELS_DIR", "")
    if not (Path(diffusers) / "diffusers").is_dir():
        pytest.skip("TEST_DIFFUSERS_DIR holds no diffusers (carry .whl-diffusers)")
    if not (Path(kernels) / "kernels").is_dir():
        pytest.skip("TEST_KERNELS_DIR holds no kernels package (carry .whl-kernels)")
    env = child_env(real=False, ATTNGUARD_LOG="none", TQDM_DISABLE="1")
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(root / f"hf-{name}"))
    env["PYTHONPATH"] = os.pathsep.join([diffusers, kernels, env["PYTHONPATH"]])
    env.pop("LOCAL_KERNELS", None)
    if name == "loadable":
        standin = hub_standin()
        fa2 = standin.write_repo(root / "fa2", backend="cuda")
        fa3 = standin.write_repo(
            root / "fa3", name="flash-attn3", version=1, interface="fa3", backend="cuda"
        )
        env["LOCAL_KERNELS"] = (
            f"kernels-community/flash-attn2={fa2}:kernels-community/flash-attn3={fa3}"
        )
    return env


def _programs(root: Path, name: str, backends: tuple[str, ...]) -> dict[str, Any]:
    env = _env(root, name)
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    ran: dict[str, Any] = {}
    for mode in ("plain", "guarded"):
        args = [PY, str(WORKER), mode, str(out), "--backends", ",".join(backends)]
        args += ["--device", "cuda:0", "--dtype", "bfloat16"]
        res = subprocess.run(
            args,
            env=dict(env, HUB_STANDIN_CALLS=str(out / f"calls-{mode}")),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, f"{name} {mode}:\n{res.stderr[-4000:]}"
        ran[mode] = json.loads(res.stdout.splitlines()[-1])
    ran["out"] = out
    return ran


def test_air_gapped_hub_backends_run_on_the_twins(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("diffusers_hub_gpu")
    ran = _programs(root, "offline", TWINNED)
    native = torch.load(ran["out"] / "guarded-native.pt")
    scale = native.abs().max().item()
    said, report = set(), {}
    for backend in TWINNED:
        p, g = ran["plain"]["backends"][backend], ran["guarded"]["backends"][backend]
        assert "error" in p, f"{backend}: unguarded, the hub kernel does not load here"
        assert "error" not in g, f"{backend}: {g.get('error')}"
        report[backend] = {"unguarded": p["error"], "max_diff_vs_native": g["max_diff"]}
        assert g["max_diff"] <= REL * scale, f"{backend}: {g['max_diff']} (max |native| {scale})"
        repos = {e["hub_kernel"] for e in g["events"]}
        assert [e["rule"] for e in g["events"]] == ([] if repos <= said else ["hub-on-sdpa"])
        said |= repos
    out = results_dir(tmp_path_factory, "diffusers_hub")
    (out / "offline.json").write_text(json.dumps({"max_native": scale, **report}, indent=1))


def test_a_cuda_hub_kernel_that_loads_keeps_serving(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    root = tmp_path_factory.mktemp("diffusers_hub_gpu_loadable")
    ran = _programs(root, "loadable", LOADABLE)
    for backend in LOADABLE:
        p, g = ran["plain"]["backends"][backend], ran["guarded"]["backends"][backend]
        assert "error" not in p and "error" not in g, (backend, p.get("error"), g.get("error"))
        assert g["calls"] and g["calls"] == p["calls"], f"{backend}: the hub kernel serves"
        assert g["events"] == [], backend
        plain, guarded = (
            torch.load(ran["out"] / f"{m}-{backend}.pt") for m in ("plain", "guarded")
        )
        assert torch.equal(guarded, plain), backend
