"""``attnguard doctor``: this machine's facts, the decision table, and the plan the guard would
apply to ``flash_attention_2`` + float32 + no device_map — computed by the same
:func:`attnguard.plan.plan_load` the loading guard calls, with the settings in force.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from . import facts as facts_mod
from . import runtime
from .computing import NOW
from .config import Settings, read
from .integrations.transformers import flash_path as transformers_kernels
from .kernels import QUESTIONS, RULES
from .observability.eventfiles import printable
from .plan import TABLE, Plan, flash_fp32_request, plan_load


def _settings() -> Settings:
    current = runtime.settings()
    # doctor plans with the ATTNGUARD_* settings a guarded run would use, even when off here
    return current if current.enabled else read()[0]  # a bad value: what a run would use


def guard_state() -> dict[str, Any]:
    """Whether attnguard guards the programs run in this environment, as the doctor sees it:

    * ``startup_hook_installed``: ``attnguard.pth`` is in this Python's site-packages;
    * ``startup_hook_on``: installed and ``ATTNGUARD`` switched on here, so every Python started
      with this environment guards itself (no code change);
    * ``active_when_imported``: a program that imports attnguard is guarded (it is unless
      ``ATTNGUARD`` is switched off or ``ATTNGUARD_MODE=off``).
    """
    import os
    import site
    import sysconfig

    from .config import switched_on

    places = {sysconfig.get_paths()["purelib"], *getattr(site, "getsitepackages", list)()}
    installed = any(os.path.isfile(os.path.join(p, "attnguard.pth")) for p in places)
    return {
        "startup_hook_installed": installed,
        "startup_hook_on": installed and switched_on(os.environ.get("ATTNGUARD", "")),
        "active_when_imported": read()[0].enabled,
    }


def _guard_line(state: dict[str, Any]) -> str:
    if state["startup_hook_on"]:
        hook = "start-up hook on (ATTNGUARD): every Python started here is guarded"
    elif state["startup_hook_installed"]:
        hook = "start-up hook installed, off (ATTNGUARD unset or off)"
    else:
        hook = "start-up hook not installed in this Python"
    imported = "guarded" if state["active_when_imported"] else "not guarded (switched off)"
    return f"guard: {hook}; a program that imports attnguard: {imported}"


# the sample plan's rules that decide who serves a flash request whose kernel cannot run here
_BACKEND_RULES = (
    "flash-on-sdpa",
    "flash-unusable",
    "flash-path-unrecognised",
    "flash-args-uncomputed",
    "no-fallback",
    "remedy-disabled",
)


def verdict(data: Mapping[str, Any]) -> str:
    """The doctor's first line: who serves ``flash_attention_2`` requests on this machine, and
    why. A pure function of what :func:`collect` gathered (the guard's state, the settings, the
    backend's status, the sample plan): a new way of serving one (a hub kernel) is one more
    branch here."""
    head = "flash_attention_2 requests on this machine"
    flash = data["facts"]["backends"].get("flash_attention_2") or {}
    why = flash.get("reason") or "not judged"
    mode = data["settings"].get("mode")
    if flash.get("usable"):
        version = f" {flash['version']}" if flash.get("version") else ""
        guarded = "" if data["guard"]["active_when_imported"] else "; attnguard is switched off"
        return f"{head}: served by flash-attn{version} itself (it runs here){guarded}"
    hub = (data["sample_plan"].get("request") or {}).get("hub_kernel")
    if hub:  # transformers' own fallback: the hub kernel, tried as without attnguard
        found = data.get("kernel_hub") or {}
        here = {k["repo"] for k in found.get("here") or []}
        if found.get("offline") and hub.split("@", 1)[0] not in here:
            tail = (
                "; attnguard is switched off"
                if not data["guard"]["active_when_imported"]
                else ": served by attnguard's twins of its flash-attn functions"
            )
            return (
                f"{head}: transformers would load the hub kernel {hub} ({why}), which this "
                f"machine does not have and cannot fetch (offline){tail}"
            )
        return (
            f"{head}: served by the hub kernel {hub}, which transformers loads for them ({why}); "
            "where it cannot load, by attnguard's twins of its flash-attn functions"
        )
    if not data["guard"]["active_when_imported"]:
        return f"{head}: transformers' own error ({why}); attnguard is switched off"
    action = next((a for a in data["sample_plan"]["actions"] if a["rule"] in _BACKEND_RULES), None)
    if action is None:
        return f"{head}: as transformers decides ({why}); attnguard plans no change"
    rule = action["rule"]
    if rule in ("flash-on-sdpa", "flash-unusable"):
        served = (
            "attnguard's twins on transformers' flash code path"
            if rule == "flash-on-sdpa"
            else f"transformers' {action['after']} attention (the first of ATTNGUARD_FALLBACK that fits)"
        )
        if mode == "warn":
            return (
                f"{head}: transformers' own error ({why}); warn mode only reports that they "
                f"would be served by {served}"
            )
        if mode == "strict":
            return f"{head}: AttnGuardError ({why}); strict mode raises instead of serving them"
        return f"{head}: served by {served} ({why})"
    if rule == "remedy-disabled":
        return f"{head}: transformers' own error ({why}); ATTNGUARD_DISABLE=fallback keeps it"
    if rule == "no-fallback":
        return f"{head}: transformers' own error ({why}); no backend of ATTNGUARD_FALLBACK fits"
    # flash-path-unrecognised, flash-args-uncomputed: attnguard steps aside
    return f"{head}: as without attnguard ({why}); attnguard steps aside: {action['problem']}"


def collect() -> dict[str, Any]:
    """Facts, table and the sample plan as one JSON-friendly dict, the verdict first."""
    from .runtime import versions

    facts = facts_mod.current(runtime.settings())
    settings = _settings()
    flash_path = transformers_kernels.installed_flash_path()
    plan = plan_load(_sample_request(flash_path), facts, settings)
    # the settings a guarded program here would use; whether one is guarded is "guard"'s to say
    shown = {k: v for k, v in settings.as_dict().items() if k != "enabled"}
    data = {
        "versions": versions(),
        "guard": guard_state(),
        "settings": shown,
        "facts": facts.as_dict(),
        "kernel_questions": [
            {"when": when, "question": question, "answered_by": where}
            for when, question, where in QUESTIONS
        ],
        "decision_table": [dict(r.__dict__) for r in TABLE],
        "flash_path": flash_path,
        "sample_request": "flash_attention_2 + float32 + no device_map",
        "sample_plan": plan.as_dict(),
        "twin_kernels": [dict(r.__dict__) for r in _twin_table()],
        "kernel_cache": _kernel_cache(),
        "kernel_decisions": _kernel_decisions(),
        "diffusers": _diffusers_report().describe(),
        "kernel_hub": _hub().report(),
        "kernel_rules": [
            dict(zip(("rule", "when", "then", "event", "reason_code"), r, strict=True))
            for r in RULES
        ],
        "computing_now": NOW.describe(),
    }
    return {"verdict": verdict(data), **data}


def _hub() -> Any:
    from .integrations.transformers import hub

    return hub


def _diffusers_report() -> Any:
    from .integrations.diffusers import report

    return report


def _twin_table() -> Any:
    from .fallback.routes import TABLE as TWIN_TABLE

    return TWIN_TABLE


def _kernel_cache() -> str:
    """Where ATTNGUARD_KERNEL=fastest keeps its decisions with the settings in force."""
    from .selection.cache import cache_root

    return _settings().kernel_cache or cache_root()


def _kernel_decisions() -> list[dict[str, Any]]:
    """Decisions ATTNGUARD_KERNEL=fastest measured and cached on this machine."""
    from .selection.cache import listing

    return listing(_kernel_cache())


def _sample_request(flash_path: dict[str, Any]) -> Any:
    """flash_attention_2 + float32 + no device_map, for a registry-based model such as Llama or
    Qwen2, with what this machine's transformers flash path is (kept on the twins or not)."""
    return replace(
        flash_fp32_request(flash_path_on_twins=flash_path["kept_on_twins"]),
        flash_path_unrecognised=flash_path["why"],
        hub_kernel=_hub().fallback_route("flash_attention_2"),
    )


def _rows(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return [fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def _plan_lines(plan: Plan) -> list[str]:
    hub = plan.request.hub_kernel
    if hub and not plan.actions:
        return [
            f"  nothing to change at load: transformers loads the hub kernel {hub} for it (where "
            "it cannot load: the hub rules above decide)"
        ]
    if not plan.actions:
        return ["  nothing to change"]
    out = []
    for a in plan.actions:
        verb = "would apply" if a.applies else "observe"
        out.append(f"  [{a.rule}] {a.event} ({a.reason_code}) {verb}: {a.reason()}")
    load_with = {
        "attn_implementation": plan.attn_implementation,
        "kernels": plan.kernels or "as requested",
        "dtype": plan.dtype or plan.request.effective_dtype,
        "device": plan.device or "unchanged",
    }
    out.append(f"  -> load with {load_with}")
    return out


def render(as_json: bool = False) -> str:
    """The doctor report: text tables, or one JSON object with ``as_json``."""
    data = collect()
    if as_json:
        return json.dumps(data, indent=2, default=str)
    facts = facts_mod.current(runtime.settings())
    settings = _settings()
    lines = [data["verdict"], "", "attnguard doctor", ""]
    lines.append(
        "versions: " + ", ".join(f"{k} {v}" for k, v in data["versions"].items() if v is not None)
    )
    lines.append(_guard_line(data["guard"]))
    launch = facts.launch
    lines.append(
        f"launch: rank {launch.rank}, local_rank {launch.local_rank}, world_size {launch.world_size}"
    )
    ctx = facts.init.deliberate
    lines.append(f"deliberate-init context: {ctx[1] if ctx else 'none'}")
    lines.append(
        f"settings: mode={settings.mode} fallback={','.join(settings.fallback)} "
        f"dtype={settings.dtype} fp32_policy={settings.fp32_policy} kernel={settings.kernel} "
        f"disabled={','.join(sorted(settings.disable)) or '-'}"
    )
    lines += ["", "GPUs"]
    if facts.gpus:
        lines += _rows(
            ["index", "name", "capability", "native bf16", "memory"],
            [
                [
                    str(g.index),
                    g.name,
                    f"{g.capability[0]}.{g.capability[1]}",
                    "yes" if g.native_bf16 else "no",
                    f"{g.total_memory / 2**30:.0f} GiB",
                ]
                for g in facts.gpus
            ],
        )
    else:
        lines.append("  no CUDA device visible")
    lines += ["", "Attention backends"]
    lines += _rows(
        ["backend", "usable", "reason"],
        [[b.name, "yes" if b.usable else "no", b.reason] for b in facts.backends.values()],
    )
    lines += ["", "Which kernel computes an attention call, and why: the questions, in order"]
    for n, (when, question, where) in enumerate(QUESTIONS, 1):
        lines.append(f"  {n}. {when}: {question} ({where})")
    lines += ["", "Decision table"]
    lines += _rows(
        ["rule", "family", "event", "reason_code", "disable with"],
        [[r.id, r.family, r.event, r.reason_code, r.remedy or "-"] for r in TABLE],
    )
    for r in TABLE:
        lines.append(f"  {r.id}: when {r.when} -> {r.then}")
    path = data["flash_path"]
    lines += ["", "transformers' flash code path (read from the module, checked on stand-ins)"]
    if path.get("wiring"):
        lines.append(
            f"  wiring: {path['wiring']}; window_size for sliding_window=w: "
            f"{path.get('window_size') or 'not read'}"
        )
    if path["kept_on_twins"]:
        lines.append(
            "  where flash-attn cannot run: kept, its kernel calls on the SDPA twins "
            f"(checked: {', '.join(path['probe_cases'])})"
        )
    else:
        lines.append(
            f"  where flash-attn cannot run: not kept, attnguard steps aside ({path['why']})"
        )
    lines += ["", "Flash attention from the Hugging Face kernel hub (transformers)"]
    lines += _hub().report_lines(data["kernel_hub"])
    lines += ["", "Where a kernel cannot compute: the verdict's rules (attnguard.kernels.verdict)"]
    for rule, when, then, event, code in RULES:
        lines.append(f"  {rule} ({event}, {code}): when {when} -> {then}")
    lines += ["", "What computes now in this process (attnguard.computing.NOW)"]
    for row in data["computing_now"] or [{"subject": "none"}]:
        if "computes" not in row:
            lines.append("  none")
            continue
        lines.append(
            f"  {printable(row['subject'])}: {printable(row['computes'])} ({row['rule']}, "
            f"{row['reason_code']})"
        )
    lines += ["", "Plan for flash_attention_2 + float32 + no device_map on this machine"]
    lines += _plan_lines(plan_load(_sample_request(path), facts, settings))
    lines += ["", "Which torch kernel computes a twin's call (attnguard/fallback/routes.py)"]
    lines += _rows(
        ["route", "call", "kernel", "when"],
        [[r.id, r.call, r.kernel, r.when] for r in _twin_table()],
    )
    lines += ["", "diffusers' attention backends: usable here, and what computes their calls"]
    lines += _diffusers_report().lines(data["diffusers"])
    lines += ["", "Kernel decisions cached on this machine (ATTNGUARD_KERNEL=fastest)"]
    lines.append(f"  in {printable(_kernel_cache())}")
    cached = data["kernel_decisions"]
    if not cached:
        lines.append("  none")
    for d in cached:  # what the files hold is shown as text: no terminal escape gets through
        if "error" in d:
            lines.append(f"  {printable(d['file'])}: not used ({printable(d['error'])})")
            continue
        shown = {k: printable(d[k]) for k in ("gpu", "bucket", "winner", "why")}
        spent = ""
        if "race_s" in d:
            spent = f"; raced in {d['race_s']:.2f} s + {d.get('warm_up_s', 0.0):.2f} s warm-up"
        lines.append(
            f"  {shown['gpu']}: {shown['bucket']} -> {shown['winner']} ({shown['why']}{spent})"
        )
    return "\n".join(lines)
