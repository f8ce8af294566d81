"""Where a model lands: on this rank's GPU when nobody chose a placement (rule ``place``), the
caller's or a deliberate setup's placement left alone, and ``device_map`` under several ranks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import Settings
from ..facts import Facts
from .draft import Draft, disabled, observe
from .request import Action, LoadRequest
from .table import PLACE

_GPU_WORDS = ("auto", "balanced", "balanced_low_0", "sequential", "cuda")


def _on_gpu(where: Any) -> bool:
    """A device_map value / device that puts weights on a GPU."""
    if isinstance(where, bool):
        return False
    if isinstance(where, int):
        return True
    text = str(where).strip().lower()
    return text.startswith(_GPU_WORDS)


def map_on_gpu(device_map: Any) -> bool:
    """True when an explicit device_map puts (some of) the model on a GPU."""
    if isinstance(device_map, Mapping):
        return any(_on_gpu(v) for v in device_map.values())
    return _on_gpu(device_map)


def _placement_by_caller(request: LoadRequest, facts: Facts) -> str | None:
    """How the caller placed the model themselves, or None."""
    if request.device_map is not None:
        return "an explicit device_map was given"  # the caller's value stays out of events
    if request.placement is not None:
        return f"{request.placement} places the model"
    ctx = facts.init.device_context
    if ctx is not None and not ctx.startswith("meta"):
        return f"the model is built inside a torch.device({ctx!r}) block"
    return None


def lands_on_gpu(request: LoadRequest, facts: Facts) -> bool:
    """Do the caller's own choices put the model on a GPU (a built model already there, a
    device_map onto a GPU, tensor parallelism, a ``torch.device("cuda")`` block)?"""
    if request.device is not None:
        return request.device.startswith("cuda")
    if request.device_map is not None:
        return map_on_gpu(request.device_map)
    if request.placement == "tp_plan":
        return True
    return facts.init.default_device.startswith("cuda")


def deliberate_setup(request: LoadRequest, facts: Facts) -> tuple[str, str, str] | None:
    """(rule, reason_code, why) for a setup that owns dtype and placement itself."""
    deliberate = facts.init.deliberate
    if deliberate is not None:
        return ("deliberate-init", *deliberate)
    if request.device == "meta":
        return ("deliberate-init", "meta_init", "the model's parameters are on the meta device")
    if request.quantized:
        return ("quantized", "quantized", "the model is quantized (the quantizer owns dtype)")
    return None


def plan_placement_into(
    request: LoadRequest, facts: Facts, settings: Settings, draft: Draft, flash: list[str]
) -> str | None:
    """Step 2: a flash model that would be built on the CPU of a GPU machine. Returns the device
    to load onto, or None."""
    if not flash or not facts.cuda or lands_on_gpu(request, facts):
        return None
    if request.device is not None and request.device != "cpu":
        return None  # a built model on meta: deliberate (step 3 says so)
    problem = f"{', '.join(flash)} needs the model on a GPU but it would be built on the CPU"
    deliberate = deliberate_setup(request, facts)
    by_caller = _placement_by_caller(request, facts)
    index = facts.local_gpu_index
    if deliberate is not None:
        draft.actions.append(observe(deliberate[0], deliberate[1], problem, deliberate[2]))
    elif by_caller is not None:
        draft.actions.append(
            observe("explicit-placement", "explicit_placement", problem, by_caller)
        )
    elif not settings.allows(PLACE):
        draft.actions.append(disabled(PLACE, "flash_needs_gpu", problem))
    elif index is None:
        why = (
            f"LOCAL_RANK={facts.launch.local_rank} names none of the {len(facts.gpus)} visible GPUs"
        )
        draft.actions.append(observe("place-impossible", "no_gpu_for_rank", problem, why))
    elif request.device is None and not facts.accelerate:
        why = "accelerate (needed for device_map) is not installed"
        draft.actions.append(observe("place-impossible", "accelerate_missing", problem, why))
    elif _too_large(request, facts, index):
        gpu = facts.gpus[index]
        why = (
            f"its weights (about {(request.model_bytes or 0) / 2**30:.1f} GiB) do not fit "
            f"{gpu.name} ({gpu.total_memory / 2**30:.0f} GiB)"
        )
        draft.actions.append(observe("place-impossible", "model_too_large", problem, why))
    else:
        device = f"cuda:{index}"
        draft.actions.append(
            Action(
                rule="place-gpu",
                event="model_placed",
                reason_code="flash_needs_gpu",
                problem=problem,
                remedy=PLACE,
                target="",
                before=request.device or "cpu",
                after=device,
                change=f"load it straight onto {device}",
            )
        )
        return device
    return None


# Share of a GPU's memory the weights may take when attnguard places a model there.
PLACE_FRACTION = 0.9


def _too_large(request: LoadRequest, facts: Facts, index: int) -> bool:
    total = facts.gpus[index].total_memory
    if request.model_bytes is None or not total:
        return False
    return request.model_bytes > total * PLACE_FRACTION


def device_map_decision(request: LoadRequest, facts: Facts) -> Any:
    """attnguard.plan.device_map's pure planner with these facts."""
    from .device_map import plan_device_map, spreads_over_ranks

    if not spreads_over_ranks(request.device_map, facts.launch.world_size):
        return None

    n_gpus = len(facts.gpus) if facts.cuda else 0
    return plan_device_map(
        request.device_map,
        world_size=facts.launch.world_size,
        local_rank=facts.launch.local_rank,
        n_gpus=n_gpus,
        max_memory=request.max_memory,
        model_bytes=request.model_bytes,
        gpu_bytes=facts.gpus[0].total_memory if n_gpus and facts.gpus[0].total_memory else None,
        local_world_size=facts.launch.local_world_size,
    )
