"""The whole load: :func:`plan_load` asks the backend, dtype and placement planners in turn."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..config import Settings
from ..facts import Facts
from .backend import plan_backend_into, real_flash, requested_flash
from .draft import Draft, disabled, finish, targets
from .dtype import plan_dtype_into
from .placement import device_map_decision, lands_on_gpu, plan_placement_into
from .request import Action, LoadRequest, Plan, is_flash
from .table import DEVICE_MAP


def plan_load(request: LoadRequest, facts: Facts, settings: Settings) -> Plan:
    """Decide what to change so the requested attention backend can run. See :data:`TABLE`."""
    draft = Draft()
    plan_backend_into(request, facts, settings, draft)  # 1. backend
    flash = requested_flash(request)
    # 2. placement: for a flash request that stays on flash's code path; one the load switches
    # to another backend (sdpa, eager) runs where its caller puts it
    kept = kept_flash(request, draft)
    new_device = plan_placement_into(request, facts, settings, draft, kept)
    on_gpu = new_device is not None or lands_on_gpu(request, facts)
    real = real_flash(request, facts, draft)
    new_dtype = plan_dtype_into(  # 3. dtype
        request, facts, settings, draft, flash=flash, real=real, on_gpu=on_gpu
    )

    # 4. multi-process launch with a spreading device_map (family C, attnguard.plan.device_map)
    new_map, new_max = None, None
    decision = device_map_decision(request, facts)
    if decision is not None:
        if facts.init.deliberate is not None:
            pass  # ZeRO-3 / FSDP refuse a device_map anyway; nothing of ours to add
        elif not settings.allows(DEVICE_MAP):
            draft.actions.append(disabled(DEVICE_MAP, decision.reason_code, decision.reason))
        else:
            new_map, new_max = decision.device_map, decision.max_memory
            draft.actions.append(
                Action(
                    rule="device-map-per-rank",
                    event="device_map_rewritten",
                    reason_code=decision.reason_code,
                    problem=decision.reason,
                    remedy=DEVICE_MAP,
                    target="",
                    before=decision.before,
                    after=decision.after,
                    change=f"load with device_map={decision.device_map!r}",
                )
            )

    return finish(
        request,
        draft,
        dtype=new_dtype,
        device=new_device,
        device_map=new_map,
        max_memory=new_max,
    )


def kept_flash(request: LoadRequest, draft: Draft) -> list[str]:
    """The flash requests that stay on flash's code path after step 1 (their kernel, or
    attnguard's twins of it), not those switched to another backend."""
    return sorted(
        {
            want
            for target, want in targets(request.attn_implementation)
            if is_flash(want) and is_flash(draft.new_attn.get(target, want))
        }
    )


def flash_fp32_request(**overrides: Any) -> LoadRequest:
    """The request ``attnguard doctor`` plans for: flash_attention_2 + float32 + no device_map,
    the dtype chosen by nobody (4.x's default)."""
    base = LoadRequest(
        model="(any model)",
        site="doctor",
        attn_implementation="flash_attention_2",
        dtype=None,
        default_dtype="float32",
        flash_path_on_twins=True,
    )
    return replace(base, **overrides)
