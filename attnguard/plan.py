"""The load-time planner: (request, facts, settings) -> Plan. Pure: no torch, no I/O, no events.

This module answers "what happens to a model that asks for flash attention here": which backend it
loads with, in which dtype, on which device. The decision table (:data:`TABLE`) is data:
``attnguard doctor`` prints it and the tests walk every row. :func:`plan_load` is the one
implementation of it; the transformers patches, ``guard_model`` and ``attnguard doctor`` call it.

Three principles shape the rows:

* **An explicit choice stands.** A dtype the caller passed, a placement they chose (``device_map``,
  ``tp_plan``, a ``with torch.device(...)`` block), a deliberate setup (DeepSpeed ZeRO-3, FSDP, meta
  init, quantization) is never overridden at load time. Where a flash kernel will then meet
  float32, the call-time guard carries each call (q/k/v cast for the kernel, output cast back) and
  one ``observed`` event says so. Only what nobody chose (4.x's default float32, 5.x's ``"auto"``
  resolving to a float32 checkpoint) may be cast or placed.
* **Ranks never diverge.** With several processes (``WORLD_SIZE > 1``) the dtype is never changed at
  load: one rank cannot see whether the others build on the meta device, and a cast on some ranks
  only hangs a sharded wrapper's first broadcast. Placement on ``cuda:LOCAL_RANK`` stays (every
  replicating wrapper needs it there; a sharding one moves each rank's part itself).
* **The run they would have had.** When flash attention was asked for but its kernel cannot run
  here, the model still gets what it would have had if flash had worked (the half dtype and the
  rank's GPU, when there is one), and transformers' flash code path is kept where attnguard's SDPA
  twins of the flash-attn kernels can run under it, so padded and packed batches, sliding windows,
  softcapping and the bottom-right causal alignment are computed exactly as flash would.

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
from .kernels import Kernel

# remedy names (as in ATTNGUARD_DISABLE)
FALLBACK, CAST, PLACE, DEVICE_MAP = "fallback", "cast", "place", "device_map"

# The kernel family that computes calls when transformers' flash code path is kept on attnguard's
# SDPA twins (``Plan.kernels``).
SDPA_TWINS = "sdpa"


@dataclass(frozen=True)
class Rule:
    """One row of the decision table."""

    id: str
    family: str  # failure family (README's table: "A", "B", "E", "C"), or "-" for a guard rail
    when: str
    then: str
    event: str
    reason_code: str  # fixed, or <...> where it comes from the facts / the multi-GPU planner
    remedy: str | None  # ATTNGUARD_DISABLE name that switches it off; None for observe rows


TABLE: tuple[Rule, ...] = (
    Rule(
        "flash-on-sdpa",
        "A/B",
        "flash_attention_2/3/4 requested and its kernel cannot run here; the reason code is the "
        "backend's status: package_missing, extension_broken (CUDA extension fails to import), "
        "no_cuda, capability_too_low, version_too_old, probe_failed (a tiny test call failed); "
        "the model supports flash attention and attnguard's SDPA twins cover this transformers "
        "release; sdpa is the first usable backend of ATTNGUARD_FALLBACK",
        "keep transformers' flash code path (padding, packed rows, sliding windows, softcap, "
        "bottom-right causal alignment exactly as flash) and compute its kernel calls with "
        "attnguard's SDPA twins of the flash-attn functions; never a hub kernel",
        "backend_fallback",
        "<backend status>",
        FALLBACK,
    ),
    Rule(
        "flash-path-unrecognised",
        "A/B",
        "as flash-on-sdpa, but attnguard does not recognise how this transformers release wires "
        "its flash code path (read from the module, then checked by running it once on recording "
        "stand-ins of the twins): no fallback would be known to compute flash's numbers",
        "change no backend: the request goes to transformers as made (where it refuses it, its "
        "own error stands), and the event says what was not recognised (never a backend that "
        "computes other numbers)",
        "observed",
        "flash_path_unrecognised",
        None,
    ),
    Rule(
        "flash-args-uncomputed",
        "A/B",
        "as flash-on-sdpa, but transformers routes this model's flash request to another kernel "
        "(the model's _compatible_flash_implementations) and the model's attention passes an "
        "argument attnguard's twins do not compute",
        "change no backend: the request goes to transformers as made (its routing, or its own "
        "error, stands); the event names the argument and the kernel transformers chooses",
        "observed",
        "flash_argument_uncomputed",
        None,
    ),
    Rule(
        "flash-unusable",
        "A/B",
        "as flash-on-sdpa, but the flash code path cannot be kept for this model: its class "
        "computes attention in classes of its own that bypass the patched kernel functions "
        "(transformers 4.49-4.53 without the attention registry, such as Qwen2-VL: their flash "
        "path is given no position_ids, so it detects no packed rows and sdpa computes the same), "
        "or ATTNGUARD_FALLBACK puts another backend first",
        "load with the first backend of ATTNGUARD_FALLBACK that is usable here and that the "
        "model class supports (never a hub kernel)",
        "backend_fallback",
        "<backend status>",
        FALLBACK,
    ),
    Rule(
        "flash-unsupported",
        "A",
        "flash requested for a model class that does not support flash attention",
        "load with the first backend of ATTNGUARD_FALLBACK that the model class supports",
        "backend_fallback",
        "model_unsupported",
        FALLBACK,
    ),
    Rule(
        "no-fallback",
        "A/B",
        "flash cannot run and no backend of ATTNGUARD_FALLBACK is usable and supported by the "
        "model class",
        "change nothing (transformers raises its own error)",
        "observed",
        "no_fallback_usable",
        None,
    ),
    Rule(
        "fp32-cast",
        "E",
        "flash requested (its kernel or the SDPA twins), a GPU for this rank, the model would be "
        "float32 because the caller chose no dtype (4.x default, 5.x 'auto' on a float32 "
        "checkpoint), one process that has not imported transformers' Trainer, "
        "ATTNGUARD_FP32_POLICY=cast (default), the model will live on a GPU",
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
        "flash requested with bfloat16 on a GPU without native bf16 (compute capability < 8.0), "
        "the caller chose no dtype, one process",
        "load in fp16 (unless ATTNGUARD_DTYPE=bf16)",
        "model_cast",
        "no_native_bf16",
        CAST,
    ),
    Rule(
        "explicit-dtype",
        "E",
        "a cast would apply, but the caller passed the dtype (torch_dtype= / dtype=)",
        "change nothing at load; each flash call runs in the half dtype (q/k/v cast for the "
        "kernel, the output cast back, the weights untouched)",
        "observed",
        "explicit_dtype",
        None,
    ),
    Rule(
        "ranks-agree",
        "E",
        "a cast would apply, but several processes load this model (WORLD_SIZE > 1): one rank "
        "cannot know that every other rank would make the same cast",
        "change nothing at load (a dtype on some ranks only would hang a sharded wrapper); "
        "flash calls are carried at call time",
        "observed",
        "multi_rank",
        None,
    ),
    Rule(
        "training-script",
        "E",
        "a cast would apply, but the program imported transformers' Trainer / TrainingArguments "
        "(a training script: bf16=True / fp16=True autocasts and keeps float32 master weights)",
        "change nothing at load (a cast would turn mixed-precision training into pure half "
        "training); flash calls are carried at call time (under autocast they are already half)",
        "observed",
        "training_script",
        None,
    ),
    Rule(
        "place-gpu",
        "A",
        "flash requested (its kernel or the SDPA twins), CUDA present, no placement chosen by "
        "the caller, the model would be built on the CPU",
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
        "a cast or a placement would apply, but DeepSpeed ZeRO-3 (HfDeepSpeedConfig, "
        "deepspeed.zero.Init), FSDP (accelerate / Trainer) or meta-device init builds the model "
        "on CPU / in fp32 on purpose",
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
        "a placement would apply (or a cast of a model the caller keeps off the GPU), but the "
        "caller placed the model (explicit device_map, tp_plan, a torch.device(...) block, "
        "accelerate hooks, or a model spread over devices)",
        "change nothing",
        "observed",
        "explicit_placement",
        None,
    ),
    Rule(
        "place-impossible",
        "A",
        "a placement would apply, but accelerate (needed for device_map) is missing, "
        "LOCAL_RANK names no visible GPU, or the model does not fit the GPU",
        "change nothing",
        "observed",
        "accelerate_missing | no_gpu_for_rank | model_too_large",
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
    # the caller chose the dtype (a concrete dtype passed; "auto" and nothing are not a choice)
    dtype_explicit: bool = False
    device_map: Any = None
    max_memory: Mapping[Any, Any] | None = None
    placement: str | None = None  # other explicit placement: "tp_plan", "accelerate hooks", ...
    device: str | None = None  # a built model: where its parameters are ("cpu", "cuda:0", "meta")
    quantized: bool = False
    supports_flash: bool = True
    supports_sdpa: bool = True
    supports_flex: bool = True
    # transformers' flash code path can run on attnguard's SDPA twins for this model here
    flash_path_on_twins: bool = False
    # why attnguard does not know this release's flash code path ("" when it does, or unasked)
    flash_path_unrecognised: str = ""
    # the kernel transformers itself would load for this model's flash request ("" = the
    # request), and the arguments its attention passes that the twins do not compute
    flash_routed_to: str = ""
    flash_uncomputed: tuple[str, ...] = ()
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
    """One decision, with the table row it comes from.

    ``problem`` says what is wrong (or, for an observation, what was seen and why it is left as it
    is); ``change`` says what fix mode does, as a phrase that reads after "attnguard will" / "would"
    ("load with sdpa"): the event's reason is worded from both and the mode.
    """

    rule: str
    event: str
    reason_code: str
    problem: str
    remedy: str | None = None
    target: str = ""  # sub-config key for per-sub-config backends ("" = the whole model)
    before: Any = None
    after: Any = None
    change: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)  # event-specific extras

    @property
    def applies(self) -> bool:
        """True for a change (fix mode applies it); False for an observation."""
        return self.event != "observed"

    def reason(self, mode: str = "fix") -> str:
        """The event's reason in ``mode``: what fix mode did, or would have done."""
        if not self.applies or not self.change:
            return self.problem
        if mode == "fix":
            return f"{self.problem}; attnguard: {self.change}"
        return f"{self.problem}; attnguard would {self.change} ({mode} mode: not applied)"


