"""Load-time guard on a real GPU (H100/H200): families A and E, and flash absent.

flash-attn cannot be had on the GPU image, so the runs that need flash usable use the flash-attn
**stand-in** of ``tests/standins`` (flash-attn 2.8.3's API and contract: CUDA only, fp16/bf16
only, head_dim <= 256, sm80+, computed with torch SDPA; its dist-info makes transformers see
"flash-attn 2.8.3 installed"). Those runs happen in a child Python with the stand-in on
PYTHONPATH, as an installed package would be: transformers caches its availability checks, so
the stand-in must be there before transformers first looks. The results (also the unguarded
baselines) are written to ``$LOAD_GPU_RESULTS`` (JSON) when set, for the closing note.
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

import transformers  # noqa: E402
from conftest import PY, STANDINS, logits_of, names, subprocess_env, tiny_inputs  # noqa: E402

import attnguard  # noqa: E402
from attnguard import events, facts  # noqa: E402

TESTS = Path(__file__).resolve().parents[1]
FLASH = "flash_attention_2"
GPU_WARNING = "not initialized on GPU"

_SCRIPT = r"""
import json, logging, sys, tempfile
import torch, transformers
from conftest import tiny_config, tiny_model_class, tiny_inputs, logits_of
import attnguard
from attnguard import events, facts

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

def forward(model):
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            return model.eval()(**inputs_on(device)).logits.float(), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"

REAL = tiny_inputs("qwen2")["attention_mask"].bool()  # padded query rows carry no meaning

def compare(logits, ref):
    if logits is None:
        return None
    got, want = logits.cpu()[REAL], ref.cpu()[REAL]
    return {"max_abs_diff": (got - want).abs().max().item(), "ref_max_abs": want.abs().max().item()}

