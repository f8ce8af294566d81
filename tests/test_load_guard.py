"""Load-time guard on real tiny models (Llama, Qwen2, Qwen2.5-VL) with real transformers loading:
``from_pretrained``, ``AutoModel*.from_config``, ``Model(config)`` + ``guard_model``,
``set_attn_implementation``. flash-attn cannot run on this CPU machine, so every
``flash_attention_2`` request keeps transformers' flash code path with its kernel calls computed
by attnguard's SDPA twins (where this release's twins cover the model: registry-based models,
and every model from 4.54), or falls back to transformers' sdpa path: either way the logits are
those of sdpa itself.
"""

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
from conftest import (
    PY,
    TINY_FAMILIES,
    logits_of,
    names,
    subprocess_env,
    tiny_config,
    tiny_inputs,
    tiny_model_class,
)
from packaging.version import Version

import attnguard
from attnguard import AttnGuardError, facts
from attnguard.integrations.transformers import apply
from attnguard.observability import events
from attnguard.plan import LoadRequest, Plan, plan_load

tf_version = Version(transformers.__version__)
FLASH = "flash_attention_2"


def flash_status() -> facts.Backend:
    status = facts.current().backend(FLASH)
    if status.usable:
        pytest.skip("flash-attn is usable here: these tests need it absent or broken")
    return status


def auto_class(family: str) -> Any:
    if family == "qwen2_5_vl":
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModelForCausalLM


def sub_keys(config: Any) -> list[str]:
    return [k for k in config.sub_configs if getattr(config, k, None) is not None]


def attn_everywhere(model: Any) -> set[str]:
    """Every attention implementation named by the model's configs (top, sub-configs, and the
    configs of PreTrainedModel sub-modules)."""
    return {
        getattr(c, "_attn_implementation_internal", None)
        for c in apply.all_configs(model)
        if getattr(c, "_attn_implementation_internal", None) is not None
    }


def only(evts: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in evts if e["event"] == name]


def assert_one_fallback(evts: list[dict[str, Any]], site: str, status: facts.Backend) -> None:
    assert names(evts) == ["backend_fallback"], evts
    (e,) = only(evts, "backend_fallback")
    assert e["site"] == site
    assert e["reason_code"] == status.reason_code
    assert e["requested"] == FLASH
    # attnguard's twins keep the flash path (flash-on-sdpa), or the model loads with sdpa
    assert e["selected"] == ("sdpa_twin" if e["rule"] == "flash-on-sdpa" else "sdpa")
    assert e["applied"] is True
    assert status.reason in e["reason"]


def on_twins(cls: Any) -> bool:
    """This release's SDPA twins carry ``cls``'s flash code path (else: transformers' sdpa)."""
    from attnguard.integrations.transformers import flash_path

    return flash_path.covers(cls)


def expected_attn(cls: Any) -> set[str]:
    return {FLASH} if on_twins(cls) else {"sdpa"}


def assert_same_logits(got: torch.Tensor, want: torch.Tensor, family: str) -> None:
    """The flash path on the SDPA twins computes what sdpa does for every real token: equal up to
    float32 summation order. Padding positions are not compared: flash's path leaves their
    output zero (it unpads the batch), sdpa computes something there; neither is used."""
    real = tiny_inputs(family)["attention_mask"].bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


# --- fix mode: every path computes with SDPA, with the same logits ---------------------------------


