"""Which backend a model loads with when flash attention is requested: transformers' flash code
path kept on attnguard's SDPA twins, or the first usable backend of ATTNGUARD_FALLBACK.
"""

from __future__ import annotations

from typing import Any

from ..config import Settings
from ..facts import Facts, canonical_backend
from ..kernels import Kernel
from .draft import Draft, disabled, finish, observe, target_label, targets
from .request import Action, LoadRequest, Plan, is_flash
from .table import FALLBACK, SDPA_TWINS


def _supported(request: LoadRequest, backend: str) -> bool:
    if backend == "sdpa":
        return request.supports_sdpa
    if backend == "flex_attention":
        return request.supports_flex
    return True  # eager: every model has it


def fallback_choice(
    request: LoadRequest,
    facts: Facts,
    settings: Settings,
    *,
    flash_path: bool,
    want: str = "flash_attention_2",
) -> tuple[str, str | None] | None:
    """(attn_implementation to load with, kernels) for a flash request (``want``) that cannot
    keep its kernel: the first backend of ATTNGUARD_FALLBACK usable here and supported by the
    model class.

    "sdpa" means the SDPA twins under transformers' flash code path where ``flash_path`` allows
    it (flash semantics kept: the request stays, its flash path handed the twins of its own
    family, flash-attn 3's rules for ``flash_attention_3``), else transformers' own sdpa path.
    None: nothing fits.
    """
    for name in settings.fallback:
        if name == "sdpa" and flash_path and request.flash_path_on_twins:
            return str(want), SDPA_TWINS
        if name != "eager" and not facts.backend(name).usable:
            continue
        if _supported(request, name):
            return name, None
    return None


def first_usable_fallback(facts: Facts, settings: Settings) -> str | None:
    """The first backend of ATTNGUARD_FALLBACK usable here (any model class)."""
    for name in settings.fallback:
        if name == "eager" or facts.backend(name).usable:
            return name
    return None


def plan_backend_into(request: LoadRequest, facts: Facts, settings: Settings, draft: Draft) -> None:
    """Step 1: a flash kernel that cannot run here -> the flash path on the SDPA twins, or the
    first fallback backend the model supports."""
    for target, want in targets(request.attn_implementation):
        if not is_flash(want) or request.hub_kernel:
            # no flash request, or one transformers serves from the kernel hub: the hub kernel
            # is tried as it would be without attnguard (kernels.verdict decides
            # where it cannot load)
            continue
        status = facts.backend(want)
        if not request.supports_flash:
            code = "model_unsupported"
            problem = (
                f"{want} requested{target_label(target)}: {request.model or 'the model'} "
                "does not support flash attention"
            )
        elif not status.usable:
            code, problem = status.reason_code, f"{want} requested{target_label(target)}: "
            problem += status.reason
            if request.flash_path_unrecognised:  # never a backend computing other numbers
                why = (
                    "attnguard does not recognise how this transformers release wires its flash "
                    f"code path ({request.flash_path_unrecognised}), so no fallback is known to "
                    "compute flash's numbers (packed rows, windows); the request goes to "
                    "transformers as made (where it refuses it, its own error stands)"
                )
                draft.actions.append(
                    observe(
                        "flash-path-unrecognised", "flash_path_unrecognised", problem, why, target
                    )
                )
                continue
            if request.flash_uncomputed:  # transformers sends it elsewhere; the twins lack it
                why = (
                    f"transformers routes {request.model or 'this model'}'s flash request to "
                    f"{request.flash_routed_to}, and its attention passes "
                    f"{', '.join(request.flash_uncomputed)}, which attnguard's twins do not "
                    "compute; the request goes to transformers as made"
                )
                draft.actions.append(
                    observe(
                        "flash-args-uncomputed", "flash_argument_uncomputed", problem, why, target
                    )
                )
                continue
        else:
            continue
        choice = fallback_choice(
            request, facts, settings, flash_path=request.supports_flash, want=want
        )
        if not settings.allows(FALLBACK):
            draft.actions.append(disabled(FALLBACK, code, problem, target))
            continue
        if choice is None:
            why = (
                f"no backend of ATTNGUARD_FALLBACK={','.join(settings.fallback)} is usable and "
                f"supported by {request.model or 'the model'}"
            )
            draft.actions.append(observe("no-fallback", "no_fallback_usable", problem, why, target))
            continue
        attn, kernels = choice
        fields: dict[str, Any] = {"attn_implementation": attn, "slower": attn == "eager"}
        if kernels == SDPA_TWINS:
            rule = "flash-on-sdpa"
            change = (
                "keep transformers' flash code path and compute its kernel calls with "
                "attnguard's SDPA twins of the flash-attn functions (same semantics)"
            )
            if request.flash_routed_to:  # the semantics kept are those of transformers' choice
                change = (
                    f"keep transformers' flash code path with the semantics of "
                    f"{request.flash_routed_to}, which transformers chooses for this model, and "
                    "compute its kernel calls, with every argument the model's attention passes, "
                    "with attnguard's SDPA twins of the flash-attn functions"
                )
                fields["transformers_chooses"] = request.flash_routed_to
            draft.kernels = SDPA_TWINS
        else:
            rule = "flash-unsupported" if code == "model_unsupported" else "flash-unusable"
            change = f"load with {attn}"
            draft.new_attn[target] = attn
            draft.replaced.add(canonical_backend(want))
        draft.actions.append(
            Action(
                rule=rule,
                event="backend_fallback",
                reason_code=code,
                problem=problem,
                remedy=FALLBACK,
                target=target,
                before=want,
                after=Kernel.SDPA_TWIN.value if kernels == SDPA_TWINS else attn,
                change=change,
                fields=fields,
            )
        )


def plan_backend(request: LoadRequest, facts: Facts, settings: Settings) -> Plan:
    """Only the backend rows: what the backend gate and set_attn_implementation decide
    (dtype and placement are decided where the whole load is seen)."""
    draft = Draft()
    plan_backend_into(request, facts, settings, draft)
    return finish(request, draft)


def requested_flash(request: LoadRequest) -> list[str]:
    return sorted({v for _, v in targets(request.attn_implementation) if is_flash(v)})


def real_flash(request: LoadRequest, facts: Facts, draft: Draft) -> list[str]:
    """Flash kernels that will really run after step 1 (not replaced, usable here)."""
    return sorted(
        {
            v
            for t, v in targets(request.attn_implementation)
            if is_flash(v)
            and t not in draft.new_attn
            and request.supports_flash
            and facts.backend(v).usable
        }
    )
