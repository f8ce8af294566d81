"""Load-time guard on a real GPU (H100/H200): families A and E with the REAL flash-attn kernel,
and the same loads with flash-attn absent.

Each scenario set runs in a child Python, as an installed package would be seen (transformers
caches its availability checks, so what is on the path must be there before it first looks):

* ``real``: $TEST_REAL_FLASH_ATTN_DIR (the unpacked real flash-attn 2.8.3 wheel, set by
  scripts/gpu_suite.sh) first on PYTHONPATH; skipped with the reason when it is unset or
  ``import flash_attn_2_cuda`` fails there;
* ``absent``: no flash-attn on the path at all. attnguard keeps transformers' flash code path and
  computes its kernel calls with its SDPA twins (``backend_fallback``, rule ``flash-on-sdpa``),
  and the model still gets what flash would have had: the rank's GPU and, where nobody chose a
  dtype, bf16 (``model_placed``, ``model_cast``). An explicit ``device_map`` stands.

Logits are compared with transformers' own sdpa path on the same weights at the real (not
padding) tokens, relative to the largest reference logit. The records (unguarded baselines too)
are written to ``$LOAD_GPU_RESULTS`` (JSON) when set, and to $GPU_RESULTS/load/ when that is set.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import gpuenv  # noqa: E402

TESTS = gpuenv.TESTS
FLASH = "flash_attention_2"
GPU_WARNING = "not initialized on GPU"

_SCRIPT = r"""
import json, logging, sys, tempfile
import torch, transformers
from helpers.models import tiny_config, tiny_inputs, tiny_model_class
import attnguard
from attnguard.observability import events
from attnguard import facts

MODE = sys.argv[1]  # "real": the real flash-attn is on the path; "absent": no flash-attn
FLASH = "flash_attention_2"
auto = transformers.AutoModelForCausalLM
messages = []

class Keep(logging.Handler):
    def emit(self, record):
        messages.append(record.getMessage())

logging.getLogger("transformers").addHandler(Keep())

def on(guarded):
    attnguard.deactivate()
    events.reset_counts()
    messages.clear()
    logging.Logger.warning_once.cache_clear()  # transformers' warning_once is an lru_cache
    if guarded:
        attnguard.activate(log="none")

def inputs_on(device):
    return {k: v.to(device) for k, v in tiny_inputs("qwen2").items()}

def state(model):
    return {
        "devices": sorted({str(p.device) for p in model.parameters()}),
        "dtypes": sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()}),
        "attn": model.config._attn_implementation,
    }

def first_line(exc):
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"

def forward(model):
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            return model.eval()(**inputs_on(device)).logits.float(), None
    except Exception as exc:
        return None, first_line(exc)

REAL = tiny_inputs("qwen2")["attention_mask"].bool()  # padded query rows carry no meaning

def compare(logits, ref):
    if logits is None:
        return None
    got, want = logits.cpu()[REAL], ref.cpu()[REAL]
    return {"max_abs_diff": (got - want).abs().max().item(), "ref_max_abs": want.abs().max().item()}

def flash_module():
    mod = sys.modules.get("flash_attn")
    return None if mod is None else {"file": mod.__file__, "version": getattr(mod, "__version__", None),
                                     "standin": bool(getattr(mod, "IS_ATTNGUARD_STANDIN", False))}

out = {
    "mode": MODE,
    "device": torch.cuda.get_device_name(0),
    "capability": list(torch.cuda.get_device_capability(0)),
    "torch": torch.__version__,
    "transformers": transformers.__version__,
}
out["flash_status"] = facts.current().backend(FLASH).__dict__
root = tempfile.mkdtemp()
ckpt = {}
for dtype in ("float32", "bfloat16"):
    torch.manual_seed(0)
    m = tiny_model_class("qwen2")(tiny_config("qwen2")).to(getattr(torch, dtype))
    ckpt[dtype] = f"{root}/{dtype}"
    m.save_pretrained(ckpt[dtype])

