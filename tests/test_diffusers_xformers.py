"""diffusers and xformers: what diffusers hands xformers (its ``xformers`` backend's grouped-query
calls with a mask), and ``enable_xformers_memory_efficient_attention()`` where xformers is not
installed.

Here xformers is the PyPI wheel whose ops do not run on a CPU (in this process), or absent (child
processes with ``sys.modules["xformers"] = None``: ``import xformers`` fails and diffusers'
``is_xformers_available()`` is False, as on a machine without it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.events import reasons
from helpers.packages import diffusers_dispatch
from helpers.processes import PY, REPO, subprocess_env

import attnguard
from attnguard import callguard
from attnguard.fallback import xformers_memory_efficient_attention
from attnguard.observability import events

ad = diffusers_dispatch()  # or the module skips, saying why diffusers is not here

WORKERS = Path(__file__).resolve().parent / "workers"


@pytest.fixture(autouse=True)
def _quiet_diffusers() -> Any:
    logging.disable(logging.WARNING)  # "Attention backends are an experimental feature"
    yield
    logging.disable(logging.NOTSET)
    ad._AttentionBackendRegistry._active_backend = ad.AttentionBackendName.NATIVE
    callguard.reset_latches()
    events.reset_counts()


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- the grouped-query call diffusers' xformers backend makes ------------------------------------


def _xformers_bmghk_reference(q, k, v, bias, scale=None):
    """xformers' semantics of BMGHK q/k/v ``(B, M, G, H, K)`` with a BMHK tensor bias
    ``(B, G*H, Mq, Mk)``, in float64: the groups flattened (head ``g*H + h``), each head with
    its own bias row (what xformers' ROCm kernel computes; its CUDA kernel takes the bias only
    where H == 1 and refuses it otherwise)."""
    b, mq, g, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qd, kd, vd = (x.double().flatten(2, 3).transpose(1, 2) for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * scale + bias.double().expand(b, g * h, mq, k.shape[1])
    out = torch.softmax(s, dim=-1) @ vd
    return out.transpose(1, 2).unflatten(2, (g, h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [2, 1])
def test_xformers_twin_takes_a_bmhk_bias_for_grouped_heads(dtype: torch.dtype, h: int) -> None:
    """diffusers' xformers backend with ``enable_gqa``: q/k/v unflattened to BMGHK (k/v
    expanded over H) with the 4D bias it built for the query heads."""
    b, mq, mk, g, d = 2, 5, 7, 2, 16
    q = _rand(b, mq, g, h, d, seed=1, dtype=dtype)
    k = _rand(b, mk, g, 1, d, seed=2, dtype=dtype).expand(b, mk, g, h, d)
    v = _rand(b, mk, g, 1, d, seed=3, dtype=dtype).expand(b, mk, g, h, d)
    per_head = _rand(b, g * h, mq, mk, seed=4).to(dtype)  # another bias row for every head
    padding = torch.zeros(b, 1, 1, mk).masked_fill(torch.arange(mk) >= 5, -math.inf)
    for bias in (per_head, padding.expand(b, g * h, mq, mk).to(dtype)):
        out = xformers_memory_efficient_attention(q, k, v, bias, 0.0, 0.3)
        assert out.shape == (b, mq, g, h, d) and out.dtype == dtype
        want = _xformers_bmghk_reference(q, k, v, bias, scale=0.3)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(ad.xops is None, reason="xformers is not importable here")
def test_xformers_backend_gqa_with_a_mask_computes_natives_numbers(
    captured: list[dict[str, Any]],
) -> None:
    """Through diffusers' dispatcher: xformers' ops cannot run here, the xformers integration
    reroutes each call to the twin, which must take what diffusers hands xformers."""
    q, k, v = _rand(2, 12, 4, 16, seed=5), _rand(2, 12, 2, 16, seed=6), _rand(2, 12, 2, 16, seed=7)
    xf, native = ad.AttentionBackendName.XFORMERS, ad.AttentionBackendName.NATIVE
    keep = torch.arange(12) < torch.tensor([12, 8])[:, None]  # the second row padded
    masks = {
        "padding": torch.zeros(2, 1, 1, 12).masked_fill(~keep[:, None, None, :], -math.inf),
        "per_head": _rand(2, 4, 12, 12, seed=8),
    }
    with pytest.raises(NotImplementedError, match="No operator found"):
        ad.dispatch_attention_fn(q, k, v, attn_mask=masks["padding"], enable_gqa=True, backend=xf)
    attnguard.activate(log="none")
    for mask in masks.values():
        got = ad.dispatch_attention_fn(q, k, v, attn_mask=mask, enable_gqa=True, backend=xf)
        want = ad.dispatch_attention_fn(q, k, v, attn_mask=mask, enable_gqa=True, backend=native)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    assert reasons(captured[1:]) == [("backend_rerouted", "cpu_tensors")]


# --- enable_xformers_memory_efficient_attention() without xformers -------------------------------

# A user's program on a machine with CUDA and without xformers, played on this CPU: xformers hidden,
# and for the enable call only torch says CUDA is there (diffusers' probe tensor stays on the CPU).
# The model then runs on the CPU, where diffusers' xformers processors call what
# ``xformers.ops.memory_efficient_attention`` is in their module.
_SIMULATED_CUDA = r"""
import json, logging, sys
sys.modules["xformers"] = None  # not installed
logging.disable(logging.WARNING)
guard = sys.argv[2] == "guard"
if guard:
    import attnguard
    from attnguard.observability import events