out = {
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
    rec = {"guarded": guarded}
    with events.capture() as got:
        try:
            model = auto.from_pretrained(path, attn_implementation=FLASH, **kw)
            rec.update(state(model))
            logits, err = forward(model)
            rec["forward_error"] = err
            rec["logits"] = logits
        except Exception as exc:
            rec["load_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    rec["events"] = [
        {k: e.get(k) for k in ("event", "site", "reason_code", "dtype_from", "dtype_to", "device")}
        for e in got if e["event"] != "activated"
    ]
    rec["transformers_warnings"] = [m for m in messages if "Flash Attention" in m]
    out[name] = rec
    return rec

# family A: a bf16 model with flash and no device_map
for guarded in (False, True):
    rec = run(f"A_{'guarded' if guarded else 'unguarded'}", guarded, ckpt["bfloat16"],
              dtype=torch.bfloat16)
    rec["vs_sdpa_bf16"] = compare(rec.pop("logits", None), ref16_logits)
# family E: an fp32 checkpoint with flash, nothing else said
for guarded in (False, True):
    rec = run(f"E_{'guarded' if guarded else 'unguarded'}", guarded, ckpt["float32"])
    rec["vs_sdpa_fp32"] = compare(rec.pop("logits", None), ref32_logits)
# family E by hand: the unguarded fp32 model moved to the GPU
on(False)
m = auto.from_pretrained(ckpt["float32"], attn_implementation=FLASH).to("cuda:0")
out["E_unguarded_moved"] = {"forward_error": forward(m)[1], **state(m)}
# Model(config) + guard_model
on(True)
with events.capture() as got:
    torch.manual_seed(0)
    m = attnguard.guard_model(tiny_model_class("qwen2")(tiny_config("qwen2", attn_implementation=FLASH)))
    logits, err = forward(m)
out["ctor_guarded"] = {**state(m), "forward_error": err,
                       "events": [e["event"] for e in got if e["event"] != "activated"]}
attnguard.deactivate()
print("RESULT" + json.dumps(out, default=str))
"""


def _write(name: str, data: Any) -> None:
    target = os.environ.get("LOAD_GPU_RESULTS")
    if not target:
        return
    path = Path(target)
    old = json.loads(path.read_text()) if path.exists() else {}
    old[name] = data
    path.write_text(json.dumps(old, indent=2, default=str))


@pytest.fixture(scope="module")
def standin_runs() -> dict[str, Any]:
    """The stand-in scenarios, run once in a child Python with tests/standins on its path."""
    env = subprocess_env(ATTNGUARD_LOG="none")
    env["PYTHONPATH"] = os.pathsep.join([str(STANDINS), str(TESTS), env["PYTHONPATH"]])
    res = subprocess.run([PY, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    assert res.returncode == 0 and lines, res.stderr[-4000:]
    out = json.loads(lines[0][len("RESULT") :])
    _write("standin_runs", out)
    assert out["flash_status"]["usable"], out["flash_status"]  # the stand-in passed the probe
    return out


def test_family_a_flash_without_device_map_lands_on_the_gpu(standin_runs: dict[str, Any]) -> None:
    guarded = standin_runs["A_guarded"]
    assert guarded.get("load_error") is None
    assert guarded["devices"] == ["cuda:0"] and guarded["dtypes"] == ["bfloat16"]
    assert guarded["attn"] == FLASH
    assert guarded["forward_error"] is None
    assert not [m for m in guarded["transformers_warnings"] if GPU_WARNING in m]
    assert [e["event"] for e in guarded["events"]] == ["model_placed"]
    assert guarded["events"][0]["device"] == "cuda:0"
    cmp = guarded["vs_sdpa_bf16"]
    assert cmp["max_abs_diff"] <= 0.02 * max(cmp["ref_max_abs"], 1.0)
    # what the same call does unguarded: the model stays on the CPU, where flash cannot run
    assert standin_runs["A_unguarded"]["devices"] == ["cpu"]
    assert standin_runs["A_unguarded"]["forward_error"] is not None


def test_family_e_fp32_checkpoint_runs_in_bf16(standin_runs: dict[str, Any]) -> None:
    guarded = standin_runs["E_guarded"]
    assert guarded.get("load_error") is None
    assert guarded["devices"] == ["cuda:0"] and guarded["dtypes"] == ["bfloat16"]
    assert guarded["attn"] == FLASH and guarded["forward_error"] is None
    cast = [e for e in guarded["events"] if e["event"] == "model_cast"]
    assert [(e["dtype_from"], e["dtype_to"]) for e in cast] == [("float32", "bfloat16")]
    cmp = guarded["vs_sdpa_fp32"]
    # bf16 keeps ~3 significant digits: close to the fp32 reference, not equal
    assert 0 < cmp["max_abs_diff"] <= 0.05 * max(cmp["ref_max_abs"], 1.0)
    moved = standin_runs["E_unguarded_moved"]
    assert moved["dtypes"] == ["float32"] and "fp16 and bf16" in (moved["forward_error"] or "")


def test_model_built_with_config_is_cast_and_moved(standin_runs: dict[str, Any]) -> None:
    ctor = standin_runs["ctor_guarded"]
    assert ctor["devices"] == ["cuda:0"] and ctor["dtypes"] == ["bfloat16"]
    assert ctor["forward_error"] is None
    assert ctor["events"] == ["model_cast", "model_placed"]


def test_flash_absent_falls_back_to_sdpa_on_the_gpu(
    tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    if facts.current().backend(FLASH).usable:
        pytest.skip("flash-attn is usable in this environment")
    path = tiny_checkpoint("qwen2", "bfloat16")
    auto = transformers.AutoModelForCausalLM
    attnguard.deactivate()
    reference = auto.from_pretrained(path, attn_implementation="sdpa", device_map="cuda:0")
    guard()
    captured.clear()
    model = auto.from_pretrained(path, attn_implementation=FLASH, device_map="cuda:0")
    assert model.config._attn_implementation == "sdpa"
    assert {str(p.device) for p in model.parameters()} == {"cuda:0"}
    inputs = {k: v.to("cuda:0") for k, v in tiny_inputs("qwen2").items()}
    with torch.no_grad():
        assert torch.equal(model.eval()(**inputs).logits, reference.eval()(**inputs).logits)
    assert names(captured) == ["backend_fallback"]
    # no flash, nothing to place: a model without device_map stays where the caller built it
    captured.clear()
    events.reset_counts()
    plain = auto.from_pretrained(path, attn_implementation=FLASH)
    assert {p.device.type for p in plain.parameters()} == {"cpu"}
    assert names(captured) == ["backend_fallback"]
    _write("flash_absent", {"device": torch.cuda.get_device_name(0), "events": names(captured)})
    assert logits_of(plain, "qwen2").shape[0] == 2
