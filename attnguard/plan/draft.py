"""The plan under construction: the actions and changes the planners add, finished into a
:class:`~attnguard.plan.request.Plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .request import Action, LoadRequest, Plan


def targets(attn: Any) -> list[tuple[str, Any]]:
    if isinstance(attn, Mapping):
        return [(str(k), v) for k, v in attn.items()]
    return [("", attn)]


def _rebuild(attn: Any, new: dict[str, Any]) -> Any:
    if isinstance(attn, Mapping):
        return {k: new.get(str(k), v) for k, v in attn.items()}
    return new.get("", attn)


def target_label(target: str) -> str:
    return f" for {target}" if target else ""


def observe(rule: str, code: str, problem: str, why: str, target: str = "") -> Action:
    return Action(
        rule=rule,
        event="observed",
        reason_code=code,
        problem=f"{problem}; left as is: {why}",
        remedy=None,
        target=target,
    )


def disabled(remedy: str, code: str, problem: str, target: str = "") -> Action:
    return observe(
        "remedy-disabled",
        code,
        problem,
        f"remedy '{remedy}' is disabled (ATTNGUARD_DISABLE)",
        target,
    )


@dataclass
class Draft:
    """The plan being built by the steps of :func:`plan_load`."""

    actions: list[Action] = field(default_factory=list)
    new_attn: dict[str, Any] = field(default_factory=dict)
    replaced: set[str] = field(default_factory=set)
    kernels: str | None = None


def finish(request: LoadRequest, draft: Draft, **changes: Any) -> Plan:
    attn = (
        _rebuild(request.attn_implementation, draft.new_attn)
        if draft.new_attn
        else request.attn_implementation
    )
    return Plan(
        request=request,
        actions=tuple(draft.actions),
        attn_implementation=attn,
        replaced_backends=frozenset(draft.replaced),
        kernels=draft.kernels,
        **changes,
    )