sys.path.insert(0, sys.argv[3])
import torch
import diffusers_worker as dw
from diffusers.models.attention import AttentionModuleMixin
from diffusers.utils import is_xformers_available

build, make_inputs = dw.MODELS[sys.argv[1]]
model, inputs = build(), make_inputs()
out = {"error": None, "events": []}
with (events.capture() if guard else __import__("contextlib").nullcontext([])) as got:
    native = dw.run(model, inputs)
    available, randn = torch.cuda.is_available, torch.randn
    torch.cuda.is_available = lambda: True
    torch.randn = lambda *a, device=None, **k: randn(*a, **k)
    try:
        model.enable_xformers_memory_efficient_attention()
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
    finally:
        torch.cuda.is_available, torch.randn = available, randn
    if out["error"] is None:
        out["max_diff"] = (dw.run(model, inputs) - native).abs().max().item()
        out["processors"] = sorted({type(p).__name__ for p in model.attn_processors.values()})
        out["backends"] = sorted({
            str(getattr(m.processor._attention_backend, "value", None))
            for m in model.modules() if isinstance(m, AttentionModuleMixin)
        })
out["events"] = [(e["event"], e["site"], e["reason_code"], e.get("applied")) for e in got
                 if e["event"] not in ("activated", "summary")]
try:
    import xformers  # noqa: F401
    out["import_xformers"] = "imported"
except ImportError as exc:
    out["import_xformers"] = type(exc).__name__
