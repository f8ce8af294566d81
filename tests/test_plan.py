"""The pure load-time planner as a table, on injected facts (tests/helpers/plans.py): families A
and E on GPUs that run flash, family B below sm80, family C (several processes spreading a
device_map), an explicit choice, several ranks, deliberate-init contexts, quantization and
explicit placement, models built in code, disabled remedies, nothing wrong; every row of
plan.TABLE exercised; reasons; fp32_policy=fallback. Flash-attn missing, broken or elsewhere and
VLM sub-config requests: tests/test_plan_flash_state.py; ``attnguard doctor``, which prints the
same planner's answer: tests/test_doctor_plan.py."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from helpers.plans import (
    CAST_H100,
    FLASH,
    PLACE,
    TW,
    VERL_RANK0,
    S,
    check_case,
    machine,
    req,
    summary,
    twins,
)

from attnguard import facts as F
from attnguard.config import Settings
from attnguard.observability import events
from attnguard.plan import TABLE, LoadRequest, plan_backend, plan_load

# (id, facts, request, settings, expected actions as (rule, event, reason_code), load with)
# "load with" = (attn_implementation, kernels, dtype to inject, device to place on)
CASES: list[tuple[str, F.Facts, LoadRequest, Settings, list[tuple[str, str, str]], tuple]] = [
    # --- family A / E on GPUs that run flash: nobody chose the dtype -----------------------------
    (
        "H100 fp32 no device_map",
        machine("H100"),
        req(),
        S,
        [PLACE, CAST_H100],
        (FLASH, None, "bfloat16", "cuda:0"),
    ),
    (
        "A100 fp32 no device_map",
        machine("A100"),
        req(),
        S,
        [PLACE, CAST_H100],
        (FLASH, None, "bfloat16", "cuda:0"),
    ),
    (
        "H100 bf16 no device_map (family A only)",
        machine("H100"),
        req(dtype="bfloat16"),
        S,
        [PLACE],
        (FLASH, None, None, "cuda:0"),
    ),
    (
        "H100 5.x auto dtype, fp32 checkpoint",
        machine("H100"),
        req(default_dtype="auto", checkpoint_dtype="float32"),
        S,
        [PLACE, CAST_H100],
        (FLASH, None, "bfloat16", "cuda:0"),
    ),
    (
        "H100 5.x auto dtype, bf16 checkpoint",
        machine("H100"),
        req(default_dtype="auto", checkpoint_dtype="bfloat16"),
        S,
        [PLACE],
        (FLASH, None, None, "cuda:0"),
    ),
    (
        "H100 dtype='auto' passed, fp32 checkpoint: 'auto' is not a choice of float32",
        machine("H100"),
        req(dtype="auto", checkpoint_dtype="float32"),
        S,
        [PLACE, CAST_H100],
        (FLASH, None, "bfloat16", "cuda:0"),
    ),
    (
        "H100 auto dtype, checkpoint dtype unknown: no cast",
        machine("H100"),
        req(dtype="auto"),
        S,
        [PLACE],
        (FLASH, None, None, "cuda:0"),
    ),
    (
        "H100 fp32, ATTNGUARD_DTYPE=fp16",
        machine("H100"),
        req(),
        Settings(dtype="fp16"),
        [PLACE, CAST_H100],
        (FLASH, None, "float16", "cuda:0"),
    ),
    (
        "H100 fp32, ATTNGUARD_FP32_POLICY=fallback: float32 on the GPU with sdpa",
        machine("H100"),
        req(),
        Settings(fp32_policy="fallback"),
        [PLACE, ("fp32-fallback", "backend_fallback", "flash_needs_half")],
        ("sdpa", None, None, "cuda:0"),
    ),
    (
        "H100 flash_attention_3 usable, fp32",
        machine("H100", flash=None, installed_extra={"flash_attention_3": "3.0.0"}),
        req(attn_implementation="flash_attention_3"),
        S,
        [PLACE, CAST_H100],
        ("flash_attention_3", None, "bfloat16", "cuda:0"),
    ),
    # --- an explicit choice stands ----------------------------------------------------------------
    (
        "H100 dtype=float32 passed: stands, the call-time guard carries flash",
        machine("H100"),
        req(dtype="float32", dtype_explicit=True),
        S,
        [PLACE, ("explicit-dtype", "observed", "explicit_dtype")],
        (FLASH, None, None, "cuda:0"),
    ),
    (
        "H100 fp32, one process, Trainer imported (a training script): placed, dtype stands",
        machine("H100", init=F.InitContext(training_script=True)),
        req(),
        S,
        [PLACE, ("training-script", "observed", "training_script")],
        (FLASH, None, None, "cuda:0"),
    ),
    (
        "H100 bf16 checkpoint, a training script: nothing wrong, nothing said",
        machine("H100", init=F.InitContext(training_script=True)),
        req(dtype="bfloat16"),
        S,
        [PLACE],
        (FLASH, None, None, "cuda:0"),
    ),
    (
        "H100 fp32 explicit device_map=auto (one process): the caller's map is on the GPU",
        machine("H100"),
        req(device_map="auto"),
        S,
        [CAST_H100],
        (FLASH, None, "bfloat16", None),
    ),
    (
        "H100 bf16 explicit device_map: nothing wrong",
        machine("H100"),
        req(dtype="bfloat16", device_map={"": "cuda:0"}),
        S,
        [],
        (FLASH, None, None, None),
    ),
    (
        "H100 fp32 device_map='cpu': kept on the CPU, no cast",
        machine("H100"),
        req(device_map="cpu"),
        S,
        [("explicit-placement", "observed", "explicit_placement")],
        (FLASH, None, None, None),
    ),
    (
        "H100 fp32 inside torch.device('cpu'): placement and dtype stand",
        machine("H100", init=VERL_RANK0),
        req(),
        S,
        [("explicit-placement", "observed", "explicit_placement")],
        (FLASH, None, None, None),
    ),
    (
        "H100 fp32 inside torch.device('cuda:0'): already on the GPU, cast",
        machine("H100", init=F.InitContext(default_device="cuda:0", device_context="cuda:0")),
        req(),
        S,
        [CAST_H100],
        (FLASH, None, "bfloat16", None),
    ),
    (
        "H100 fp32 tp_plan: on the GPUs by the caller",
        machine("H100"),
        req(placement="tp_plan"),
        S,
        [CAST_H100],
        (FLASH, None, "bfloat16", None),
    ),
    # --- several ranks: never a dtype decision that could differ between ranks ----------------
    (
        "verl rank 0: torch.device('cpu') + dtype=float32, 2 ranks",
        machine("H100", n=2, init=VERL_RANK0, launch=F.Launch(0, 0, 2)),
        req(dtype="float32", dtype_explicit=True),
        S,
        [
            ("explicit-placement", "observed", "explicit_placement"),
            ("explicit-dtype", "observed", "explicit_dtype"),
        ],
        (FLASH, None, None, None),
    ),
    (
        "verl rank 1: init_empty_weights + dtype=float32, 2 ranks",
        machine("H100", n=2, init=F.InitContext(meta=True), launch=F.Launch(1, 1, 2)),
        req(dtype="float32", dtype_explicit=True),
        S,
        [
            ("deliberate-init", "observed", "meta_init"),
            ("deliberate-init", "observed", "meta_init"),
        ],
        (FLASH, None, None, None),
    ),
    (
        "DDP rank 1, nobody chose the dtype: placed, dtype left to the call-time guard",
        machine("H100", n=2, launch=F.Launch(1, 1, 2)),
        req(),
        S,
        [
            ("place-gpu", "model_placed", "flash_needs_gpu"),
            ("ranks-agree", "observed", "multi_rank"),
        ],
        (FLASH, None, None, "cuda:1"),
    ),
    # --- family B: below sm80: flash's path on the SDPA twins, in fp16 on the GPU -------------
    (
        "V100 fp32: the run flash would have had (fp16 on the GPU)",
        machine("V100"),
        req(),
        S,
        [twins("capability_too_low"), PLACE, CAST_H100],
        (FLASH, TW, "float16", "cuda:0"),
    ),
    (
        "V100 bf16: fp16",
        machine("V100"),
        req(dtype="bfloat16"),
        S,
        [twins("capability_too_low"), PLACE, ("bf16-no-native", "model_cast", "no_native_bf16")],
        (FLASH, TW, "float16", "cuda:0"),
    ),
    (
        "T4 bf16: fp16",
        machine("T4"),
        req(dtype="bfloat16"),
        S,
        [twins("capability_too_low"), PLACE, ("bf16-no-native", "model_cast", "no_native_bf16")],
        (FLASH, TW, "float16", "cuda:0"),
    ),
    (
        "T4 bf16, ATTNGUARD_DTYPE=bf16 insists",
        machine("T4"),
        req(dtype="bfloat16"),
        Settings(dtype="bf16"),
        [twins("capability_too_low"), PLACE],
        (FLASH, TW, None, "cuda:0"),
    ),
    (
        "T4 fp16: backend and placement",
        machine("T4"),
        req(dtype="float16"),
        S,
        [twins("capability_too_low"), PLACE],
        (FLASH, TW, None, "cuda:0"),
    ),
    # --- deliberate init, quantized, explicit placement: observe only -----------------------------
    (
        "H100 fp32 under ZeRO-3",
        machine("H100", init=F.InitContext(zero3=True)),
        req(),
        S,
        [("deliberate-init", "observed", "zero3_init")] * 2,
        (FLASH, None, None, None),
    ),
    (
        "H100 fp32 under FSDP",
        machine("H100", init=F.InitContext(fsdp=True)),
        req(),
        S,
        [("deliberate-init", "observed", "fsdp_init")] * 2,
        (FLASH, None, None, None),
    ),
    (
        "H100 bf16 under meta init",
        machine("H100", init=F.InitContext(meta=True)),
        req(dtype="bfloat16"),
        S,
        [("deliberate-init", "observed", "meta_init")],
        (FLASH, None, None, None),
    ),
    (
        "no GPU under ZeRO-3: the backend still falls back (no move, no cast)",
        machine(None, flash=None, init=F.InitContext(zero3=True)),
        req(),
        S,
        [twins("package_missing")],
        (FLASH, TW, None, None),
    ),
    (
        "H100 fp32 quantized",
        machine("H100"),
        req(quantized=True),
        S,
        [("quantized", "observed", "quantized")] * 2,
        (FLASH, None, None, None),
    ),
    (
        "H100 default device already cuda: nothing to place",
        machine("H100", init=F.InitContext(default_device="cuda:0")),
        req(dtype="bfloat16"),
        S,
        [],
        (FLASH, None, None, None),
    ),
    (
        "accelerate missing: no device_map placement, no cast",
        machine("H100", accelerate=False),
        req(),
        S,
        [("place-impossible", "observed", "accelerate_missing")],
        (FLASH, None, None, None),
    ),
    (
        "a model larger than the GPU is not placed",
        machine("H100", gpu_memory=80 * 2**30),
        req(dtype="bfloat16", model_bytes=100 * 2**30),
        S,
        [("place-impossible", "observed", "model_too_large")],
        (FLASH, None, None, None),
    ),
    (
        "LOCAL_RANK beyond the visible GPUs",
        machine("H100", n=2, launch=F.Launch(3, 3, 4)),
        req(dtype="bfloat16"),
        S,
        [("place-impossible", "observed", "no_gpu_for_rank")],
        (FLASH, None, None, None),
    ),
    (
        "LOCAL_RANK 1 of 2 GPUs",
        machine("H100", n=2, launch=F.Launch(1, 1, 2)),
        req(dtype="bfloat16"),
        S,
        [PLACE],
        (FLASH, None, None, "cuda:1"),
    ),
    (
        "LOCAL_RANK 3 with one visible GPU (CUDA_VISIBLE_DEVICES per rank)",
        machine("H100", launch=F.Launch(3, 3, 4)),
        req(dtype="bfloat16"),
        S,
        [PLACE],
        (FLASH, None, None, "cuda:0"),
    ),
    # --- built models (guard_model) ----------------------------------------------------------------
    (
        "built on CPU in fp32",
        machine("A100"),
        req(site="transformers.init", device="cpu", dtype="float32"),
        S,
        [PLACE, CAST_H100],
        (FLASH, None, "bfloat16", "cuda:0"),
    ),
    (
        "built on the GPU in bf16",
        machine("A100"),
        req(site="transformers.init", device="cuda:0", dtype="bfloat16"),
        S,
        [],
        (FLASH, None, None, None),
    ),
    (
        "built on meta",
        machine("A100"),
        req(site="transformers.init", device="meta", dtype="float32"),
        S,
        [("deliberate-init", "observed", "meta_init")],
        (FLASH, None, None, None),
    ),
    (
        "built under accelerate hooks",
        machine("A100"),
        req(site="transformers.init", device="cpu", dtype="float32", placement="accelerate hooks"),
        S,
        [("explicit-placement", "observed", "explicit_placement")],
        (FLASH, None, None, None),
    ),
    # --- disabled remedies -------------------------------------------------------------------------
    (
        "fallback disabled",
        machine(None, flash=None),
        req(),
        Settings(disable=frozenset({"fallback"})),
        [("remedy-disabled", "observed", "package_missing")],
        (FLASH, None, None, None),
    ),
    (
        "cast disabled",
        machine("H100"),
        req(),
        Settings(disable=frozenset({"cast"})),
        [PLACE, ("remedy-disabled", "observed", "flash_needs_half")],
        (FLASH, None, None, "cuda:0"),
    ),
    (
        "place disabled: stays on the CPU, so no cast either",
        machine("H100"),
        req(),
        Settings(disable=frozenset({"place"})),
        [("remedy-disabled", "observed", "flash_needs_gpu")],
        (FLASH, None, None, None),
    ),
    (
        "cast disabled on a T4 with bf16",
        machine("T4"),
        req(dtype="bfloat16"),
        Settings(disable=frozenset({"cast"})),
        [twins("capability_too_low"), PLACE, ("remedy-disabled", "observed", "no_native_bf16")],
        (FLASH, TW, None, "cuda:0"),
    ),
    (
        "fallback disabled with fp32_policy=fallback",
        machine("H100"),
        req(),
        Settings(fp32_policy="fallback", disable=frozenset({"fallback"})),
        [PLACE, ("remedy-disabled", "observed", "flash_needs_half")],
        (FLASH, None, None, "cuda:0"),
    ),
    # --- family C: several processes with a spreading device_map (attnguard.plan.device_map) ------------
    (
        "torchrun x2, device_map=auto: one replica per rank",
        machine("H100", n=2, launch=F.Launch(1, 1, 2)),
        req(attn_implementation="sdpa", dtype="bfloat16", device_map="auto"),
        S,
        [("device-map-per-rank", "device_map_rewritten", "device_map_per_rank")],
        ("sdpa", None, None, None),
    ),
    (
        "torchrun x2, device_map=auto, device_map remedy disabled",
        machine("H100", n=2, launch=F.Launch(1, 1, 2)),
        req(attn_implementation="sdpa", dtype="bfloat16", device_map="auto"),
        Settings(disable=frozenset({"device_map"})),
        [("remedy-disabled", "observed", "device_map_per_rank")],
        ("sdpa", None, None, None),
    ),
    # --- nothing wrong ----------------------------------------------------------------------------
    (
        "sdpa on H100",
        machine("H100"),
        req(attn_implementation="sdpa"),
        S,
        [],
        ("sdpa", None, None, None),
    ),
    (
        "default backend, no GPU",
        machine(None),
        req(attn_implementation=None),
        S,
        [],
        (None, None, None, None),
    ),
    (
        "eager in fp32 on V100",
        machine("V100"),
        req(attn_implementation="eager"),
        S,
        [],
        ("eager", None, None, None),
    ),
]


@pytest.mark.smoke
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decision_table(case: tuple) -> None:
    check_case(case)


@pytest.mark.smoke
def test_every_table_row_is_exercised() -> None:
    from test_plan_flash_state import CASES as FLASH_STATE  # the table's other half

    cases = [*CASES, *FLASH_STATE]
    seen = {a.rule for _n, f, r, s, _e, _w in cases for a in plan_load(r, f, s).actions}
    assert seen == {r.id for r in TABLE}


def test_rows_declare_their_remedy_names() -> None:
    from attnguard.config import REMEDIES

    for row in TABLE:
        assert (row.event == "observed") == (row.remedy is None)
        assert row.remedy is None or row.remedy in REMEDIES


def test_reasons_name_the_hardware_and_the_cause() -> None:
    plan = plan_load(req(dtype="bfloat16"), machine("V100"), S)
    fallback, _place, cast = plan.actions
    assert "7.0" in fallback.reason() and "8.0" in fallback.reason()
    assert "SDPA twins" in fallback.reason()
    assert "V100" in cast.reason() and "float16" in cast.reason()
    broken = F.PackageState(True, "2.8.3", import_error="ImportError: undefined symbol: _ZN3c10")
    (action,) = plan_load(req(), machine(None, flash=broken), S).actions
    assert "undefined symbol: _ZN3c10" in action.reason()


def test_reasons_say_what_each_mode_did() -> None:
    """fix says what was done; warn and strict say what would have been, never that it was."""
    (action,) = plan_load(req(), machine(None, flash=None), S).actions
    assert "attnguard: keep transformers' flash code path" in action.reason("fix")
    for mode in ("warn", "strict"):
        text = action.reason(mode)
        assert "attnguard would keep transformers' flash code path" in text
        assert f"({mode} mode: not applied)" in text
    (observed,) = plan_load(
        req(dtype="float32", dtype_explicit=True), machine("H100", accelerate=False), S
    ).observations[-1:]
    assert observed.reason("warn") == observed.reason("fix")  # an observation is one sentence
    assert "dtype=float32 was passed explicitly" in observed.reason()
    assert "load with dtype=torch.bfloat16" in observed.reason()


def test_device_map_rewrite_uses_the_multigpu_planner() -> None:
    f = machine("H100", n=2, launch=F.Launch(1, 1, 2))
    plan = plan_load(req(attn_implementation="sdpa", device_map="auto"), f, S)
    assert plan.device_map == {"": "cuda:1"}
    (action,) = plan.actions
    assert action.after["device_map"] == {"": "cuda:1"}
    # one process: "auto" is deliberate model parallelism, left alone
    single = plan_load(req(attn_implementation="sdpa", device_map="auto"), machine("H100", n=2), S)
    assert single.actions == () and single.device_map is None


def test_backend_only_planning_ignores_dtype_and_placement() -> None:
    plan = plan_backend(req(), machine("H100"), S)
    assert plan.actions == () and plan.dtype is None and plan.device is None
    plan = plan_backend(req(), machine("V100"), S)
    assert summary(plan) == [("flash-on-sdpa", "backend_fallback", "capability_too_low")]
    assert plan.kernels == "sdpa" and plan.attn_implementation == FLASH


def test_planner_is_pure() -> None:
    f, r = machine("H100"), req()
    with events.capture() as got:
        first = plan_load(r, f, S)
        second = plan_load(r, f, S)
    assert first == second and got == []
    assert json.loads(json.dumps(first.as_dict(), default=str))["dtype"] == "bfloat16"


def test_effective_dtype() -> None:
    assert req(dtype=None).effective_dtype == "float32"
    assert req(dtype="auto", checkpoint_dtype="bfloat16").effective_dtype == "bfloat16"
    assert req(dtype=None, default_dtype="auto").effective_dtype is None
    assert req(dtype="float16").effective_dtype == "float16"


def test_synthetic_facts_replace_only_what_they_say() -> None:
    f = machine("A100")
    assert f.native_bf16 and f.backend(FLASH).usable and f.backend("sdpa").usable
    assert not f.backend("xformers").usable
    assert replace(f, hardware=F.Hardware(())).local_gpu is None