@pytest.mark.smoke
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_from_pretrained_flash_runs_on_sdpa(
    family: str, tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    status = flash_status()
    path = tiny_checkpoint(family)
    reference = auto_class(family).from_pretrained(path, attn_implementation="sdpa")
    assert names(captured) == []  # nothing wrong, nothing said
    model = auto_class(family).from_pretrained(path, attn_implementation=FLASH)
    assert type(model) is type(reference)
    assert attn_everywhere(model) == expected_attn(type(model))
    assert_same_logits(logits_of(model, family), logits_of(reference, family), family)
    assert_one_fallback(captured, "transformers.load", status)
    (e,) = only(captured, "backend_fallback")
    assert e["model"] == type(model).__name__
    assert e["rule"] == ("flash-on-sdpa" if on_twins(type(model)) else "flash-unusable")


@pytest.mark.smoke
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_from_config_flash_runs_on_sdpa(
    family: str, guard: Any, captured: list[dict[str, Any]]
) -> None:
    status = flash_status()
    torch.manual_seed(0)
    reference = auto_class(family).from_config(tiny_config(family), attn_implementation="sdpa")
    torch.manual_seed(0)
    model = auto_class(family).from_config(tiny_config(family), attn_implementation=FLASH)
    assert attn_everywhere(model) == expected_attn(type(model))
    assert_same_logits(logits_of(model, family), logits_of(reference, family), family)
    assert_one_fallback(captured, "transformers.from_config", status)


@pytest.mark.smoke
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_model_constructor_and_guard_model_run_on_sdpa(
    family: str, guard: Any, captured: list[dict[str, Any]]
) -> None:
    status = flash_status()
    cls = tiny_model_class(family)
    torch.manual_seed(0)
    reference = cls(tiny_config(family, attn_implementation="sdpa"))
    cfg = tiny_config(family)
    cfg._attn_implementation = FLASH  # 4.5x+: spread over the sub-configs too
    torch.manual_seed(0)
    model = attnguard.guard_model(cls(cfg))
    assert attn_everywhere(model) == expected_attn(cls)
    assert_same_logits(logits_of(model, family), logits_of(reference, family), family)
    assert_one_fallback(captured, "transformers.init", status)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_guard_model_on_a_model_that_got_flash_past_the_gate(
    family: str, guard: Any, captured: list[dict[str, Any]]
) -> None:
    """A model that got flash past the gate (built before activation, or 4.49's
    ``_attn_implementation_autoset`` bypass): guard_model decides for it, and its calls run."""
    status = flash_status()
    torch.manual_seed(0)
    model = tiny_model_class(family)(tiny_config(family, attn_implementation="sdpa"))
    reference = logits_of(model, family)
    for cfg in apply.all_configs(model):
        cfg._attn_implementation_internal = FLASH
    attnguard.guard_model(model)
    assert attn_everywhere(model) == expected_attn(type(model))
    assert_same_logits(logits_of(model, family), reference, family)
    assert_one_fallback(captured, "transformers.init", status)


def fallbacks_counted() -> int:
    """How many backend_fallback occurrences the exit summary would report."""
    return events.summary_fields()["events"].get("backend_fallback", 0)


@pytest.mark.smoke
@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("build", ["constructor", "from_pretrained", "from_config"])
def test_one_model_is_one_fallback_in_the_summary(
    family: str, build: str, tiny_checkpoint: Any, guard: Any
) -> None:
    """A model counts once, however many sub-models its __init__ builds (LlamaModel inside
    LlamaForCausalLM, the towers of a VLM), and guard_model() on it adds nothing; two models
    count twice."""
    flash_status()
    cls = tiny_model_class(family)

    def build_one() -> Any:
        if build == "from_pretrained":
            return auto_class(family).from_pretrained(
                tiny_checkpoint(family), attn_implementation=FLASH
            )
        if build == "from_config":
            return auto_class(family).from_config(tiny_config(family), attn_implementation=FLASH)
        cfg = tiny_config(family)
        cfg._attn_implementation = FLASH
        return cls(cfg)

    model = build_one()
    assert fallbacks_counted() == 1
    attnguard.guard_model(model)
    assert fallbacks_counted() == 1
    build_one()
    assert fallbacks_counted() == 2


@pytest.mark.skipif(tf_version < Version("4.54"), reason="set_attn_implementation exists from 4.54")
@pytest.mark.parametrize("family", ["llama", "qwen2_5_vl"])
def test_set_attn_implementation_flash_runs_on_sdpa(
    family: str, tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    status = flash_status()
    model = auto_class(family).from_pretrained(tiny_checkpoint(family), attn_implementation="eager")
    reference = logits_of(auto_class(family).from_pretrained(tiny_checkpoint(family)), family)
    model.set_attn_implementation(FLASH)
    assert attn_everywhere(model) == expected_attn(type(model))
    assert_same_logits(logits_of(model, family), reference, family)
    assert_one_fallback(captured, "transformers.set_attn_implementation", status)
    if family == "qwen2_5_vl":  # a per-sub-config dict reaches sub-models without the gate
        events.reset_counts()
        captured.clear()
        model.set_attn_implementation({"vision_config": FLASH, "text_config": "eager"})
        vision = FLASH if on_twins(type(model)) else "sdpa"
        assert model.config.vision_config._attn_implementation == vision
        assert model.config.text_config._attn_implementation == "eager"
        (e,) = only(captured, "backend_fallback")
        assert e["target"] == "vision_config"


def test_vlm_sub_configs_are_decided_separately(
    tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    """{vision: flash, text: eager}: only the vision tower is decided; the text keeps eager."""
    status = flash_status()
    path = tiny_checkpoint("qwen2_5_vl")
    cls = tiny_model_class("qwen2_5_vl")
    keys = sub_keys(tiny_config("qwen2_5_vl"))
    other = [k for k in keys if k != "vision_config"]
    request = {"vision_config": FLASH, **{k: "eager" for k in other}}
    vision = FLASH if on_twins(cls) else "sdpa"
    reference = cls.from_pretrained(
        path, attn_implementation={"vision_config": "sdpa", **{k: "eager" for k in other}}
    )
    model = cls.from_pretrained(path, attn_implementation=request)
    visual = getattr(model, "visual", None) or model.model.visual
    assert visual.config._attn_implementation == vision
    for key in other:
        assert getattr(model.config, key)._attn_implementation == "eager"
    assert_same_logits(
        logits_of(model, "qwen2_5_vl"), logits_of(reference, "qwen2_5_vl"), "qwen2_5_vl"
    )
    assert names(captured) == ["backend_fallback"]
    (e,) = only(captured, "backend_fallback")
    assert (e["target"], e["reason_code"]) == ("vision_config", status.reason_code)


# --- warn / strict / off --------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2_5_vl"])
def test_strict_mode_raises_before_loading(
    family: str, tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    status = flash_status()
    guard(mode="strict")
    path = tiny_checkpoint(family)
    with pytest.raises(AttnGuardError) as err:
        auto_class(family).from_pretrained(path, attn_implementation=FLASH)
    assert err.value.reason_code == status.reason_code
    assert "SDPA twins" in err.value.remedy or "sdpa" in err.value.remedy
    assert "attnguard would" not in str(err.value)  # the refusal does not claim to load anything
    with pytest.raises(AttnGuardError):
        auto_class(family).from_config(tiny_config(family), attn_implementation=FLASH)
    cfg = tiny_config(family)
    cfg._attn_implementation = FLASH
    with pytest.raises(AttnGuardError):
        tiny_model_class(family)(cfg)
    fallbacks = only(captured, "backend_fallback")
    assert fallbacks and all(e["applied"] is False for e in fallbacks)


@pytest.mark.parametrize("family", ["llama", "qwen2_5_vl"])
def test_warn_mode_reports_and_leaves_transformers_error(
    family: str, tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    status = flash_status()
    guard(mode="warn")
    with pytest.raises(Exception) as err:
        auto_class(family).from_pretrained(tiny_checkpoint(family), attn_implementation=FLASH)
    assert not isinstance(err.value, AttnGuardError)
    if status.reason_code == facts.PACKAGE_MISSING:
        assert isinstance(err.value, ImportError)
        assert "flash" in str(err.value).lower()
    assert names(captured) == ["backend_fallback"]
    (e,) = only(captured, "backend_fallback")
    assert e["applied"] is False and e["mode"] == "warn"
    assert e["site"] == "transformers.load"


def test_off_and_deactivated_change_nothing(tiny_checkpoint: Any) -> None:
    flash_status()
    path = tiny_checkpoint("llama")
    originals = {k: v for k, v in vars(transformers.PreTrainedModel).items()}
    with events.capture() as got:
        attnguard.activate(log="none", mode="off")
        with pytest.raises(ImportError):
            transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=FLASH)
        attnguard.activate(log="none")
        transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=FLASH)
        attnguard.deactivate()
        with pytest.raises(ImportError):
            transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=FLASH)
    assert names(got) == ["backend_fallback"]
    for attr in remedies_patched():
        assert vars(transformers.PreTrainedModel)[attr] is originals[attr]


def remedies_patched() -> list[str]:
    from attnguard.integrations.transformers import loading as transformers_loading

    return [a for a, _ in transformers_loading._TARGETS if a in vars(transformers.PreTrainedModel)]


@pytest.mark.smoke
def test_patches_land_on_every_entry_point_and_come_off(guard: Any) -> None:
    from attnguard.integrations.transformers import loading as transformers_loading

    patched = {r.attr for r in transformers_loading.ledger.records}
    gate = (
        "_autoset_attn_implementation"
        if tf_version < Version("4.54")
        else "_check_and_adjust_attn_implementation"
    )
    assert {"from_pretrained", "_from_config", gate} <= patched
    attnguard.deactivate()
    assert transformers_loading.ledger.records == []
    for attr in remedies_patched():
        assert "FunctionWrapper" not in type(vars(transformers.PreTrainedModel)[attr]).__name__


# --- nothing wrong: no intervention, no event ------------------------------------------------------


@pytest.mark.smoke
@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("attn", [None, "sdpa", "eager"])
def test_nothing_wrong_means_no_event_and_same_model(
    family: str, attn: str | None, tiny_checkpoint: Any, captured: list[dict[str, Any]]
) -> None:
    path = tiny_checkpoint(family)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    unguarded = auto_class(family).from_pretrained(path, **kwargs)
    attnguard.activate(log="none")
    guarded = auto_class(family).from_pretrained(path, **kwargs)
    torch.manual_seed(0)
    built = attnguard.guard_model(tiny_model_class(family)(tiny_config(family, **kwargs)))
    from_config = auto_class(family).from_config(tiny_config(family), **kwargs)
    assert names(captured) == []
    assert attn_everywhere(guarded) == attn_everywhere(unguarded)
    assert {p.dtype for p in guarded.parameters()} == {p.dtype for p in unguarded.parameters()}
    assert {p.device for p in guarded.parameters()} == {torch.device("cpu")}
    assert torch.equal(logits_of(guarded, family), logits_of(unguarded, family))
    assert FLASH not in attn_everywhere(built) | attn_everywhere(from_config)


# --- disabled remedy, fail-open, retries -----------------------------------------------------------


def test_disabled_fallback_only_observes(
    tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    status = flash_status()
    guard(disable="fallback")
    with pytest.raises(Exception) as err:
        transformers.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoint("llama"), attn_implementation=FLASH
        )
    assert not isinstance(err.value, AttnGuardError)
    assert names(captured) == ["observed"]
    (e,) = only(captured, "observed")
    assert e["reason_code"] == status.reason_code and "disabled" in e["reason"]


def test_internal_failure_is_reported_and_the_original_runs(
    tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]], monkeypatch: Any
) -> None:
    def broken(settings: Any = None) -> facts.Facts:
        raise RuntimeError("facts exploded")

    monkeypatch.setattr(facts, "current", broken)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("llama"), attn_implementation="sdpa"
    )
    assert model.config._attn_implementation == "sdpa"
    errors = only(captured, "internal_error")
    assert len(errors) == 1 and errors[0]["reason_code"] == "RuntimeError"
    assert errors[0]["location"].startswith("attnguard/integrations/transformers/apply.py:")
    assert "facts exploded" not in json.dumps(errors[0])  # the type and place, not the text