out["is_xformers_available"] = is_xformers_available()
print(json.dumps(out))
"""


def _simulated_cuda(model: str, guard: bool) -> dict[str, Any]:
    env = subprocess_env(ATTNGUARD_LOG="none")
    res = subprocess.run(
        [PY, "-c", _SIMULATED_CUDA, model, "guard" if guard else "none", str(WORKERS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.strip(), res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["unet", "flux"])
def test_enable_xformers_without_xformers_on_a_cuda_machine_runs_on_the_twin(model: str) -> None:
    """unet: the classic processors (``XFormersAttnProcessor`` calling ``xformers.ops``); flux:
    attention modules of the dispatcher, switched to its ``xformers`` backend."""
    unguarded = _simulated_cuda(model, guard=False)
    assert unguarded["error"].startswith("ModuleNotFoundError: Refer to"), unguarded
    guarded = _simulated_cuda(model, guard=True)
    assert guarded["error"] is None, guarded
    assert guarded["max_diff"] <= 2e-6  # the twin computes what native's SDPA does, on a CPU
    if model == "unet":
        assert "XFormersAttnProcessor" in guarded["processors"]
        fallback = ["backend_fallback", "diffusers.xformers_processors", "xformers_missing", True]
    else:
        assert guarded["backends"] == ["xformers"]
        fallback = ["backend_fallback", "diffusers.xformers", "backend_package_unusable", True]
    assert guarded["events"] == [fallback]  # one event for the model's every attention module
    # only diffusers' call saw xformers: the program still cannot import it, nor diffusers
    assert guarded["import_xformers"] == "ModuleNotFoundError"
    assert guarded["is_xformers_available"] is False


def test_enable_xformers_without_xformers_in_warn_mode_changes_nothing() -> None:
    env = subprocess_env(ATTNGUARD_LOG="none", ATTNGUARD_MODE="warn")
    res = subprocess.run(
        [PY, "-c", _SIMULATED_CUDA, "unet", "guard", str(WORKERS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["error"].startswith("ModuleNotFoundError: Refer to"), out
    assert out["events"] == [
        ["backend_fallback", "diffusers.xformers_processors", "xformers_missing", False]
    ]


def _worker(*args: str) -> dict[str, Any]:
    env = subprocess_env(ATTNGUARD_LOG="none")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    res = subprocess.run(
        [PY, str(WORKERS / "diffusers_worker.py"), "--hide-xformers", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0 and res.stdout.strip(), res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine without CUDA")
@pytest.mark.parametrize("model", ["unet", "flux"])
def test_enable_xformers_without_xformers_or_cuda_keeps_diffusers_error_with_one_event(
    model: str,
) -> None:
    """diffusers refuses xformers without CUDA even where it is installed: its error stands (a
    script catching ModuleNotFoundError keeps working), and one event says why."""
    unguarded = _worker("--model", model, "--how", "xformers")
    assert unguarded["error"].startswith("ModuleNotFoundError: Refer to"), unguarded
    guarded = _worker("--model", model, "--how", "xformers", "--guard", "import")
    assert guarded["error"] == unguarded["error"]
    assert [(e["event"], e["site"], e["reason_code"]) for e in guarded["events"]] == [
        ("observed", "diffusers.xformers_processors", "xformers_missing")
    ]
    assert "no CUDA GPU" in guarded["events"][0]["reason"]


def test_deactivate_restores_the_classic_method() -> None:
    from diffusers.models import attention, attention_processor

    classic = attention_processor.Attention.set_use_memory_efficient_attention_xformers
    mixin = attention.AttentionModuleMixin.set_use_memory_efficient_attention_xformers
    attnguard.activate(log="none")
    assert attention_processor.Attention.set_use_memory_efficient_attention_xformers is not classic
    assert attention.AttentionModuleMixin.set_use_memory_efficient_attention_xformers is not mixin
    attnguard.deactivate()
    assert attention_processor.Attention.set_use_memory_efficient_attention_xformers is classic
    assert attention.AttentionModuleMixin.set_use_memory_efficient_attention_xformers is mixin


# --- set_attn_processor(XFormersAttnProcessor()) without xformers ---------------------------------

_PROCESSOR_SET_BY_HAND = r"""
import json, logging, sys
sys.modules["xformers"] = None  # not installed
logging.disable(logging.WARNING)
guard = sys.argv[1] == "guard"
if guard:
    import attnguard
    from attnguard.observability import events
sys.path.insert(0, sys.argv[2])
import contextlib
import diffusers_worker as dw
from diffusers.models.attention_processor import XFormersAttnProcessor

model, inputs = dw.tiny_unet(), dw.unet_inputs()
out = {"error": None}
with (events.capture() if guard else contextlib.nullcontext([])) as got:
    native = dw.run(model, inputs)
    model.set_attn_processor(XFormersAttnProcessor())
    try:
        out["max_diff"] = (dw.run(model, inputs) - native).abs().max().item()
        dw.run(model, inputs)  # a second forward: nothing more is said
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
out["events"] = [(e["event"], e["reason_code"], e.get("applied")) for e in got
                 if e["event"] not in ("activated", "summary")]
print(json.dumps(out))
"""


@pytest.mark.parametrize("mode", ["fix", "warn"])
def test_an_xformers_processor_set_by_hand_without_xformers(mode: str) -> None:
    """A script that installs ``XFormersAttnProcessor`` itself on a machine without xformers:
    unguarded its first attention call fails on the missing package ("'NoneType' object has no
    attribute 'ops'"); guarded the processor runs on attnguard's twin of
    ``memory_efficient_attention`` (native's numbers), one event says so. Warn mode: diffusers'
    error stands, the event says what fix mode would do."""

    def program(guard: bool) -> dict[str, Any]:
        env = subprocess_env(ATTNGUARD_LOG="none", ATTNGUARD_MODE=mode)
        args = [PY, "-c", _PROCESSOR_SET_BY_HAND, "guard" if guard else "none", str(WORKERS)]
        res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and res.stdout.strip(), res.stderr[-3000:]
        return json.loads(res.stdout.strip().splitlines()[-1])

    unguarded = program(guard=False)
    assert unguarded["error"] == "AttributeError: 'NoneType' object has no attribute 'ops'"
    guarded = program(guard=True)
    if mode == "warn":
        assert guarded["error"] == unguarded["error"]
        assert guarded["events"] == [["backend_fallback", "xformers_missing", False]]
        return
    assert guarded["error"] is None, guarded
    assert guarded["max_diff"] <= 2e-6
    assert guarded["events"] == [["backend_fallback", "xformers_missing", True]]