@dataclass(frozen=True)
class Plan:
    request: LoadRequest
    actions: tuple[Action, ...] = ()
    attn_implementation: str | Mapping[str, str | None] | None = None  # to load with
    dtype: str | None = None  # load dtype to inject; None = leave as requested
    device: str | None = None  # place the model here; None = leave
    device_map: Any = None  # new device_map (one replica per rank); None = leave
    max_memory: Mapping[Any, Any] | None = None
    replaced_backends: frozenset[str] = field(default_factory=frozenset)
    # "sdpa": flash kept as the code path, its kernel calls computed by the SDPA twins
    kernels: str | None = None

    @property
    def changes(self) -> list[Action]:
        return [a for a in self.actions if a.applies]

    @property
    def observations(self) -> list[Action]:
        return [a for a in self.actions if not a.applies]

    @property
    def backend_changed(self) -> bool:
        """The load must pass another ``attn_implementation`` than the caller's."""
        return self.attn_implementation != self.request.attn_implementation

    def as_dict(self) -> dict[str, Any]:
        return {
            "request": {
                k: (dict(v) if isinstance(v, Mapping) else v)
                for k, v in self.request.__dict__.items()
            },
            "attn_implementation": _jsonable(self.attn_implementation),
            "kernels": self.kernels,
            "dtype": self.dtype,
            "device": self.device,
            "device_map": _jsonable(self.device_map),
            "max_memory": _jsonable(self.max_memory),
            "actions": [
                {
                    **{k: v for k, v in a.__dict__.items() if k != "fields"},
                    **dict(a.fields),
                    "reason": a.reason(),
                    "applies": a.applies,
                }
                for a in self.actions
            ],
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


def _supported(request: LoadRequest, backend: str) -> bool:
    if backend == "sdpa":
        return request.supports_sdpa
    if backend == "flex_attention":
        return request.supports_flex
    return True  # eager: every model has it


def fallback_choice(
    request: LoadRequest, facts: Facts, settings: Settings, *, flash_path: bool
) -> tuple[str, str | None] | None:
    """(attn_implementation to load with, kernels) for a flash request that cannot keep its
    kernel: the first backend of ATTNGUARD_FALLBACK usable here and supported by the model class.

    "sdpa" means the SDPA twins under transformers' flash code path where ``flash_path`` allows
    it (flash semantics kept), else transformers' own sdpa path. None: nothing fits.
    """
    for name in settings.fallback:
        if name == "sdpa" and flash_path and request.flash_path_on_twins:
            return "flash_attention_2", SDPA_TWINS
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


def _lands_on_gpu(request: LoadRequest, facts: Facts) -> bool:
    """Do the caller's own choices put the model on a GPU (a built model already there, a
    device_map onto a GPU, tensor parallelism, a ``torch.device("cuda")`` block)?"""
    if request.device is not None:
        return request.device.startswith("cuda")
    if request.device_map is not None:
        return map_on_gpu(request.device_map)
    if request.placement == "tp_plan":
        return True
    return facts.init.default_device.startswith("cuda")


def _deliberate(request: LoadRequest, facts: Facts) -> tuple[str, str, str] | None:
    """(rule, reason_code, why) for a setup that owns dtype and placement itself."""
    deliberate = facts.init.deliberate
    if deliberate is not None:
        return ("deliberate-init", *deliberate)
    if request.device == "meta":
        return ("deliberate-init", "meta_init", "the model's parameters are on the meta device")
    if request.quantized:
        return ("quantized", "quantized", "the model is quantized (the quantizer owns dtype)")
    return None


# --- the planner ---------------------------------------------------------------------------------


@dataclass
class _Draft:
    """The plan being built by the steps of :func:`plan_load`."""

    actions: list[Action] = field(default_factory=list)
    new_attn: dict[str, Any] = field(default_factory=dict)
    replaced: set[str] = field(default_factory=set)
    kernels: str | None = None


def _plan_backend(request: LoadRequest, facts: Facts, settings: Settings, draft: _Draft) -> None:
    """Step 1: a flash kernel that cannot run here -> the flash path on the SDPA twins, or the
    first fallback backend the model supports."""
    for target, want in _targets(request.attn_implementation):
        if not is_flash(want):
            continue
        status = facts.backend(want)
        if not request.supports_flash:
            code = "model_unsupported"
            problem = (
                f"{want} requested{_target_label(target)}: {request.model or 'the model'} "
                "does not support flash attention"
            )
        elif not status.usable:
            code, problem = status.reason_code, f"{want} requested{_target_label(target)}: "
            problem += status.reason
            if request.flash_path_unrecognised:  # never a backend computing other numbers
                why = (
                    "attnguard does not recognise how this transformers release wires its flash "
                    f"code path ({request.flash_path_unrecognised}), so no fallback is known to "
                    "compute flash's numbers (packed rows, windows); the request goes to "
                    "transformers as made (where it refuses it, its own error stands)"
                )
                draft.actions.append(
                    _observe(
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
                    _observe(
                        "flash-args-uncomputed", "flash_argument_uncomputed", problem, why, target
                    )
                )
                continue
        else:
            continue
        choice = fallback_choice(request, facts, settings, flash_path=request.supports_flash)
        if not settings.allows(FALLBACK):
            draft.actions.append(_disabled(FALLBACK, code, problem, target))
            continue
        if choice is None:
            why = (
                f"no backend of ATTNGUARD_FALLBACK={','.join(settings.fallback)} is usable and "
                f"supported by {request.model or 'the model'}"
            )
            draft.actions.append(
                _observe("no-fallback", "no_fallback_usable", problem, why, target)
            )
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
            if _canonical(want) != attn:  # flash_attention_3/4: the same path, FA2's functions
                draft.new_attn[target] = attn
        else:
            rule = "flash-unsupported" if code == "model_unsupported" else "flash-unusable"
            change = f"load with {attn}"
            draft.new_attn[target] = attn
            draft.replaced.add(_canonical(want))
        draft.actions.append(
            Action(
                rule,
                "backend_fallback",
                code,
                problem,
                FALLBACK,
                target,
                want,
                Kernel.SDPA_TWIN.value if kernels == SDPA_TWINS else attn,
                change,
                fields,
            )
        )


def plan_backend(request: LoadRequest, facts: Facts, settings: Settings) -> Plan:
    """Only the backend rows: what the backend gate and set_attn_implementation decide
    (dtype and placement are decided where the whole load is seen)."""
    draft = _Draft()
    _plan_backend(request, facts, settings, draft)
    return _finish(request, draft)


def _finish(request: LoadRequest, draft: _Draft, **changes: Any) -> Plan:
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


def _requested_flash(request: LoadRequest) -> list[str]:
    return sorted({v for _, v in _targets(request.attn_implementation) if is_flash(v)})


def _real_flash(request: LoadRequest, facts: Facts, draft: _Draft) -> list[str]:
    """Flash kernels that will really run after step 1 (not replaced, usable here)."""
    return sorted(
        {
            v
            for t, v in _targets(request.attn_implementation)
            if is_flash(v)
            and t not in draft.new_attn
            and request.supports_flash
            and facts.backend(v).usable
        }
    )


def _plan_placement(
    request: LoadRequest, facts: Facts, settings: Settings, draft: _Draft, flash: list[str]
) -> str | None:
    """Step 2: a flash model that would be built on the CPU of a GPU machine. Returns the device
    to load onto, or None."""
    if not flash or not facts.cuda or _lands_on_gpu(request, facts):
        return None
    if request.device is not None and request.device != "cpu":
        return None  # a built model on meta: deliberate (step 3 says so)
    problem = f"{', '.join(flash)} needs the model on a GPU but it would be built on the CPU"
    deliberate = _deliberate(request, facts)
    by_caller = _placement_by_caller(request, facts)
    index = facts.local_gpu_index
    if deliberate is not None:
        draft.actions.append(_observe(deliberate[0], deliberate[1], problem, deliberate[2]))
    elif by_caller is not None:
        draft.actions.append(
            _observe("explicit-placement", "explicit_placement", problem, by_caller)
        )
    elif not settings.allows(PLACE):
        draft.actions.append(_disabled(PLACE, "flash_needs_gpu", problem))
    elif index is None:
        why = (
            f"LOCAL_RANK={facts.launch.local_rank} names none of the {len(facts.gpus)} visible GPUs"
        )
        draft.actions.append(_observe("place-impossible", "no_gpu_for_rank", problem, why))
    elif request.device is None and not facts.accelerate:
        why = "accelerate (needed for device_map) is not installed"
        draft.actions.append(_observe("place-impossible", "accelerate_missing", problem, why))
    elif _too_large(request, facts, index):
        gpu = facts.gpus[index]
        why = (
            f"its weights (about {(request.model_bytes or 0) / 2**30:.1f} GiB) do not fit "
            f"{gpu.name} ({gpu.total_memory / 2**30:.0f} GiB)"
        )
        draft.actions.append(_observe("place-impossible", "model_too_large", problem, why))
    else:
        device = f"cuda:{index}"
        draft.actions.append(
            Action(
                "place-gpu",
                "model_placed",
                "flash_needs_gpu",
                problem,
                PLACE,
                "",
                request.device or "cpu",
                device,
                f"load it straight onto {device}",
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


def _plan_dtype(
    request: LoadRequest,
    facts: Facts,
    settings: Settings,
    draft: _Draft,
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
    deliberate = _deliberate(request, facts)
    if deliberate is not None:
        draft.actions.append(_observe(deliberate[0], deliberate[1], problem, deliberate[2]))
    elif request.dtype_explicit:
        why = f"dtype={request.dtype} was passed explicitly; {carried}"
        draft.actions.append(_observe("explicit-dtype", "explicit_dtype", problem, why))
    elif facts.launch.world_size > 1:
        why = (
            f"WORLD_SIZE={facts.launch.world_size}: a load-time cast could differ between ranks "
            f"(some may build on the meta device) and hang a sharded wrapper; {carried}"
        )
        draft.actions.append(_observe("ranks-agree", "multi_rank", problem, why))
    elif code == "flash_needs_half" and facts.init.training_script:
        why = (
            "the program imported transformers' Trainer / TrainingArguments: its mixed precision "
            "(bf16=True / fp16=True) trains float32 master weights under autocast, which a cast at "
            f"load would turn into pure half training; {carried}"
        )
        draft.actions.append(_observe("training-script", "training_script", problem, why))
    elif not on_gpu:
        return None  # kept on the CPU (step 2 said why): a cast would only slow it there
    elif not settings.allows(CAST):
        draft.actions.append(_disabled(CAST, code, problem))
    else:
        rule = "fp32-cast" if code == "flash_needs_half" else "bf16-no-native"
        draft.actions.append(
            Action(rule, "model_cast", code, problem, CAST, "", before, new, f"load in {new}")
        )
        return new
    return None


def _fp32_fallback(
    request: LoadRequest, facts: Facts, settings: Settings, draft: _Draft, problem: str
) -> None:
    """ATTNGUARD_FP32_POLICY=fallback: keep float32, leave the flash kernel for a fallback."""
    choice = fallback_choice(request, facts, settings, flash_path=False)
    if not settings.allows(FALLBACK):
        draft.actions.append(_disabled(FALLBACK, "flash_needs_half", problem))
        return
    if choice is None:
        why = "no backend of ATTNGUARD_FALLBACK is usable and supported by the model"
        draft.actions.append(_observe("no-fallback", "no_fallback_usable", problem, why))
        return
    attn = choice[0]
    for target, want in _targets(request.attn_implementation):
        if is_flash(want) and target not in draft.new_attn:
            draft.new_attn[target] = attn
            draft.replaced.add(_canonical(want))
            draft.actions.append(
                Action(
                    "fp32-fallback",
                    "backend_fallback",
                    "flash_needs_half",
                    f"{problem}; ATTNGUARD_FP32_POLICY=fallback keeps float32",
                    FALLBACK,
                    target,
                    want,
                    attn,
                    f"load with {attn}",
                    {"attn_implementation": attn, "slower": attn == "eager"},
                )
            )


def plan_load(request: LoadRequest, facts: Facts, settings: Settings) -> Plan:
    """Decide what to change so the requested attention backend can run. See :data:`TABLE`."""
    draft = _Draft()
    _plan_backend(request, facts, settings, draft)  # 1. backend
    flash = _requested_flash(request)
    new_device = _plan_placement(request, facts, settings, draft, flash)  # 2. placement
    on_gpu = new_device is not None or _lands_on_gpu(request, facts)
    real = _real_flash(request, facts, draft)
    new_dtype = _plan_dtype(  # 3. dtype
        request, facts, settings, draft, flash=flash, real=real, on_gpu=on_gpu
    )

    # 4. multi-process launch with a spreading device_map (family C, attnguard.multigpu)
    new_map, new_max = None, None
    decision = _device_map_decision(request, facts)
    if decision is not None:
        if facts.init.deliberate is not None:
            pass  # ZeRO-3 / FSDP refuse a device_map anyway; nothing of ours to add
        elif not settings.allows(DEVICE_MAP):
            draft.actions.append(_disabled(DEVICE_MAP, decision.reason_code, decision.reason))
        else:
            new_map, new_max = decision.device_map, decision.max_memory
            draft.actions.append(
                Action(
                    "device-map-per-rank",
                    "device_map_rewritten",
                    decision.reason_code,
                    decision.reason,
                    DEVICE_MAP,
                    "",
                    decision.before,
                    decision.after,
                    f"load with device_map={decision.device_map!r}",
                )
            )

    return _finish(
        request,
        draft,
        dtype=new_dtype,
        device=new_device,
        device_map=new_map,
        max_memory=new_max,
    )


def _device_map_decision(request: LoadRequest, facts: Facts) -> Any:
    """attnguard.multigpu's pure planner with these facts."""
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