on(False)
ref32 = auto.from_pretrained(ckpt["float32"], attn_implementation="sdpa", dtype=torch.float32,
                             device_map="cuda:0")
ref32_logits, _ = forward(ref32)
ref16 = auto.from_pretrained(ckpt["bfloat16"], attn_implementation="sdpa", dtype=torch.bfloat16,
                             device_map="cuda:0")
ref16_logits, _ = forward(ref16)
del ref32, ref16

def run(name, guarded, path, **kw):
    on(guarded)
    rec = {"guarded": guarded, "kwargs": {k: str(v) for k, v in kw.items()}}
    with events.capture() as got:
        try:
            model = auto.from_pretrained(path, attn_implementation=FLASH, **kw)
            rec.update(state(model))
            logits, err = forward(model)
            rec["forward_error"] = err
            rec["logits"] = logits
        except Exception as exc:
            rec["load_error"] = first_line(exc)
    rec["events"] = [
        {k: e.get(k) for k in ("event", "site", "reason_code", "rule", "selected", "dtype_from",
                               "dtype_to", "device", "applied")}
        for e in got if e["event"] != "activated"
    ]
    rec["transformers_warnings"] = [m for m in messages if "Flash Attention" in m]
    rec["flash_attn_module"] = flash_module()
    out[name] = rec
    return rec

def both(name, path, ref, **kw):
    for guarded in (False, True):
        rec = run(f"{name}_{'guarded' if guarded else 'unguarded'}", guarded, path, **kw)
        rec["vs_sdpa"] = compare(rec.pop("logits", None), ref)

# family A: a bf16 model with flash, dtype given, no device_map
both("A", ckpt["bfloat16"], ref16_logits, dtype=torch.bfloat16)
# family E: an fp32 checkpoint with flash, nothing else said
both("E", ckpt["float32"], ref32_logits)
# the caller placed the model: an explicit device_map stands
both("placed", ckpt["bfloat16"], ref16_logits, device_map="cuda:0")
# family E by hand: the unguarded fp32 model moved to the GPU
on(False)
try:
    m = auto.from_pretrained(ckpt["float32"], attn_implementation=FLASH).to("cuda:0")
    out["E_unguarded_moved"] = {"forward_error": forward(m)[1], **state(m)}
except Exception as exc:
    out["E_unguarded_moved"] = {"load_error": first_line(exc)}
# Model(config) + guard_model
on(True)
with events.capture() as got:
    try:
        torch.manual_seed(0)
        m = attnguard.guard_model(
            tiny_model_class("qwen2")(tiny_config("qwen2", attn_implementation=FLASH)))
        logits, err = forward(m)
        out["ctor_guarded"] = {**state(m), "forward_error": err,
                               "vs_sdpa": compare(logits, ref32_logits)}
    except Exception as exc:
        out["ctor_guarded"] = {"load_error": first_line(exc)}
out["ctor_guarded"]["events"] = [
    {k: e.get(k) for k in ("event", "site", "reason_code", "rule", "dtype_to", "device")}
    for e in got if e["event"] != "activated"
]
attnguard.deactivate()
out["flash_attn_module"] = flash_module()
print("RESULT" + json.dumps(out, default=str))
"""


def _write(name: str, data: Any, results: Path) -> None:
    (results / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))
    target = os.environ.get("LOAD_GPU_RESULTS")
    if not target:
        return
    path = Path(target)
    old = json.loads(path.read_text()) if path.exists() else {}
    old[name] = data
    path.write_text(json.dumps(old, indent=2, default=str))


def _run(mode: str, results: Path) -> dict[str, Any]:
    env = gpuenv.child_env(real=mode == "real", ATTNGUARD_LOG="none", CUDA_VISIBLE_DEVICES="0")
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env["PYTHONPATH"]])
    res = subprocess.run(
        [gpuenv.PY, "-c", _SCRIPT, mode], env=env, capture_output=True, text=True, timeout=600
    )
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT") :])
    _write(f"{mode}_runs", out, results)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gpuenv.results_dir(tmp_path_factory, "load")


@pytest.fixture(scope="module")
def real_runs(results: Path) -> dict[str, Any]:
    """The scenarios with the real flash-attn on the child's path."""
    gpuenv.require()
    out = _run("real", results)
    assert out["flash_status"]["usable"], out["flash_status"]  # the real kernel passed the probe
    module = out["flash_attn_module"]
    assert module and not module["standin"], module
    return out


