"""The decision table: every rule the load-time planner applies, as data (``attnguard doctor``
prints it, the tests walk every row), and the remedy names ATTNGUARD_DISABLE switches off.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        "transformers loads no hub kernel for it (no `kernels` package at a version it accepts, "
        "and no routing of the model to a hub kernel: otherwise the hub rules of "
        "attnguard.kernels.RULES apply); the model supports flash attention and "
        "attnguard's SDPA twins cover this transformers release; sdpa is the first usable "
        "backend of ATTNGUARD_FALLBACK",
        "keep transformers' flash code path (padding, packed rows, sliding windows, softcap, "
        "bottom-right causal alignment exactly as flash) and compute its kernel calls with "
        "attnguard's SDPA twins of the flash-attn functions (attnguard itself never fetches a "
        "hub kernel)",
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
        "model class supports (attnguard itself never fetches a hub kernel)",
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
        "one replica per rank, or a disjoint GPU slice per rank (attnguard.plan.device_map)",
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