def test_a_load_failing_with_injected_kwargs_is_retried_unchanged(
    tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]], monkeypatch: Any
) -> None:
    """Fail-open: a plan whose kwargs break the load (here: a device that does not exist) is
    reported and the caller's own call runs."""
    flash_status()
    bad = Plan(LoadRequest(attn_implementation="sdpa"), device="cuda:7")
    monkeypatch.setattr(apply, "plan_load", lambda *a, **k: _with_change(bad))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("llama"), attn_implementation="sdpa"
    )
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert any(e["site"] == "transformers.load.remedy" for e in only(captured, "internal_error"))


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


def _with_change(plan: Plan) -> Plan:
    from dataclasses import replace

    from attnguard.plan import Action

    action = Action(
        rule="place-gpu",
        event="model_placed",
        reason_code="flash_needs_gpu",
        problem="test",
        remedy="place",
        target="",
        before="cpu",
        after="cuda:7",
    )
    return replace(plan, actions=(action,))


# --- facts injected: what the guard would do on a GPU box, checked through the real wrapper -------


@pytest.mark.smoke
@pytest.mark.parametrize("ckpt_dtype", ["float32", "bfloat16"])
def test_strict_mode_names_the_gpu_remedy_from_the_checkpoint_dtype(
    ckpt_dtype: str,
    tiny_checkpoint: Any,
    guard: Any,
    captured: list[dict[str, Any]],
    monkeypatch: Any,
) -> None:
    """With H100 facts injected, strict mode stops the load before any weight with the remedy fix
    mode would apply: the cast for an fp32 load (4.x default, or a 5.x "auto" fp32 checkpoint),
    else the placement on cuda:0."""
    h100 = facts.synthetic(((9, 0),), installed={FLASH: "2.8.3"}, gpu_name="H100")
    monkeypatch.setattr(facts, "current", lambda settings=None: h100)
    guard(mode="strict")
    with pytest.raises(AttnGuardError) as err:
        transformers.AutoModelForCausalLM.from_pretrained(
            tiny_checkpoint("qwen2", ckpt_dtype), attn_implementation=FLASH
        )
    loads_fp32 = tf_version < Version("5") or ckpt_dtype == "float32"
    assert err.value.reason_code == "flash_needs_gpu"  # the first change: the placement
    planned = [(e["event"], e["reason_code"]) for e in captured if e["event"] != "activated"]
    assert ("model_placed", "flash_needs_gpu") in planned
    assert (("model_cast", "flash_needs_half") in planned) == loads_fp32


def test_load_kwargs_use_the_dtype_keyword_of_this_version() -> None:
    h100 = facts.synthetic(((9, 0),), installed={FLASH: "2.8.3"})
    request = LoadRequest(model="M", attn_implementation=FLASH, dtype=None)
    plan = plan_load(request, h100, attnguard.Settings())
    new = apply.load_kwargs(plan, {"attn_implementation": FLASH})
    key = "torch_dtype" if tf_version < Version("4.56") else "dtype"
    assert new[key] is torch.bfloat16 and new["device_map"] == {"": "cuda:0"}
    assert new["attn_implementation"] == FLASH
    if tf_version >= Version("4.56"):  # the caller's own (deprecated) spelling is kept
        kept = apply.load_kwargs(plan, {"torch_dtype": torch.float32})
        assert kept["torch_dtype"] is torch.bfloat16 and "dtype" not in kept


# --- a real broken install: flash-attn built from the PyPI sdist without its CUDA extension --------

BROKEN_DIR = os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR")

_BROKEN_SCRIPT = textwrap.dedent(
    """
    import json, sys, tempfile, torch, transformers
    import attnguard
    from attnguard.observability import events
    from attnguard import facts
    from conftest import tiny_config, tiny_inputs, tiny_model_class, logits_of
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
