"""The load-time guard where a load fails: the caller's own load errors (a missing checkpoint or
dependency, an invalid device_map, out of memory inside a changed load) propagate once, at once,
never as ``internal_error`` nor retried; an internal error event never carries the exception's
text; a real broken flash-attn install (built without its CUDA extension) falls back with the
import error. Real tiny models, as in tests/test_load_guard.py."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from helpers.events import only
from helpers.packages import flash_status
from helpers.processes import PY, subprocess_env
from packaging.version import Version

import attnguard
from attnguard import facts
from attnguard.integrations.transformers import apply
from attnguard.plan import LoadRequest, Plan

tf_version = Version(transformers.__version__)
FLASH = "flash_attention_2"


# --- the caller's own load errors: propagate once, at once, never internal_error ---------------


def _cast_plan(*_a: Any, **_k: Any) -> Plan:
    """A plan that changes the load (a bf16 cast), so a failure could in principle be ours."""
    from dataclasses import replace

    from attnguard.plan import Action

    cast = Action(
        rule="fp32-cast",
        event="model_cast",
        reason_code="flash_needs_half",
        problem="test",
        remedy="cast",
        target="",
        before="f32",
        after="bf16",
    )
    return replace(Plan(LoadRequest(attn_implementation="sdpa"), dtype="bfloat16"), actions=(cast,))


@pytest.mark.parametrize(
    ("error", "loads", "internal"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), 1, 0),
        # control: an error the cast can have caused is reported and the caller's call retried
        (RuntimeError("expected scalar type BFloat16 but found Float"), 2, 1),
    ],
)
def test_out_of_memory_inside_a_changed_load_is_not_retried(
    error: Exception,
    loads: int,
    internal: int,
    tiny_checkpoint: Any,
    guard: Any,
    captured: list[dict[str, Any]],
    monkeypatch: Any,
) -> None:
    calls = []

    def failing(*_a: Any, **_k: Any) -> Any:
        calls.append(1)
        raise error

    monkeypatch.setattr(apply, "plan_load", _cast_plan)
    monkeypatch.setattr(transformers.PreTrainedModel, "_load_pretrained_model", failing)
    with pytest.raises(type(error)) as got:
        transformers.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoint("llama"), attn_implementation="sdpa"
        )
    assert got.value is error  # the caller sees the load's own error, unchanged
    assert len(calls) == loads  # OOM: once, at once; no second load of a model that won't fit
    assert len(only(captured, "internal_error")) == internal


def test_a_missing_checkpoint_is_the_callers_error(
    tmp_path: Path, guard: Any, captured: list[dict[str, Any]]
) -> None:
    missing = tmp_path / "no-such-model"
    attnguard.deactivate()
    with pytest.raises(Exception) as plain:  # OSError, or HFValidationError on some releases
        transformers.AutoModelForCausalLM.from_pretrained(missing, attn_implementation=FLASH)
    guard()
    with pytest.raises(Exception) as guarded:
        transformers.AutoModelForCausalLM.from_pretrained(missing, attn_implementation=FLASH)
    assert type(guarded.value) is type(plain.value) and str(guarded.value) == str(plain.value)
    assert only(captured, "internal_error") == []


def test_a_missing_dependency_of_the_callers_own_arguments_is_theirs() -> None:
    """transformers' own message for ``device_map="auto"`` without accelerate: the caller's
    device_map, so not ours (no retry); the same message after attnguard injected a device_map
    is ours (retried with the caller's own call)."""
    msg = (
        "Using a `device_map`, `tp_plan`, `torch.device` context manager or setting "
        "`torch.set_default_device(device)` requires `accelerate`. You can install it with "
        "`pip install accelerate`"
    )
    caller = {"device_map": "auto"}
    assert not apply.could_be_ours(ValueError(msg), caller, {**caller, "dtype": "bf16"})
    assert apply.could_be_ours(ValueError(msg), {}, {"device_map": {"": "cuda:0"}})
    oom = torch.OutOfMemoryError("CUDA out of memory")
    assert not apply.could_be_ours(oom, {}, {"device_map": {"": "cuda:0"}})
    assert not apply.could_be_ours(FileNotFoundError("config.json"), {}, {"dtype": "bf16"})


def test_the_callers_invalid_device_map_is_theirs_once_and_never_in_an_event(
    tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]], monkeypatch: Any
) -> None:
    """flash_attention_2 (attnguard keeps its flash path on the twins here) with a
    device string of the caller's that transformers rejects. The error is about their
    device_map, which attnguard did not change: it propagates at once, the model is built once,
    no internal_error, and nothing the caller passed shows up in an event."""
    flash_status()
    path = tiny_checkpoint("llama")
    builds = []
    real_init = transformers.LlamaForCausalLM.__init__

    def counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
        builds.append(1)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(transformers.LlamaForCausalLM, "__init__", counting_init)
    secret = "cpu:token=hf_SECRET123"
    with pytest.raises(Exception) as err:
        transformers.AutoModelForCausalLM.from_pretrained(
            path,
            attn_implementation="flash_attention_2",
            device_map={"": secret},
        )
    assert secret in str(err.value)  # transformers' own words about the caller's device string
    assert len(builds) <= 1  # never a second build for the caller's own mistake
    assert only(captured, "internal_error") == []
    assert "SECRET" not in json.dumps(captured, default=str)