@pytest.fixture(scope="module")
def absent_runs(results: Path) -> dict[str, Any]:
    """The scenarios with no flash-attn on the child's path."""
    out = _run("absent", results)
    assert not out["flash_status"]["usable"], out["flash_status"]
    assert out["flash_status"]["reason_code"] == "package_missing", out["flash_status"]
    assert out["flash_attn_module"] is None
    return out


def _names(rec: dict[str, Any]) -> list[str]:
    return sorted(e["event"] for e in rec["events"])


def _close(cmp: dict[str, float] | None, rel: float) -> bool:
    return cmp is not None and cmp["max_abs_diff"] <= rel * max(cmp["ref_max_abs"], 1.0)


# --- the real kernel ----------------------------------------------------------------------------


def test_family_a_flash_without_device_map_lands_on_the_gpu(real_runs: dict[str, Any]) -> None:
    guarded = real_runs["A_guarded"]
    assert guarded.get("load_error") is None, guarded
    assert guarded["devices"] == ["cuda:0"] and guarded["dtypes"] == ["bfloat16"]
    assert guarded["attn"] == FLASH
    assert guarded["forward_error"] is None
    assert not [m for m in guarded["transformers_warnings"] if GPU_WARNING in m]
    assert _names(guarded) == ["model_placed"]
    assert guarded["events"][0]["device"] == "cuda:0"
    # the real kernel in bf16 against transformers' sdpa in bf16, at the real tokens
    assert _close(guarded["vs_sdpa"], 0.02), guarded["vs_sdpa"]
    # what the same call does unguarded: the model stays on the CPU, where flash cannot run
    unguarded = real_runs["A_unguarded"]
    assert unguarded["devices"] == ["cpu"]
    assert "with arguments from the 'CPU' backend" in (unguarded["forward_error"] or ""), unguarded


def test_family_e_fp32_checkpoint_runs_in_bf16(real_runs: dict[str, Any]) -> None:
    guarded = real_runs["E_guarded"]
    assert guarded.get("load_error") is None, guarded
    assert guarded["devices"] == ["cuda:0"] and guarded["dtypes"] == ["bfloat16"]
    assert guarded["attn"] == FLASH and guarded["forward_error"] is None
    assert _names(guarded) == ["model_cast", "model_placed"]
    cast = [e for e in guarded["events"] if e["event"] == "model_cast"]
    assert [(e["dtype_from"], e["dtype_to"]) for e in cast] == [("float32", "bfloat16")]
    cmp = guarded["vs_sdpa"]
    # bf16 keeps ~3 significant digits: close to the fp32 reference, not equal
    assert 0 < cmp["max_abs_diff"] <= 0.05 * max(cmp["ref_max_abs"], 1.0), cmp
    moved = real_runs["E_unguarded_moved"]
    assert moved["dtypes"] == ["float32"]
    assert "FlashAttention only support fp16 and bf16 data type" in (moved["forward_error"] or "")


def test_an_explicit_device_map_with_the_real_kernel_needs_nothing(
    real_runs: dict[str, Any],
) -> None:
    guarded, unguarded = real_runs["placed_guarded"], real_runs["placed_unguarded"]
    assert guarded["events"] == []  # nothing wrong: nothing said, nothing changed
    for rec in (guarded, unguarded):
        assert rec["devices"] == ["cuda:0"] and rec["attn"] == FLASH
        assert rec["forward_error"] is None
    assert _close(guarded["vs_sdpa"], 0.02), guarded["vs_sdpa"]


