"""The load-time planner's inputs, injected: one machine's facts (H100 9.0, A100 8.0, V100 7.0,
T4 7.5, or no GPU), a load request, the settings; and its answer as (rule, event, reason_code)
rows, the shape of the decision table's cases (tests/test_plan.py, tests/test_plan_flash_state.py).
"""

from __future__ import annotations

from typing import Any

from attnguard import facts as F
from attnguard.config import Settings
from attnguard.plan import TABLE, LoadRequest, Plan, plan_load

FLASH = "flash_attention_2"
GPUS = {"H100": (9, 0), "A100": (8, 0), "V100": (7, 0), "T4": (7, 5)}


def machine(
    gpu: str | None,
    *,
    n: int = 1,
    flash: str | F.PackageState | None = "2.8.3",
    init: F.InitContext | None = None,
    launch: F.Launch | None = None,
    installed_extra: dict[str, Any] | None = None,
    **kw: Any,
) -> F.Facts:
    """Injected facts of one machine, judged by the same facts.assess_backend as real ones."""
    caps = (GPUS[gpu],) * n if gpu else ()
    installed = {} if flash is None else {FLASH: flash}
    installed.update(installed_extra or {})
    return F.synthetic(
        caps, installed=installed, gpu_name=gpu or "", init=init, launch=launch, **kw
    )


def req(**kw: Any) -> LoadRequest:
    base = {
        "model": "Qwen2ForCausalLM",
        "attn_implementation": FLASH,
        "dtype": None,
        "flash_path_on_twins": True,
    }
    return LoadRequest(**{**base, **kw})


def summary(plan: Plan) -> list[tuple[str, str, str]]:
    return [(a.rule, a.event, a.reason_code) for a in plan.actions]


S = Settings()
TW = "sdpa"  # Plan.kernels when flash's code path runs on attnguard's SDPA twins
CAST_H100 = ("fp32-cast", "model_cast", "flash_needs_half")
PLACE = ("place-gpu", "model_placed", "flash_needs_gpu")


def twins(code: str) -> tuple[str, str, str]:
    return ("flash-on-sdpa", "backend_fallback", code)


def unusable(code: str) -> tuple[str, str, str]:
    return ("flash-unusable", "backend_fallback", code)


VERL_RANK0 = F.InitContext(default_device="cpu", device_context="cpu")
# a flash path attnguard does not recognise: transformers' own, observed
ASIDE = ("flash-path-unrecognised", "observed", "flash_path_unrecognised")


def check_case(case: tuple) -> None:
    """One case of the decision table: the planner's actions are the expected ones, each saying
    why and named in plan.TABLE with its event; the load goes ahead with what the case says."""
    _name, facts, request, settings, expected, (attn, kernels, dtype, device) = case
    plan = plan_load(request, facts, settings)
    assert summary(plan) == expected
    assert plan.attn_implementation == attn
    assert plan.kernels == kernels
    assert plan.dtype == dtype
    assert plan.device == device
    for action in plan.actions:
        assert action.reason()  # every action says why
        assert action.rule in {r.id for r in TABLE}
        assert action.event == next(r.event for r in TABLE if r.id == action.rule)