def test_an_internal_error_event_never_carries_the_exception_text(
    guard: Any, captured: list[dict[str, Any]]
) -> None:
    from attnguard.failopen import report_internal_error

    try:
        {}["/home/alice/private/model-token=hf_SECRET123"]
    except KeyError as exc:
        report_internal_error("transformers.load", exc)
    (ev,) = only(captured, "internal_error")
    assert ev["reason_code"] == "KeyError" and ev["error_type"] == "builtins.KeyError"
    assert ev["location"] == "unknown"  # raised outside attnguard's own code
    assert "SECRET" not in json.dumps(ev) and "alice" not in json.dumps(ev)


# --- a real broken install: flash-attn built from the PyPI sdist without its CUDA extension --------

BROKEN_DIR = os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR")

_BROKEN_SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile, torch, transformers
    import attnguard
    from attnguard.observability import events
    from attnguard import facts
    from helpers.models import logits_of, tiny_config, tiny_inputs, tiny_model_class
    out = {"transformers": transformers.__version__}
    status = facts.current().backend("flash_attention_2")
    out["status"] = [status.reason_code, status.reason]
    torch.manual_seed(0)
    path = tempfile.mkdtemp()
    tiny_model_class("llama")(tiny_config("llama")).save_pretrained(path)
    auto = transformers.AutoModelForCausalLM
    attnguard.deactivate()
    try:  # what transformers itself does with the broken install on this CPU machine
        m = auto.from_pretrained(path, attn_implementation="flash_attention_2")
        out["unguarded"] = ["loaded", m.config._attn_implementation]
        logits_of(m, "llama")
    except Exception as exc:
        out["unguarded"] = out.get("unguarded", []) + [type(exc).__name__, str(exc)[:200]]
    attnguard.activate(log="none")
    ref = logits_of(auto.from_pretrained(path, attn_implementation="sdpa"), "llama")
    with events.capture() as got:
        m = auto.from_pretrained(path, attn_implementation="flash_attention_2")
        real = tiny_inputs("llama")["attention_mask"].bool()  # flash leaves padding rows zero
        lg = logits_of(m, "llama")
        out["close"] = bool(torch.allclose(lg[real], ref[real], atol=2e-5, rtol=1e-4))
        from attnguard.integrations.transformers import flash_path
        on_twins = flash_path.covers(type(m))
        out["expected_attn"] = "flash_attention_2" if on_twins else "sdpa"
        out["attn"] = m.config._attn_implementation
        torch.manual_seed(0)
        cfg = tiny_config("llama")
        cfg._attn_implementation = "flash_attention_2"
        out["ctor_attn"] = attnguard.guard_model(tiny_model_class("llama")(cfg)).config._attn_implementation
    out["events"] = [[e["event"], e["site"], e["reason_code"], e["reason"]] for e in got]
    print("RESULT" + json.dumps(out))
    """
)


def test_broken_flash_attn_install_falls_back_with_the_import_error() -> None:
    extra = BROKEN_DIR
    if extra is None:
        if facts.current().backend(FLASH).reason_code != facts.EXTENSION_BROKEN:
            pytest.skip(
                "no broken flash-attn install: build one with FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE "
                "FLASH_ATTENTION_FORCE_BUILD=TRUE pip install --no-build-isolation --no-deps "
                "--target DIR flash-attn==2.8.3 and set TEST_BROKEN_FLASH_ATTN_DIR=DIR"
            )
        extra = ""
    env = subprocess_env(ATTNGUARD_LOG="none")
    tests_dir = os.path.dirname(__file__)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra, tests_dir, env["PYTHONPATH"]) if p)
    res = subprocess.run([PY, "-c", _BROKEN_SCRIPT], env=env, capture_output=True, text=True)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    assert res.returncode == 0 and line, res.stderr[-3000:]
    out = json.loads(line[0][len("RESULT") :])
    assert out["status"][0] == facts.EXTENSION_BROKEN
    assert "No module named 'flash_attn_2_cuda'" in out["status"][1]
    # transformers alone fails somewhere (which error depends on the version, see facts.py)
    assert len(out["unguarded"]) >= 2 and out["unguarded"][-2].endswith("Error")
    assert out["close"] is True
    assert out["attn"] == out["ctor_attn"] == out["expected_attn"]
    fallbacks = [e for e in out["events"] if e[0] == "backend_fallback"]
    assert [e[1] for e in fallbacks] == ["transformers.load", "transformers.init"]
    assert all(e[2] == facts.EXTENSION_BROKEN for e in fallbacks)
    assert all("No module named 'flash_attn_2_cuda'" in e[3] for e in fallbacks)
