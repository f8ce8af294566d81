"""The load-time planner: (request, facts, settings) -> Plan. Pure: no torch, no I/O, no events.

The decision table (:data:`TABLE`) is data: ``attnguard doctor`` prints it and the tests walk
every row. :func:`plan_load` is the one implementation of it; the transformers patches, the
``guard_model`` path and ``attnguard doctor`` all call it.

The plan is what fix mode would do. The caller decides, from the mode, whether to apply it (fix),
only report it (warn) or refuse to go on (strict). Remedies disabled with ATTNGUARD_DISABLE turn
into ``observed`` actions that say what was left alone and why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from .config import Settings
from .facts import FLASH_BACKENDS, Facts, _canonical

# remedy names (as in ATTNGUARD_DISABLE)
FALLBACK, CAST, PLACE, DEVICE_MAP = "fallback", "cast", "place", "device_map"


@dataclass(frozen=True)
class Rule:
    """One row of the decision table."""

    id: str
    family: str  # failure family of DESIGN §1 ("A", "B", "E", "C"), or "-" for a guard rail
    when: str
    then: str
    event: str
    reason_code: str  # fixed, or <...> where it comes from the facts / the multi-GPU planner
    remedy: str | None  # ATTNGUARD_DISABLE name that switches it off; None for observe rows


TABLE: tuple[Rule, ...] = (
    Rule(
        "flash-unusable",
        "A/B",
        "flash_attention_2/3/4 requested and not usable here; the reason code is the backend's "
        "status: package_missing, extension_broken (CUDA extension fails to import), no_cuda, "
        "capability_too_low, version_too_old, probe_failed (a tiny test call failed)",
        "load with the first usable backend of ATTNGUARD_FALLBACK (never a hub kernel)",
        "backend_fallback",
        "<backend status>",
        FALLBACK,
    ),
    Rule(
        "flash-unsupported",
        "A",
        "flash requested for a model class that does not support flash attention",
        "load with the first usable backend of ATTNGUARD_FALLBACK",
        "backend_fallback",
        "model_unsupported",
        FALLBACK,
    ),
    Rule(
        "no-fallback",
        "A/B",
        "flash unusable and no backend of ATTNGUARD_FALLBACK is usable either",
        "change nothing (transformers raises its own error)",
        "observed",
        "no_fallback_usable",
        None,
    ),
    Rule(
        "fp32-cast",
        "E",
        "flash usable, the model would be float32, ATTNGUARD_FP32_POLICY=cast (default)",
        "load in bf16 where the GPU has it natively, else fp16 (ATTNGUARD_DTYPE overrides), by "
        "injecting the load dtype (keeps _keep_in_fp32_modules in fp32)",
        "model_cast",
        "flash_needs_half",
        CAST,
    ),
    Rule(
        "fp32-fallback",
        "E",
        "flash usable, the model would be float32, ATTNGUARD_FP32_POLICY=fallback",
        "keep float32 and load with the first usable backend of ATTNGUARD_FALLBACK",
        "backend_fallback",
        "flash_needs_half",
        FALLBACK,
    ),
    Rule(
        "bf16-no-native",
        "B",
        "flash requested with bfloat16 on a GPU without native bf16 (compute capability < 8.0)",
        "load in fp16 (unless ATTNGUARD_DTYPE=bf16)",
        "model_cast",
        "no_native_bf16",
        CAST,
    ),
    Rule(
        "place-gpu",
        "A",
        "flash usable, CUDA present, no device_map, the model would be built on the CPU",
        'load straight onto cuda:LOCAL_RANK (device_map={"": "cuda:N"}); a model built with '
        "Model(config) is moved with .to()",
        "model_placed",
        "flash_needs_gpu",
        PLACE,
    ),
    Rule(
        "device-map-per-rank",
        "C",
        'several processes (WORLD_SIZE > 1) and a device_map that spreads ("auto", "balanced", '
        '"balanced_low_0", "sequential")',
        "one replica per rank, or a disjoint GPU slice per rank (attnguard.multigpu)",
        "device_map_rewritten",
        "<multigpu decision>",
        DEVICE_MAP,
    ),
    Rule(
        "deliberate-init",
        "A/E",
        "a cast or a placement would apply, but DeepSpeed ZeRO-3, FSDP or meta-device init "
        "builds the model on CPU / in fp32 on purpose",
        "change nothing (sharding and fp32 master weights stay intact)",
        "observed",
        "zero3_init | fsdp_init | meta_init",
        None,
    ),
    Rule(
        "quantized",
        "A/E",
        "a cast or a placement would apply to a quantized load",
        "change nothing (the quantizer owns dtype and placement)",
        "observed",
        "quantized",
        None,
    ),
    Rule(
        "explicit-placement",
        "A/E",
        "a cast or a placement would apply, but the caller placed the model (explicit "
        "device_map, tp_plan, accelerate hooks, or a model spread over devices)",
        "change nothing",
        "observed",
        "explicit_placement",
        None,
    ),
    Rule(
        "place-impossible",
        "A",
        "a placement would apply, but accelerate (needed for device_map) is missing or "
        "LOCAL_RANK names no visible GPU",
        "change nothing",
        "observed",
        "accelerate_missing | no_gpu_for_rank",
        None,
    ),
    Rule(
        "remedy-disabled",
        "-",
        "a remedy would apply, but ATTNGUARD_DISABLE names it",
        "change nothing",
        "observed",
        "<the problem's reason code>",
        None,
    ),
)
RULES: dict[str, Rule] = {r.id: r for r in TABLE}


@dataclass(frozen=True)
class LoadRequest:
    """What the caller asked for, normalised (dtypes by name: "float32", "bfloat16", ...)."""

    model: str = ""
    site: str = "transformers.load"
    # a backend name, None (transformers' default), or {sub-config key or "": backend}
    attn_implementation: str | Mapping[str, str | None] | None = None
    dtype: str | None = None  # as given; None = not given; "auto" = the checkpoint's
    default_dtype: str = "float32"  # what "not given" means on this path / version
    checkpoint_dtype: str | None = None  # what "auto" resolves to; None = unknown
    device_map: Any = None
    max_memory: Mapping[Any, Any] | None = None
    placement: str | None = None  # other explicit placement: "tp_plan", "accelerate hooks", ...
    device: str | None = None  # a built model: where its parameters are ("cpu", "cuda:0", "meta")
    quantized: bool = False
    supports_flash: bool = True
    model_bytes: int | None = None

    @property
    def effective_dtype(self) -> str | None:
        """The dtype the model would end up in; None when unknown (or a per-module dict)."""
        d = self.dtype if self.dtype is not None else self.default_dtype
        if d == "auto":
            return self.checkpoint_dtype
        return d if isinstance(d, str) else None


@dataclass(frozen=True)
class Action:
    """One decision, with the table row it comes from."""

    rule: str
    event: str
    reason_code: str
    reason: str
    remedy: str | None = None
    target: str = ""  # sub-config key for per-sub-config backends ("" = the whole model)
    before: Any = None
    after: Any = None

    @property
    def applies(self) -> bool:
        """True for a change (fix mode applies it); False for an observation."""
        return self.event != "observed"


@dataclass(frozen=True)
class Plan:
    request: LoadRequest
    actions: tuple[Action, ...] = ()
    attn_implementation: str | Mapping[str, str | None] | None = None  # to load with
    dtype: str | None = None  # load dtype to inject; None = leave as requested
    device: str | None = None  # place the model here; None = leave
    device_map: Any = None  # new device_map (issue 5); None = leave
    max_memory: Mapping[Any, Any] | None = None
    replaced_backends: frozenset[str] = field(default_factory=frozenset)

    @property
    def changes(self) -> list[Action]:
        return [a for a in self.actions if a.applies]

    @property
    def observations(self) -> list[Action]:
        return [a for a in self.actions if not a.applies]

    @property
    def backend_changed(self) -> bool:
        return any(a.event == "backend_fallback" for a in self.changes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "request": {
                k: (dict(v) if isinstance(v, Mapping) else v)
                for k, v in self.request.__dict__.items()
            },
            "attn_implementation": _jsonable(self.attn_implementation),
            "dtype": self.dtype,
            "device": self.device,
            "device_map": _jsonable(self.device_map),
            "max_memory": _jsonable(self.max_memory),
            "actions": [dict(a.__dict__, applies=a.applies) for a in self.actions],
        }


def _jsonable(v: Any) -> Any:
    return {str(k): x for k, x in v.items()} if isinstance(v, Mapping) else v


# --- helpers -------------------------------------------------------------------------------------

_DTYPE_NAMES = {
    "float32": "float32",
    "float": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "half": "float16",
    "fp16": "float16",
    "auto": "auto",
}


def dtype_name(dtype: Any) -> str | None:
    """torch.float32 / "fp32" / "float32" -> "float32"; None stays None; others by their name."""
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "").strip().lower()
    return _DTYPE_NAMES.get(name, name)


def is_flash(name: Any) -> bool:
    return isinstance(name, str) and _canonical(name) in FLASH_BACKENDS


def half_dtype(facts: Facts, settings: Settings) -> str:
    """bf16 where the GPU has it natively, else fp16; ATTNGUARD_DTYPE overrides."""
    if settings.dtype == "bf16":
        return "bfloat16"
    if settings.dtype == "fp16":
        return "float16"
    return "bfloat16" if facts.native_bf16 else "float16"


def first_usable_fallback(facts: Facts, settings: Settings) -> str | None:
    for name in settings.fallback:
        if name == "eager" or facts.backend(name).usable:
            return name
    return None


def _targets(attn: Any) -> list[tuple[str, Any]]:
    if isinstance(attn, Mapping):
        return [(str(k), v) for k, v in attn.items()]
    return [("", attn)]


def _rebuild(attn: Any, new: dict[str, Any]) -> Any:
    if isinstance(attn, Mapping):
        return {k: new.get(str(k), v) for k, v in attn.items()}
    return new.get("", attn)


def _target_label(target: str) -> str:
    return f" for {target}" if target else ""


def _blocker(request: LoadRequest, facts: Facts) -> tuple[str, str, str] | None:
    """(rule, reason_code, why) when the model must not be cast or moved here."""
    deliberate = facts.init.deliberate
    if deliberate is not None:
        return ("deliberate-init", *deliberate)
    if request.device == "meta":
        return ("deliberate-init", "meta_init", "the model's parameters are on the meta device")
    if request.quantized:
        return ("quantized", "quantized", "the model is quantized (the quantizer owns dtype)")
    if request.device_map is not None:
        return (
            "explicit-placement",
            "explicit_placement",
            f"an explicit device_map={request.device_map!r} was given",
        )
    if request.placement is not None:
        return ("explicit-placement", "explicit_placement", f"{request.placement} places the model")
    return None


def _observe(rule: str, code: str, problem: str, why: str, target: str = "") -> Action:
    return Action(rule, "observed", code, f"{problem}; left as is: {why}", None, target)


def _disabled(remedy: str, code: str, problem: str, target: str = "") -> Action:
    return _observe(
        "remedy-disabled",
        code,
        problem,
        f"remedy '{remedy}' is disabled (ATTNGUARD_DISABLE)",
        target,
    )


# --- the planner ---------------------------------------------------------------------------------


def _plan_backend(
    request: LoadRequest, facts: Facts, settings: Settings
) -> tuple[list[Action], dict[str, Any], set[str]]:
    """Step 1: a flash kernel that cannot run here -> the first usable fallback backend."""
    actions: list[Action] = []
    new_attn: dict[str, Any] = {}
    replaced: set[str] = set()
    fallback = first_usable_fallback(facts, settings)
    for target, want in _targets(request.attn_implementation):
        if not is_flash(want):
            continue
        status = facts.backend(want)
        if not request.supports_flash:
            code, problem, rule = (
                "model_unsupported",
                f"{want} requested{_target_label(target)}: {request.model or 'the model'} "
                "does not support flash attention",
                "flash-unsupported",
            )
        elif not status.usable:
            code, problem, rule = (
                status.reason_code,
                f"{want} requested{_target_label(target)}: {status.reason}",
                "flash-unusable",
            )
        else:
            continue
        if not settings.allows(FALLBACK):
            actions.append(_disabled(FALLBACK, code, problem, target))
        elif fallback is None:
            actions.append(
                _observe(
                    "no-fallback",
                    "no_fallback_usable",
                    problem,
                    f"no backend of ATTNGUARD_FALLBACK={','.join(settings.fallback)} is usable",
                    target,
                )
            )
        else:
            new_attn[target] = fallback
            replaced.add(_canonical(want))
            actions.append(
                Action(
                    rule,
                    "backend_fallback",
                    code,
                    f"{problem}; loading with {fallback}",
                    FALLBACK,
                    target,
                    want,
                    fallback,
                )
            )
    return actions, new_attn, replaced


def plan_backend(request: LoadRequest, facts: Facts, settings: Settings) -> Plan:
    """Only the backend rows: what the backend gate and set_attn_implementation decide
    (dtype and placement are decided where the whole load is seen)."""
    actions, new_attn, replaced = _plan_backend(request, facts, settings)
    attn = _rebuild(request.attn_implementation, new_attn) if new_attn else None
    return Plan(
        request=request,
        actions=tuple(actions),
        attn_implementation=attn if new_attn else request.attn_implementation,
        replaced_backends=frozenset(replaced),
    )


def plan_load(request: LoadRequest, facts: Facts, settings: Settings) -> Plan:
    """Decide what to change so the requested attention backend can run. See :data:`TABLE`."""
    actions, new_attn, replaced = _plan_backend(request, facts, settings)
    fallback = first_usable_fallback(facts, settings)
    requested_flash = [(t, v) for t, v in _targets(request.attn_implementation) if is_flash(v)]

    # flash kernels that will really run (an unusable one left alone is transformers' to refuse)
    still_flash = [
        (t, v)
        for t, v in requested_flash
        if t not in new_attn and request.supports_flash and facts.backend(v).usable
    ]
    blocker = _blocker(request, facts)
    dtype = request.effective_dtype
    new_dtype: str | None = None

    # 2. dtype: flash only runs in fp16 / bf16
    if still_flash and dtype == "float32":
        kernels = ", ".join(sorted({v for _, v in still_flash}))
        problem = f"{kernels} only runs in fp16/bf16 but the model would load in float32"
        if blocker is not None:
            actions.append(_observe(blocker[0], blocker[1], problem, blocker[2]))
        elif settings.fp32_policy == "fallback":
            if not settings.allows(FALLBACK):
                actions.append(_disabled(FALLBACK, "flash_needs_half", problem))
            elif fallback is None:
                actions.append(
                    _observe("no-fallback", "no_fallback_usable", problem, "no fallback usable")
                )
            else:
                for target, want in still_flash:
                    new_attn[target] = fallback
                    replaced.add(_canonical(want))
                    actions.append(
                        Action(
                            "fp32-fallback",
                            "backend_fallback",
                            "flash_needs_half",
                            f"{problem}; ATTNGUARD_FP32_POLICY=fallback keeps float32 and loads "
                            f"with {fallback}",
                            FALLBACK,
                            target,
                            want,
                            fallback,
                        )
                    )
                still_flash = []
        elif not settings.allows(CAST):
            actions.append(_disabled(CAST, "flash_needs_half", problem))
        else:
            new_dtype = half_dtype(facts, settings)
            actions.append(
                Action(
                    "fp32-cast",
                    "model_cast",
                    "flash_needs_half",
                    f"{problem}; loading in {new_dtype}",
                    CAST,
                    "",
                    "float32",
                    new_dtype,
                )
            )
    elif (
        requested_flash
        and dtype == "bfloat16"
        and facts.cuda
        and facts.local_gpu is not None
        and not facts.native_bf16
        and settings.dtype != "bf16"
    ):
        gpu = facts.local_gpu
        problem = (
            f"bfloat16 requested on {gpu.name} (compute capability "
            f"{gpu.capability[0]}.{gpu.capability[1]}), which has no native bf16"
        )
        if blocker is not None:
            actions.append(_observe(blocker[0], "no_native_bf16", problem, blocker[2]))
        elif not settings.allows(CAST):
            actions.append(_disabled(CAST, "no_native_bf16", problem))
        else:
            new_dtype = "float16"
            actions.append(
                Action(
                    "bf16-no-native",
                    "model_cast",
                    "no_native_bf16",
                    f"{problem}; loading in float16",
                    CAST,
                    "",
                    "bfloat16",
                    "float16",
                )
            )

    # 3. placement: a flash model built on the CPU
    new_device: str | None = None
    # where the model lands unless we act; a caller who placed it (device_map, tp_plan, hooks)
    # needs no placement
    placed_by_caller = request.device_map is not None or request.placement is not None
    on_cpu = not placed_by_caller and (
        (request.device is None and not facts.init.default_device.startswith("cuda"))
        or request.device == "cpu"
    )
    if still_flash and facts.cuda and on_cpu:
        kernels = ", ".join(sorted({v for _, v in still_flash}))
        problem = f"{kernels} needs the model on a GPU but it would be built on the CPU"
        index = facts.local_gpu_index
        if blocker is not None:
            actions.append(_observe(blocker[0], blocker[1], problem, blocker[2]))
        elif not settings.allows(PLACE):
            actions.append(_disabled(PLACE, "flash_needs_gpu", problem))
        elif index is None:
            actions.append(
                _observe(
                    "place-impossible",
                    "no_gpu_for_rank",
                    problem,
                    f"LOCAL_RANK={facts.launch.local_rank} names none of the "
                    f"{len(facts.gpus)} visible GPUs",
                )
            )
        elif request.device is None and not facts.accelerate:
            actions.append(
                _observe(
                    "place-impossible",
                    "accelerate_missing",
                    problem,
                    "accelerate (needed for device_map) is not installed",
                )
            )
        else:
            new_device = f"cuda:{index}"
            actions.append(
                Action(
                    "place-gpu",
                    "model_placed",
                    "flash_needs_gpu",
                    f"{problem}; loading it straight onto {new_device}",
                    PLACE,
                    "",
                    request.device or "cpu",
                    new_device,
                )
            )

    # 4. multi-process launch with a spreading device_map (family C, attnguard.multigpu)
    new_map, new_max = None, None
    decision = _device_map_decision(request, facts)
    if decision is not None:
        if facts.init.deliberate is not None:
            pass  # ZeRO-3 / FSDP refuse a device_map anyway; nothing of ours to add
        elif not settings.allows(DEVICE_MAP):
            actions.append(_disabled(DEVICE_MAP, decision.reason_code, decision.reason))
        else:
            new_map, new_max = decision.device_map, decision.max_memory
            actions.append(
                Action(
                    "device-map-per-rank",
                    "device_map_rewritten",
                    decision.reason_code,
                    decision.reason,
                    DEVICE_MAP,
                    "",
                    decision.before,
                    decision.after,
                )
            )

    attn = _rebuild(request.attn_implementation, new_attn) if new_attn else None
    return Plan(
        request=request,
        actions=tuple(actions),
        attn_implementation=attn if new_attn else request.attn_implementation,
        dtype=new_dtype,
        device=new_device,
        device_map=new_map,
        max_memory=new_max,
        replaced_backends=frozenset(replaced),
    )


def _device_map_decision(request: LoadRequest, facts: Facts) -> Any:
    """attnguard.multigpu's pure planner with these facts (issue 5)."""
    from .multigpu import plan_device_map, spreads_over_ranks

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


def flash_fp32_request(**overrides: Any) -> LoadRequest:
    """The request ``attnguard doctor`` plans for: flash_attention_2 + float32 + no device_map."""
    base = LoadRequest(
        model="(any model)",
        site="doctor",
        attn_implementation="flash_attention_2",
        dtype="float32",
    )
    return replace(base, **overrides)
