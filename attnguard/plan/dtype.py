"""Which dtype a model loads in: float32 that nobody chose meeting a half-only flash kernel is
cast (or, with ``ATTNGUARD_FP32_POLICY=fallback``, the backend falls back), an explicit choice
stands.
"""

from __future__ import annotations

from ..config import Settings
from ..facts import Facts, canonical_backend
from .backend import fallback_choice
from .draft import Draft, disabled, observe, targets
from .placement import deliberate_setup
from .request import Action, LoadRequest, half_dtype, is_flash
from .table import CAST, FALLBACK


def plan_dtype_into(
    request: LoadRequest,
    facts: Facts,
    settings: Settings,
    draft: Draft,
    *,
    flash: list[str],
    real: list[str],
    on_gpu: bool,
) -> str | None:
    """Step 3: the dtype flash would have run in, where nobody chose one. Returns the load dtype
    to inject, or None."""
    if not flash or not facts.cuda:
        return None  # on a machine without CUDA float32 on the CPU is right
    dtype = request.effective_dtype
    gpu = facts.local_gpu
    if dtype == "float32":
        if real:
            problem = (
                f"{', '.join(real)} only runs in fp16/bf16 but the model would load in float32"
            )
        else:
            problem = (
                f"{', '.join(flash)} was requested (it runs in fp16/bf16) but the model would "
                "load in float32"
            )
        if settings.fp32_policy == "fallback":
            if real:
                _fp32_fallback(request, facts, settings, draft, problem)
            return None
        code, new, before = "flash_needs_half", half_dtype(facts, settings), "float32"
    elif (
        dtype == "bfloat16" and gpu is not None and not gpu.native_bf16 and settings.dtype != "bf16"
    ):
        problem = (
            f"bfloat16 requested on {gpu.name} (compute capability "
            f"{gpu.capability[0]}.{gpu.capability[1]}), which has no native bf16"
        )
        code, new, before = "no_native_bf16", "float16", "bfloat16"
    else:
        return None

    if real and code == "flash_needs_half":
        carried = (
            f"each {', '.join(real)} call runs in {half_dtype(facts, settings)} through the "
            f"call-time guard (q/k/v cast for the kernel, the output cast back; the weights stay "
            f"{dtype}); load with dtype=torch.{new} to run the whole model in {new}"
        )
    else:
        carried = f"the model computes in {dtype}"
    deliberate = deliberate_setup(request, facts)
    if deliberate is not None:
        draft.actions.append(observe(deliberate[0], deliberate[1], problem, deliberate[2]))
    elif request.dtype_explicit:
        why = f"dtype={request.dtype} was passed explicitly; {carried}"
        draft.actions.append(observe("explicit-dtype", "explicit_dtype", problem, why))
    elif facts.launch.world_size > 1:
        why = (
            f"WORLD_SIZE={facts.launch.world_size}: a load-time cast could differ between ranks "
            f"(some may build on the meta device) and hang a sharded wrapper; {carried}"
        )
        draft.actions.append(observe("ranks-agree", "multi_rank", problem, why))
    elif code == "flash_needs_half" and facts.init.training_script:
        why = (
            "the program imported transformers' Trainer / TrainingArguments: its mixed precision "
            "(bf16=True / fp16=True) trains float32 master weights under autocast, which a cast at "
            f"load would turn into pure half training; {carried}"
        )
        draft.actions.append(observe("training-script", "training_script", problem, why))
    elif not on_gpu:
        return None  # kept on the CPU (step 2 said why): a cast would only slow it there
    elif not settings.allows(CAST):
        draft.actions.append(disabled(CAST, code, problem))
    else:
        rule = "fp32-cast" if code == "flash_needs_half" else "bf16-no-native"
        draft.actions.append(
            Action(
                rule=rule,
                event="model_cast",
                reason_code=code,
                problem=problem,
                remedy=CAST,
                target="",
                before=before,
                after=new,
                change=f"load in {new}",
            )
        )
        return new
    return None


def _fp32_fallback(
    request: LoadRequest, facts: Facts, settings: Settings, draft: Draft, problem: str
) -> None:
    """ATTNGUARD_FP32_POLICY=fallback: keep float32, leave the flash kernel for a fallback."""
    choice = fallback_choice(request, facts, settings, flash_path=False)
    if not settings.allows(FALLBACK):
        draft.actions.append(disabled(FALLBACK, "flash_needs_half", problem))
        return
    if choice is None:
        why = "no backend of ATTNGUARD_FALLBACK is usable and supported by the model"
        draft.actions.append(observe("no-fallback", "no_fallback_usable", problem, why))
        return
    attn = choice[0]
    for target, want in targets(request.attn_implementation):
        if is_flash(want) and target not in draft.new_attn:
            draft.new_attn[target] = attn
            draft.replaced.add(canonical_backend(want))
            draft.actions.append(
                Action(
                    rule="fp32-fallback",
                    event="backend_fallback",
                    reason_code="flash_needs_half",
                    problem=f"{problem}; ATTNGUARD_FP32_POLICY=fallback keeps float32",
                    remedy=FALLBACK,
                    target=target,
                    before=want,
                    after=attn,
                    change=f"load with {attn}",
                    fields={"attn_implementation": attn, "slower": attn == "eager"},
                )
            )
