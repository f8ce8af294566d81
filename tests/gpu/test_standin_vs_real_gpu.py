"""The flash-attn stand-in of tests/standins against the REAL flash-attn 2.8.3 kernel.

The CPU tests use the stand-in as "flash-attn installed and usable"; they are only as honest as
the stand-in is like the real kernel. tests/workers/standin_worker.py runs one fixed set of
seeded calls (``CASES`` there) twice on the same GPU, in two child processes: once with the real
flash-attn first on PYTHONPATH ($TEST_REAL_FLASH_ATTN_DIR, the unpacked wheel; set by
scripts/gpu_suite.sh), once with tests/standins instead. Each saves what every call returned or
raised; this module compares the two:

* outputs (``flash_attn_func`` causal / non-causal / window / softcap / GQA / ALiBi / decode,
  ``flash_attn_varlen_func`` with several lengths, ``flash_attn_qkvpacked_func``,
  ``flash_attn_kvpacked_func``, ``flash_attn_with_kvcache`` for what the stand-in implements)
  within 2e-2 (bf16) / 5e-3 (fp16) of the real kernel's max |out|; ``softmax_lse`` within 1e-3
  with the same rows at +-inf; the KV caches after ``flash_attn_with_kvcache`` bit-identical;
* errors (float32 inputs, CPU tensors, mixed q/k and q/v dtypes, head_dim 512): the same
  exception type and the same message text, character for character. A difference fails with
  both texts and their diff; nothing is normalised.

Where the stand-in is known (from the real sources) to differ, the case is a strict xfail with
the reason (``EXPECTED_LSE_DIFFERENCES`` in the worker): an unexpected pass fails the run.
What every case gave is written to $GPU_RESULTS/standin_vs_real/comparison.json when set.
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

import gpuenv  # noqa: E402

_spec = importlib.util.spec_from_file_location(
    "standin_worker", gpuenv.WORKERS / "standin_worker.py"
)
worker = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["standin_worker"] = worker  # dataclasses look their module up while it runs
_spec.loader.exec_module(worker)  # type: ignore[union-attr]

OUT_TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative to max |out| of the kernel
LSE_ATOL = 1e-3
CASES = worker.CASES
OUTPUT_CASES = [n for n, c in CASES.items() if not c.error]
LSE_CASES = [
    pytest.param(
        n,
        marks=pytest.mark.xfail(strict=True, reason=worker.EXPECTED_LSE_DIFFERENCES[n]),
    )
    if n in worker.EXPECTED_LSE_DIFFERENCES
    else n
    for n, c in CASES.items()
    if c.lse and not c.error
]
CACHE_CASES = [n for n, c in CASES.items() if c.caches and not c.error]
ERROR_CASES = [n for n, c in CASES.items() if c.error]


def _launch(impl: str, out: Path) -> dict[str, Any]:
    env = gpuenv.child_env(real=impl == "real")
    if impl == "standin":
        env["PYTHONPATH"] = os.pathsep.join([str(gpuenv.STANDINS), env["PYTHONPATH"]])
    cmd = [gpuenv.PY, str(gpuenv.WORKERS / "standin_worker.py"), impl, str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and out.exists(), f"{impl} worker failed:\n{res.stderr[-4000:]}"
    return torch.load(out, weights_only=False)


def _text_difference(real: str, standin: str) -> str:
    diff = difflib.unified_diff(
        real.splitlines(), standin.splitlines(), "real", "stand-in", lineterm="", n=0
    )
    return "\n".join(list(diff)[:60])


def _max_rel_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    return err, max(want.float().abs().max().item() if want.numel() else 0.0, 1e-6)


def _compare(name: str, real: dict[str, Any], standin: dict[str, Any]) -> dict[str, Any]:
    case = CASES[name]
    rec: dict[str, Any] = {
        "same_inputs": real["inputs_digest"] == standin["inputs_digest"],
        "real_error": real["error"],
        "standin_error": standin["error"],
    }
    if case.error:
        if real["error"] and standin["error"]:
            rec["same_type"] = real["error"][0] == standin["error"][0]
            rec["same_message"] = real["error"][1] == standin["error"][1]
            rec["message_diff"] = _text_difference(real["error"][1], standin["error"][1])
        return rec
    if real["error"] or standin["error"]:
        return rec
    rt, st = real["tensors"], standin["tensors"]
    out_r, out_s = rt["out"], st["out"]
    rec["out_shape"] = [list(out_r.shape), list(out_s.shape)]
    rec["out_dtype"] = [str(out_r.dtype), str(out_s.dtype)]
    if out_r.shape == out_s.shape:
        err, scale = _max_rel_err(out_s, out_r)
        rec["out_err"], rec["out_bound"] = err, OUT_TOL[case.dtype] * scale
        rec["out_nan"] = bool(torch.isnan(out_s).any()) or bool(torch.isnan(out_r).any())
    if case.lse:
        lse_r, lse_s = rt.get("lse"), st.get("lse")
        rec["lse_shape"] = [
            None if lse_r is None else list(lse_r.shape),
            None if lse_s is None else list(lse_s.shape),
        ]
        if lse_r is not None and lse_s is not None and lse_r.shape == lse_s.shape:
            inf_r, inf_s = torch.isinf(lse_r), torch.isinf(lse_s)
            rec["lse_inf_rows"] = [int(inf_r.sum()), int(inf_s.sum())]
            rec["lse_same_inf"] = bool(torch.equal(lse_r[inf_r], lse_s[inf_r])) and bool(
                torch.equal(inf_r, inf_s)
            )
            finite = ~inf_r & ~inf_s
            rec["lse_err"] = (
                (lse_r[finite] - lse_s[finite]).abs().max().item() if finite.any() else 0.0
            )
            rec["lse_nan"] = [bool(torch.isnan(lse_r).any()), bool(torch.isnan(lse_s).any())]
    if case.caches:
        rec["caches_equal"] = all(
            torch.equal(rt[n], st[n]) for n in ("k_cache", "v_cache") if n in rt and n in st
        ) and all(n in rt and n in st for n in ("k_cache", "v_cache"))
    return rec


@pytest.fixture(scope="module")
def comparison(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    gpuenv.require()
    tmp = tmp_path_factory.mktemp("standin_vs_real")
    real = _launch("real", tmp / "real.pt")
    standin = _launch("standin", tmp / "standin.pt")
    assert "standins" not in real["meta"]["flash_attn_file"], real["meta"]
    assert "standins" in standin["meta"]["flash_attn_file"], standin["meta"]
    result = {
        "real": real["meta"],
        "standin": standin["meta"],
        "cases": {n: _compare(n, real["cases"][n], standin["cases"][n]) for n in CASES},
    }
    out = gpuenv.results_dir(tmp_path_factory, "standin_vs_real") / "comparison.json"
    out.write_text(json.dumps(result, indent=1, default=str))
    return result


def _no_errors(rec: dict[str, Any]) -> None:
    assert rec["real_error"] is None, f"the real kernel raised: {rec['real_error']}"
    assert rec["standin_error"] is None, f"the stand-in raised: {rec['standin_error']}"


def test_both_processes_got_the_same_inputs(comparison: dict[str, Any]) -> None:
    differ = [n for n, rec in comparison["cases"].items() if not rec["same_inputs"]]
    assert differ == []


@pytest.mark.parametrize("name", OUTPUT_CASES)
def test_outputs_match(comparison: dict[str, Any], name: str) -> None:
    rec = comparison["cases"][name]
    _no_errors(rec)
    assert rec["out_shape"][0] == rec["out_shape"][1], rec
    assert rec["out_dtype"][0] == rec["out_dtype"][1], rec
    assert not rec["out_nan"], rec
    assert rec["out_err"] <= rec["out_bound"], (
        f"max |stand-in - flash-attn| = {rec['out_err']:.3g} > {rec['out_bound']:.3g}"
    )


@pytest.mark.parametrize("name", LSE_CASES)
def test_softmax_lse_matches(comparison: dict[str, Any], name: str) -> None:
    rec = comparison["cases"][name]
    _no_errors(rec)
    assert rec["lse_shape"][0] == rec["lse_shape"][1], rec
    assert rec["lse_nan"] == [False, False], rec
    assert rec["lse_same_inf"], f"rows at +-inf differ (real, stand-in): {rec['lse_inf_rows']}"
    assert math.isfinite(rec["lse_err"]) and rec["lse_err"] <= LSE_ATOL, rec["lse_err"]


@pytest.mark.parametrize("name", CACHE_CASES)
def test_kv_caches_hold_what_the_kernel_wrote(comparison: dict[str, Any], name: str) -> None:
    rec = comparison["cases"][name]
    _no_errors(rec)
    assert rec["caches_equal"], "k_cache / v_cache after the call differ"


@pytest.mark.parametrize("name", ERROR_CASES)
def test_errors_match(comparison: dict[str, Any], name: str) -> None:
    rec = comparison["cases"][name]
    real, standin = rec["real_error"], rec["standin_error"]
    assert real is not None, "the real kernel did not raise"
    assert standin is not None, f"the stand-in did not raise; the real kernel raised {real}"
    assert rec["same_type"], f"exception type: real {real[0]}, stand-in {standin[0]}"
    assert rec["same_message"], (
        f"message differs.\nreal ({real[0]}):\n{real[1][:1500]}\n"
        f"stand-in ({standin[0]}):\n{standin[1][:1500]}\ndiff:\n{rec['message_diff']}"
    )
