"""Every reason code attnguard emits: which events carry it, what it means, and what to change in
your own code so the guard has nothing left to do. The one vocabulary of reasons.

``events.emit`` refuses a code that is not here (``internal_error`` carries the failing
exception's type name instead); the tests read README.md and docs/*.md and check every
``reason_code`` they name against this table and the decision table of :mod:`attnguard.plan`, so
documentation and alerts written from it cannot drift from what the code says.
"""

from __future__ import annotations

from dataclasses import dataclass

from .advice import (
    Advice,
    Facts,
    diffusers_backend,
    flash_kernel,
    hub_package_missing,
    hub_package_refused,
    kernel_cannot,
    no_gpu_kernel,
    render,
)


@dataclass(frozen=True)
class Reason:
    code: str
    events: tuple[str, ...]
    meaning: str
    # what to change in your own code ("" where there is nothing to change): a sentence, or a
    # function of what happened (attnguard.observability.advice)
    hint: Advice


_INSTALL = "install flash-attn for this torch and GPU"
_FALLBACK = ("backend_fallback", "observed")

_TABLE: tuple[Reason, ...] = (
    # --- bookkeeping --------------------------------------------------------------------------
    Reason("activated", ("activated",), "attnguard was switched on in this process", ""),
    Reason("exit", ("summary",), "this process's summary at exit", ""),
    Reason("exit_all_ranks", ("summary",), "rank 0's summary of the whole job at exit", ""),
    Reason(
        "version_unsupported",
        ("observed",),
        "an installed library is outside the versions an integration supports: not patched",
        "use a version the integration supports (README, Compatibility)",
    ),
    Reason(
        "signature_unrecognised",
        ("observed",),
        "a flash-attn or xformers entry point takes parameters its twin does not (a release "
        "attnguard has not seen): that function is left unguarded",
        "upgrade attnguard for this flash-attn / xformers release",
    ),
    Reason(
        "import_in_progress",
        ("observed",),
        "a library's module was still being imported by another thread when attnguard "
        "activated, and its import could not be followed: that part is not patched",
        "activate attnguard before threads import the library (ATTNGUARD=1, or import "
        "attnguard first)",
    ),
    Reason(
        "log_path_refused",
        ("observed",),
        "the ATTNGUARD_LOG path is another user's (their link on the way, or their file): "
        "this process writes its events to a fresh file of its own, named in the event",
        "give ATTNGUARD_LOG a directory only you can write to",
    ),
    # --- load time: why a flash kernel cannot run here (attnguard.facts) -----------------------
    Reason(
        "package_missing",
        _FALLBACK,
        "flash attention requested, flash-attn is not installed",
        flash_kernel(_INSTALL),
    ),
    Reason(
        "extension_broken",
        _FALLBACK,
        "flash-attn is installed (or on the path without metadata) but fails to import",
        flash_kernel(
            "flash-attn's CUDA extension does not import (built for another torch?): reinstall "
            "it against this torch"
        ),
    ),
    Reason(
        "no_cuda",
        _FALLBACK,
        "flash attention needs a CUDA GPU and none is visible",
        flash_kernel(
            "run on a CUDA GPU",
            never_here="flash kernels need a CUDA GPU and none is visible here",
        ),
    ),
    Reason(
        "capability_too_low",
        _FALLBACK,
        "the GPU is below the kernel's compute capability (sm80 for flash-attn 2)",
        flash_kernel(
            "run on an Ampere (sm80) or newer GPU",
            never_here="flash-attn 2 needs an Ampere (sm80) or newer GPU, so there is nothing to "
            "install for this one",
        ),
    ),
    Reason(
        "version_too_old",
        _FALLBACK,
        "flash-attn is older than the oldest version transformers accepts",
        flash_kernel("upgrade flash-attn to a version transformers accepts"),
    ),
    Reason(
        "probe_failed",
        _FALLBACK,
        "flash-attn imports but a tiny test call failed on this GPU",
        flash_kernel(
            "a tiny flash-attn call failed on this GPU: reinstall flash-attn for it", on_a_gpu=True
        ),
    ),
    Reason(
        "torch_too_old",
        _FALLBACK,
        "the requested backend needs a newer torch",
        "upgrade torch, or request a backend this torch offers",
    ),
    Reason(
        "model_unsupported",
        _FALLBACK,
        "flash attention requested for a model class that does not support it",
        "this model class has no flash-attention support: request the backend attnguard loaded "
        "it with (the event's selected)",
    ),
    # --- load time: a hub kernel that does not load (attnguard.facts.hub, kernels) ------------
    Reason(
        "hub_package_missing",
        _FALLBACK,
        "flash attention from the Hugging Face kernel hub (an org/repo request, transformers' own "
        "fallback, a model routed to a hub kernel, a diffusers *_hub backend) needs the `kernels` "
        "package, which is not installed",
        flash_kernel(hub_package_missing),
    ),
    Reason(
        "hub_package_refused",
        _FALLBACK,
        "flash attention from the kernel hub, and the installed `kernels` package is outside the "
        "versions the library that loads it accepts (the event names both)",
        flash_kernel(hub_package_refused),
    ),
    Reason(
        "hub_kernel_unavailable",
        _FALLBACK,
        "flash attention from the kernel hub, and the hub kernel does not load here: offline "
        "without a cached build, no build for this torch and device, or its import failed (the "
        "event names kernels' own error)",
        flash_kernel(
            "fetch the hub kernel once with network into the Hugging Face cache (or point "
            "LOCAL_KERNELS at a copy) for this torch and GPU, or install flash-attn for them"
        ),
    ),
    Reason(
        "flash_path_unrecognised",
        ("observed",),
        "flash attention requested where its kernel cannot run, and attnguard does not recognise "
        "how this transformers release wires its flash code path (or how a diffusers *_hub "
        "backend calls its hub kernel): it steps aside (the load fails as it would without "
        "attnguard) rather than compute other numbers",
        flash_kernel(_INSTALL, first="upgrade attnguard for this transformers release"),
    ),
    Reason(
        "flash_argument_uncomputed",
        ("observed",),
        "flash attention requested where its kernel cannot run, and the model passes its "
        "attention an argument that attnguard's twins of the flash-attn kernels do not compute "
        "(transformers' flash path would drop it for them; at load: a model whose request "
        "transformers routes to another kernel, whose code passes it): attnguard steps aside, "
        "the load or the call fails as it would without attnguard, and the event names the "
        "argument",
        "install the kernel transformers chooses for this model (the event names it), or "
        'request attn_implementation="eager"',
    ),
    Reason(
        "flash_model_unrunnable",
        ("observed",),
        "flash attention requested where its kernel cannot run, and the model did not load on "
        "transformers' flash code path with attnguard's twins (its own flash code needs more of "
        "flash-attn than its kernels): attnguard steps aside, the load runs as it would without "
        "attnguard (its error is transformers' own)",
        flash_kernel(_INSTALL),
    ),
    Reason(
        "fallback_model_unrunnable",
        ("observed",),
        "a backend requested where it cannot run, and the model did not load with the fallback "
        "backend attnguard chose (a part of it, such as a vision tower, does not support that "
        "backend in this transformers release): attnguard steps aside, the load runs as "
        "requested, as it would without attnguard (its error is transformers' own)",
        no_gpu_kernel(
            "install the requested backend's package for this torch and GPU, or request a "
            "backend every part of the model supports",
            "request a backend every part of the model supports and this machine runs (it has "
            "no CUDA GPU)",
        ),
    ),
    Reason(
        "backend_package_unusable",
        _FALLBACK,
        "a diffusers attention backend was requested whose package diffusers cannot use here "
        "(not installed, fails to import, too old): its calls run on attnguard's twin of that "
        "package's function",
        diffusers_backend,
    ),
    Reason(
        "xformers_missing",
        _FALLBACK,
        "enable_xformers_memory_efficient_attention() where xformers is not installed: on a "
        "machine with CUDA diffusers' xformers attention processors run on attnguard's twin of "
        "xformers.ops.memory_efficient_attention; without CUDA diffusers' error stands (it "
        "refuses xformers there even where it is installed)",
        "install xformers for this torch, or drop enable_xformers_memory_efficient_attention(): "
        "diffusers' default attention processors already use torch SDPA",
    ),
    Reason(
        "no_twin",
        ("observed",),
        "the requested attention backend cannot run here and attnguard has no twin that computes "
        "its calls (or this kind of call): the library's own error stands",
        "install the backend's package, or choose a backend that runs here",
    ),
    Reason(
        "dispatch_unrecognised",
        ("observed",),
        "diffusers' attention dispatch is not shaped as attnguard knows it (a release attnguard "
        "has not seen): left unguarded",
        "upgrade attnguard for this diffusers release",
    ),
    Reason(
        "no_fallback_usable",
        ("observed",),
        "no backend of ATTNGUARD_FALLBACK is usable and supported by the model",
        "allow a fallback the model supports (ATTNGUARD_FALLBACK), or request one yourself",
    ),
    # --- load time: dtype and placement (attnguard.plan) --------------------------------------
    Reason(
        "flash_needs_half",
        ("model_cast", "backend_fallback", "observed"),
        "flash attention runs in fp16/bf16 and the model would load in float32",
        "load with dtype=torch.bfloat16 (torch_dtype= before transformers 4.56)",
    ),
    Reason(
        "no_native_bf16",
        ("model_cast", "observed"),
        "bfloat16 on a GPU without native bf16 (V100, T4)",
        "this GPU has no native bf16: load with dtype=torch.float16",
    ),
    Reason(
        "flash_needs_gpu",
        ("model_placed", "observed"),
        "flash attention needs the model on a GPU and it would be built on the CPU",
        'load with device_map={"": local_rank} (the model was built on the CPU)',
    ),
    Reason(
        "explicit_dtype",
        ("observed",),
        "the caller passed the dtype: it stands (the call-time guard carries flash calls)",
        "load with dtype=torch.bfloat16 to run the whole model in bf16, if that is what you want",
    ),
    Reason(
        "multi_rank",
        ("observed",),
        "several ranks load the model: the dtype is never changed at load (ranks must agree)",
        "choose the dtype in the load call on every rank (dtype=torch.bfloat16)",
    ),
    Reason(
        "training_script",
        ("observed",),
        "a training script (transformers' Trainer / TrainingArguments imported): float32 master "
        "weights under mixed precision are kept, the dtype is not changed at load",
        "load with dtype=torch.bfloat16 to train the whole model in bf16, if that is what you want",
    ),
    Reason(
        "explicit_placement",
        ("observed",),
        "the caller placed the model (device_map, tp_plan, a torch.device block, hooks)",
        "",
    ),
    Reason("zero3_init", ("observed",), "DeepSpeed ZeRO-3 builds the model on purpose", ""),
    Reason("fsdp_init", ("observed",), "FSDP (accelerate / Trainer) builds the model", ""),
    Reason("meta_init", ("observed",), "the model is built on the meta device on purpose", ""),
    Reason("quantized", ("observed",), "a quantized load: the quantizer owns dtype and device", ""),
    Reason(
        "accelerate_missing",
        ("observed",),
        "a placement would apply but accelerate (needed for device_map) is not installed",
        "install accelerate, or move the model to the GPU yourself",
    ),
    Reason(
        "no_gpu_for_rank",
        ("observed",),
        "a placement would apply but LOCAL_RANK names no visible GPU",
        "check CUDA_VISIBLE_DEVICES and the launcher's LOCAL_RANK",
    ),
    Reason(
        "model_too_large",
        ("observed",),
        "a placement would apply but the model does not fit the GPU",
        'split the model yourself (device_map="auto") or use a larger GPU',
    ),
    Reason(
        "plan_mismatch",
        ("plan_mismatch",),
        "after loading, the model is not what attnguard planned",
        "report it: attnguard's plan and the loaded model disagree",
    ),
    # --- several processes (attnguard.plan.device_map) ---------------------------------------------------
    Reason(
        "device_map_per_rank",
        ("device_map_rewritten", "observed"),
        "a spreading device_map under several ranks: one replica per rank",
        'under torchrun load with device_map={"": local_rank}',
    ),
    Reason(
        "device_map_shared_gpus",
        ("device_map_rewritten", "observed"),
        "more ranks than GPUs: ranks share GPUs round-robin",
        'more ranks than GPUs: load with device_map={"": local_rank % torch.cuda.device_count()}',
    ),
    Reason(
        "device_map_gpu_slice",
        ("device_map_rewritten", "observed"),
        "the model does not fit one GPU: each rank gets its own GPUs",
        "give each rank its own GPUs: device_map='auto' with max_memory covering only "
        "that rank's GPUs",
    ),
    Reason(
        "rotary_device_mismatch",
        ("tensors_aligned",),
        "a rotary embedding got inputs from another device",
        "keep the rotary embedding on its inputs' device (one GPU per replica: "
        'device_map={"": local_rank}), or upgrade transformers',
    ),
    # --- call time (attnguard.callguard, attnguard.kernels) ---------------------------------------
    Reason(
        "mixed_dtypes",
        ("qkv_unified",),
        "q, k, v of different dtypes",
        "cast q, k, v to one dtype before the attention call",
    ),
    Reason(
        "mask_dtype",
        ("qkv_unified",),
        "a float attention mask of another half dtype than q",
        "build the attention mask in the dtype of q, k, v",
    ),
    Reason(
        "bias_dtype",
        ("qkv_unified",),
        "an xformers attn_bias of another float dtype than q",
        "build the attention bias in the dtype of q, k, v",
    ),
    Reason(
        "fp32_into_flash",
        ("qkv_unified",),
        "float32 q/k/v into half-only flash-attn: run in half, output cast back",
        "run the model in bf16/fp16 (or autocast) where it calls a flash kernel",
    ),
    Reason(
        "device_mismatch",
        ("tensors_aligned", "kernel_error_recovered", "backend_rerouted"),
        "attention inputs on different devices",
        "compute q, k, v and the mask on one device",
    ),
    Reason(
        "cpu_tensors",
        ("backend_rerouted",),
        "a CUDA-only kernel (flash-attn, xformers) got CPU tensors",
        no_gpu_kernel(
            "this kernel runs on CUDA only: pass it tensors on the GPU",
            "this kernel runs on CUDA only and this machine has no GPU: attnguard's twin computes "
            "these calls (without it: torch.nn.functional.scaled_dot_product_attention)",
        ),
    ),
    Reason(
        "head_dim_unsupported",
        ("backend_rerouted", "kernel_error_recovered"),
        "flash-attn supports head_dim <= 256",
        kernel_cannot("flash kernels take head_dim <= 256"),
    ),
    Reason(
        "fp32_input",
        ("backend_rerouted",),
        "float32 into half-only flash-attn with ATTNGUARD_FP32_POLICY=fallback",
        "load the model in bf16/fp16, or keep ATTNGUARD_FP32_POLICY=fallback",
    ),
    Reason(
        "mask_4d",
        ("backend_rerouted",),
        "transformers' flash path got a 4D mask",
        kernel_cannot("flash kernels take a 2D padding mask only, not these custom masks"),
    ),
    Reason(
        "output_attentions",
        ("backend_rerouted",),
        "attention weights asked of flash attention",
        'output_attentions=True needs attn_implementation="eager"',
    ),
    # kernel errors recovered (attnguard.kernels.KNOWN_KERNEL_ERRORS)
    Reason(
        "gpu_too_old",
        ("kernel_error_recovered", "backend_rerouted"),
        "the kernel refused this GPU",
        kernel_cannot("this GPU cannot run the kernel"),
    ),
    Reason(
        "dtype_unsupported",
        ("kernel_error_recovered", "backend_rerouted"),
        "the kernel refused the dtype",
        "run the kernel in bf16/fp16 (load with dtype=torch.bfloat16)",
    ),
    Reason(
        "no_sdpa_kernel",
        ("kernel_error_recovered", "backend_rerouted"),
        "SDPA found no kernel for these inputs under the backends allowed",
        "no fused SDPA kernel takes these inputs: check dtype, mask and head_dim (and any "
        "sdpa_kernel context narrowing the backends)",
    ),
    Reason(
        "xformers_no_operator",
        ("kernel_error_recovered", "backend_rerouted"),
        "xformers has no operator for this call (its CUDA ops did not load)",
        "xformers has no working operator here (built for another torch?): reinstall xformers "
        "for this torch, or call torch.nn.functional.scaled_dot_product_attention",
    ),
    Reason(
        "cpu_backend",
        ("kernel_error_recovered", "backend_rerouted"),
        "a CUDA-only kernel was called with CPU tensors",
        no_gpu_kernel(
            "the kernel has no CPU implementation: run it on the GPU",
            "the kernel has no CPU implementation and this machine has no GPU: attnguard's twin "
            "computes these calls (without it: torch.nn.functional.scaled_dot_product_attention)",
        ),
    ),
    Reason(
        "no_kernel_image",
        ("kernel_error_recovered", "backend_rerouted"),
        "the kernel was not built for this GPU",
        "the kernel was not built for this GPU: reinstall it for this GPU",
    ),
    # --- opt-in kernel selection (ATTNGUARD_KERNEL=fastest; attnguard.selection) ---------------
    Reason(
        "faster_kernel",
        ("kernel_selected",),
        "another kernel computes this call's numbers (within the dtype's rounding) at least 5 % "
        "faster than the requested one, measured on this GPU: it serves the call",
        "nothing to change: ATTNGUARD_KERNEL=fastest serves these calls with the faster kernel",
    ),
    Reason(
        "requested_kept",
        ("kernel_selected",),
        "measured: no other kernel is both within tolerance and 5 % faster; the requested one "
        "stays",
        "nothing to change: the requested kernel is the fastest for these calls here",
    ),
    Reason(
        "not_raced",
        ("kernel_selected",),
        "no race was run for this bucket (this process's race budget spent, deterministic mode, "
        "several ranks and no process group, or the job's posted decision not usable here): the "
        "requested kernel stays",
        "nothing to change: the requested kernel computes these calls",
    ),
    # --- opt-in numbers check (ATTNGUARD_VERIFY; attnguard.verify) ----------------------------
    Reason(
        "kernel_numbers_differ",
        ("numerics_mismatch",),
        "a sampled attention call's output, computed by the requested kernel, differs from its "
        "family's reference beyond the tolerance of its dtype and shapes (its output was "
        "returned unchanged)",
        "this kernel gives wrong numbers here (a build for another GPU, a bug for these shapes): "
        "reinstall or upgrade it, or request another implementation, and report it to its "
        "authors with the event's shapes and arguments",
    ),
    Reason(
        "twin_numbers_differ",
        ("numerics_mismatch",),
        "a sampled attention call's output, computed by attnguard's SDPA twin, differs from the "
        "explicit float64 reference of the family's rules beyond the tolerance (its output was "
        "returned unchanged)",
        "report it: attnguard's twin computed other numbers than the kernel it stands for",
    ),
    Reason(
        "kernel_cache_ignored",
        ("observed",),
        "a kernel decision on disk was ignored (corrupt, another GPU or version, another "
        "user's, unreadable, or not a candidate for the call): it is measured again",
        "",
    ),
)

REASONS: dict[str, Reason] = {r.code: r for r in _TABLE}

# events whose reason_code is not from this table
FREE_CODE_EVENTS = ("internal_error",)  # the failing exception's type name


def known(event: str, reason_code: str | None) -> bool:
    """True when ``reason_code`` is a code of the vocabulary (or ``event`` carries free codes)."""
    return event in FREE_CODE_EVENTS or reason_code is None or reason_code in REASONS


def hint_for(event: str, reason_code: str | None, facts: Facts | None = None) -> str:
    """What to change in your own code so this event does not happen again, for what happened
    (``facts``; None: what holds on any machine)."""
    reason = REASONS.get(reason_code or "")
    if reason is not None and reason.hint:
        return render(reason.hint, facts)
    if event == "internal_error":
        return "report it: attnguard failed and ran your original call"
    if event == "observed":
        return "nothing to change (attnguard only looked)"
    return ""