def test_model_built_with_config_is_cast_and_moved(real_runs: dict[str, Any]) -> None:
    ctor = real_runs["ctor_guarded"]
    assert ctor.get("load_error") is None, ctor
    assert ctor["devices"] == ["cuda:0"] and ctor["dtypes"] == ["bfloat16"]
    assert ctor["attn"] == FLASH and ctor["forward_error"] is None
    assert sorted(e["event"] for e in ctor["events"]) == ["model_cast", "model_placed"]


# --- flash-attn absent: the flash path on the SDPA twins, and the run flash would have had ------


def _assert_twins_fallback(rec: dict[str, Any]) -> None:
    (fallback,) = [e for e in rec["events"] if e["event"] == "backend_fallback"]
    assert fallback["reason_code"] == "package_missing", fallback
    assert fallback["rule"] == "flash-on-sdpa" and fallback["selected"] == "sdpa_twin", fallback
    assert fallback["applied"] is True
    assert rec["attn"] == FLASH  # transformers' flash code path is kept


def test_flash_absent_a_bf16_model_is_placed_and_runs_on_the_twins(
    absent_runs: dict[str, Any],
) -> None:
    unguarded = absent_runs["A_unguarded"]
    assert "load_error" in unguarded, unguarded  # transformers alone refuses to load
    guarded = absent_runs["A_guarded"]
    assert guarded.get("load_error") is None, guarded
    _assert_twins_fallback(guarded)
    assert _names(guarded) == ["backend_fallback", "model_placed"]
    assert guarded["devices"] == ["cuda:0"] and guarded["dtypes"] == ["bfloat16"]
    assert guarded["forward_error"] is None
    assert _close(guarded["vs_sdpa"], 0.02), guarded["vs_sdpa"]


def test_flash_absent_an_fp32_checkpoint_gets_bf16_on_the_gpu(absent_runs: dict[str, Any]) -> None:
    guarded = absent_runs["E_guarded"]
    assert guarded.get("load_error") is None, guarded
    _assert_twins_fallback(guarded)
    assert _names(guarded) == ["backend_fallback", "model_cast", "model_placed"]
    cast = [e for e in guarded["events"] if e["event"] == "model_cast"]
    assert [(e["dtype_from"], e["dtype_to"]) for e in cast] == [("float32", "bfloat16")]
    assert guarded["devices"] == ["cuda:0"] and guarded["dtypes"] == ["bfloat16"]
    assert guarded["forward_error"] is None
    cmp = guarded["vs_sdpa"]
    assert 0 < cmp["max_abs_diff"] <= 0.05 * max(cmp["ref_max_abs"], 1.0), cmp


def test_flash_absent_an_explicit_device_map_stands(absent_runs: dict[str, Any]) -> None:
    guarded = absent_runs["placed_guarded"]
    assert guarded.get("load_error") is None, guarded
    _assert_twins_fallback(guarded)
    assert _names(guarded) == ["backend_fallback"]  # nothing to place, the dtype was the ckpt's
    assert guarded["devices"] == ["cuda:0"] and guarded["dtypes"] == ["bfloat16"]
    assert guarded["forward_error"] is None
    assert _close(guarded["vs_sdpa"], 0.02), guarded["vs_sdpa"]


def test_flash_absent_model_built_with_config(absent_runs: dict[str, Any]) -> None:
    ctor = absent_runs["ctor_guarded"]
    assert ctor.get("load_error") is None, ctor
    assert ctor["devices"] == ["cuda:0"] and ctor["dtypes"] == ["bfloat16"]
    assert ctor["attn"] == FLASH and ctor["forward_error"] is None
    names = sorted(e["event"] for e in ctor["events"])
    assert names == ["backend_fallback", "model_cast", "model_placed"], ctor["events"]
