"""Per-call guard shared by every attention entry point: the registry, flash_attn and xformers.

Each entry point gets a plain closure (``functools.wraps``; never a wrapt proxy, which breaks
torch.compile). The closure runs a fast check inline, cheapest first: q/k/v dtypes, devices, and
for flash kernels what they cannot take. Nothing wrong (the common case) -> the original runs,
inside a ``try`` that costs nothing until it raises. Something wrong -> :func:`_fail_open` runs the
slow path, where the remedies live:

* ``unify``: q/k/v (and a float mask or bias) of mixed dtypes -> one dtype (``qkv_unified``);
* ``align``: q/k/v/mask on different devices -> the query's device (``tensors_aligned``);
* ``cast``: float32 into a half-only flash kernel -> half for the kernel, output cast back;
* ``reroute``: a kernel given what it cannot take -> this call on SDPA (``backend_rerouted``,
  latched per site);
* ``recover``: a known, recoverable kernel error -> the same call re-run once on SDPA, the site
  latched (``kernel_error_recovered``). Unknown errors propagate untouched.

Modes: fix applies remedies; warn emits the same events with ``applied=False`` and changes nothing;
strict raises :class:`AttnGuardError` instead of applying a remedy. Inside a torch.compile trace
nothing is emitted or latched (side effects break ``fullgraph=True``), but the fixes still land in
the graph because they are plain tensor ops decided from static facts (dtype, device, shape).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Hashable
from typing import Any

import torch
import torch.nn.functional as F

from . import events, runtime
from .errors import AttnGuardError
from .patching import OriginalCall
from .patching import fail_open as _fail_open

Tensor = torch.Tensor
_BF16 = torch.bfloat16
_FP16 = torch.float16
_FP32 = torch.float32
_BOOL = torch.bool
HALF_DTYPES = (_FP16, _BF16)
FLASH_MAX_HEAD_DIM = 256

# (substring of the error message, reason_code). Matched against the first lines of RuntimeError /
# ValueError (NotImplementedError is a RuntimeError). Anything else is unknown and propagates.
KNOWN_KERNEL_ERRORS: tuple[tuple[str, str], ...] = (
    ("only supports Ampere GPUs or newer", "gpu_too_old"),
    ("bfloat16 is only supported on Ampere GPUs or newer", "gpu_too_old"),
    ("only support fp16 and bf16", "dtype_unsupported"),
    ("No available kernel", "no_sdpa_kernel"),
    ("No viable backend for scaled_dot_product_attention", "no_sdpa_kernel"),
    ("head dimension", "head_dim_unsupported"),
    ("No operator found for `memory_efficient_attention", "xformers_no_operator"),
    ("Expected all tensors to be on the same device", "device_mismatch"),
    ("with arguments from the 'CPU' backend", "cpu_backend"),
    ("no kernel image is available for execution on the device", "no_kernel_image"),
)

# site key -> reason_code of the decision that latched it. Latched sites skip the kernel and go
# straight to the fallback: a failing kernel is not retried on every call.
latched: dict[Hashable, str] = {}

_REMEDY_TEXT = {
    "unify": "cast q/k/v (and mask/bias) to one dtype",
    "align": "move q/k/v and the mask to the query's device",
    "cast": "run the kernel in a half dtype and cast the output back",
    "reroute": "run this call on torch SDPA",
    "recover": "re-run this call on torch SDPA",
}


# --- modes, events, latches ---------------------------------------------------------------------


def _note(event: str, site: str, reason_code: str, reason: str, **fields: Any) -> None:
    """Emit an event, except inside a torch.compile trace (no side effects there)."""
    if events.is_compiling():
        return
    try:
        events.emit(event, site=site, reason_code=reason_code, reason=reason, **fields)
    except Exception:
        pass  # a logging failure must never fail the user's call


def decide(
    remedy: str, event: str, site: str, reason_code: str, reason: str, **fields: Any
) -> bool:
    """True: apply ``remedy``. False: leave the call alone (warn mode, or the remedy disabled).

    Strict mode raises AttnGuardError instead. The event says whether the remedy was applied.
    """
    st = runtime.settings()
    if not st.enabled or not st.allows(remedy):
        return False
    if st.mode == "strict":
        raise AttnGuardError(reason_code, reason, _REMEDY_TEXT.get(remedy, remedy))
    apply = st.mode == "fix"
    _note(event, site, reason_code, reason, applied=apply, **fields)
    return apply


def latch(key: Hashable, reason_code: str) -> None:
    if not events.is_compiling():
        latched.setdefault(key, reason_code)


def reset_latches() -> None:
    """Forget every latched site (tests; and after deactivate nothing should stay latched)."""
    latched.clear()


def classify_kernel_error(exc: BaseException) -> tuple[str, str] | None:
    """(reason_code, first line) for a known recoverable kernel error, else None."""
    if not isinstance(exc, (RuntimeError, ValueError)) or isinstance(exc, AttnGuardError):
        return None
    text = str(exc)
    head = text[:2000]
    for needle, code in KNOWN_KERNEL_ERRORS:
        if needle in head:
            first = (text.strip().splitlines() or [""])[0][:300]
            return code, first
    return None


# --- dtype facts ------------------------------------------------------------------------------


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype in force for ``device_type``, or None when autocast is off."""
    try:
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        return None
    return None


def module_dtype(module: Any) -> torch.dtype | None:
    """The dtype the module computes in: what transformers' flash path calls the target dtype.

    Quantized models report their pre-quantization dtype; otherwise the first Linear weight,
    then the first floating parameter.
    """
    config = getattr(module, "config", None)
    pre = getattr(config, "_pre_quantization_dtype", None)
    if isinstance(pre, torch.dtype):
        return pre
    if not isinstance(module, torch.nn.Module):
        return None
    for sub in module.modules():
        if isinstance(sub, torch.nn.Linear) and sub.weight.is_floating_point():
            return sub.weight.dtype
    for p in module.parameters():
        if p.is_floating_point():
            return p.dtype
    return None


_half_by_device: dict[int, torch.dtype] = {}


def half_dtype_for(device: torch.device) -> torch.dtype:
    """The half dtype to run a half-only kernel in: ATTNGUARD_DTYPE, else bf16 where native."""
    choice = runtime.settings().dtype
    if choice == "bf16":
        return _BF16
    if choice == "fp16":
        return _FP16
    if device.type != "cuda":
        return _BF16
    index = device.index if device.index is not None else torch.cuda.current_device()
    dtype = _half_by_device.get(index)
    if dtype is None:
        # is_bf16_supported() counts emulation (True on V100/T4); capability says native.
        major = torch.cuda.get_device_capability(index)[0]
        dtype = _BF16 if major >= 8 else _FP16
        _half_by_device[index] = dtype
    return dtype


def choose_dtype(
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
    *,
    preferred: torch.dtype | None = None,
    half_only: bool = False,
) -> torch.dtype:
    """One dtype for mixed q/k/v (``dtypes[0]`` is the query's).

    The autocast dtype if autocast is on; else ``preferred`` (the module's weight dtype) when it
    suits the kernel; else the half dtype among the inputs (the fp32 one is the accident: an fp32
    scale or norm upcast it); else the widest. Never float32 for a half-only kernel.
    """
    auto = autocast_dtype(device.type)
    if auto is not None and (not half_only or auto in HALF_DTYPES):
        return auto
    if (
        preferred is not None
        and preferred.is_floating_point
        and (not half_only or preferred in HALF_DTYPES)
    ):
        return preferred
    halves = [d for d in dtypes if d in HALF_DTYPES]
    if halves:
        return dtypes[0] if dtypes[0] in HALF_DTYPES else halves[0]
    if half_only:
        return half_dtype_for(device)
    out = dtypes[0]
    for d in dtypes[1:]:
        if d.is_floating_point:
            out = torch.promote_types(out, d)
    return out


def _dtype_names(**tensors: Any) -> dict[str, str]:
    return {k: str(t.dtype).replace("torch.", "") for k, t in tensors.items() if t is not None}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _cast_out(result: Any, dtype: torch.dtype | None) -> Any:
    """Cast the attention output (first item of a tuple result) to ``dtype``."""
    if dtype is None:
        return result
    if isinstance(result, Tensor):
        return result if result.dtype == dtype else result.to(dtype)
    if isinstance(result, tuple) and result and isinstance(result[0], Tensor):
        out = result[0]
        return (out if out.dtype == dtype else out.to(dtype), *result[1:])
    return result


# --- attention on SDPA, in transformers' (B, H, S, D) layout --------------------------------------


def _repeat_heads(x: Tensor, n_rep: int) -> Tensor:
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def sdpa_bhsd(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    *,
    dropout: float,
    scale: float | None,
    is_causal: bool,
) -> Tensor:
    """torch SDPA on (B, H, S, D) with GQA; output (B, S, H, D) like the registry functions.

    No backend is forced: the dispatcher picks the fused kernel it would pick for plain sdpa.
    """
    n_rep = query.shape[1] // key.shape[1]
    extra: dict[str, Any] = {}
    if n_rep > 1:
        if mask is None:
            extra["enable_gqa"] = True
        else:  # with a mask, repeated heads keep the fused kernels eligible
            key, value = _repeat_heads(key, n_rep), _repeat_heads(value, n_rep)
    if mask is not None and mask.dtype != _BOOL and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    try:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=mask,
            dropout_p=dropout,
            scale=scale,
            is_causal=is_causal,
            **extra,
        )
    except TypeError:  # torch without enable_gqa
        key, value = _repeat_heads(key, n_rep), _repeat_heads(value, n_rep)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scale, is_causal=is_causal
        )
    return out.transpose(1, 2).contiguous()


def eager_bhsd(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    *,
    dropout: float,
    scale: float | None,
    softcap: float | None = None,
    sinks: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Explicit attention (transformers' eager math) for what SDPA cannot do: attention weights,
    softcapping, attention sinks. Returns (output (B, S, H, D), weights (B, H, Sq, Sk))."""
    n_rep = query.shape[1] // key.shape[1]
    key, value = _repeat_heads(key, n_rep), _repeat_heads(value, n_rep)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == _BOOL:
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask.to(scores.dtype)
    if sinks is not None:
        b, h, sq, _ = scores.shape
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(b, h, sq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1, dtype=_FP32)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1, dtype=_FP32)
    probs = probs.to(query.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), probs


def _segments(positions: Tensor) -> Tensor:
    """Segment ids (B, S) of packed sequences: a new one wherever the position does not grow."""
    starts = torch.ones_like(positions, dtype=torch.long)
    starts[:, 1:] = (positions[:, 1:] <= positions[:, :-1]).long()
    return starts.cumsum(-1)


def _segments_from_cu(cu: Tensor, total: int) -> Tensor:
    """Segment ids (1, total) from cumulative sequence lengths."""
    idx = torch.arange(total, device=cu.device)
    return torch.bucketize(idx, cu[1:].to(idx.dtype), right=True).unsqueeze(0)


def flash_mask_for_sdpa(
    mask: Tensor | None,
    sq: int,
    sk: int,
    device: torch.device,
    *,
    causal: bool,
    sliding_window: int | None = None,
    segments: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, bool]:
    """Build what SDPA needs from what a flash path receives.

    ``mask`` is the 2D (B, S) padding mask (1 = token) flash functions get, or a 4D mask in SDPA
    form (used as it is), or None. Causality is bottom-right aligned as flash-attn's (query ``i``
    sees keys ``j <= i + sk - sq``). Returns (keep mask (B|1, 1, sq, sk) bool or a 4D float mask
    or None, rows to zero (B|1, sq, 1, 1) or None, is_causal for SDPA). Rows with no visible key
    and padded query tokens give zeros, as flash-attn's unpadded output does; no NaN.
    """
    if mask is not None and mask.dim() == 4:
        mask = mask[:, :, :, :sk]
        if mask.dtype == _BOOL:
            empty = ~mask.any(dim=-1, keepdim=True)
            return mask | empty, empty.transpose(1, 2), False
        return mask, None, False
    pad = None
    if mask is not None:
        pad = mask[:, -sk:] if mask.shape[-1] >= sk else None
        if pad is None:  # shorter than the keys: left part is unmasked history
            extra = mask.new_ones(mask.shape[0], sk - mask.shape[-1])
            pad = torch.cat([extra, mask], dim=-1)
        pad = pad.to(_BOOL)
    window = sliding_window if sliding_window is not None and sk > sliding_window else None
    if pad is None and window is None and segments is None:
        if not causal or sq == 1:
            return None, None, False
        if sq == sk:
            return None, None, True
    i = torch.arange(sq, device=device).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=device).unsqueeze(0)
    keep = torch.ones(sq, sk, dtype=_BOOL, device=device)
    if causal:
        keep = keep & (j <= i)
    if window is not None:
        # transformers: flash window (w - 1, w - 1); SDPA/eager masks keep i - j < w.
        keep = keep & ((i - j) < window)
        if not causal:
            keep = keep & ((j - i) < window)
    keep = keep[None, None]
    zero_rows = None
    if pad is not None:
        keep = keep & pad[:, None, None, :]
        zero_rows = ~pad[:, -sq:]
    if segments is not None:
        seg_q, seg_k = segments[:, -sq:], segments[:, -sk:]
        keep = keep & (seg_q[:, None, :, None] == seg_k[:, None, None, :])
    empty = ~keep.any(dim=-1)  # (B|1, 1, sq)
    keep = keep | empty.unsqueeze(-1)
    empty = empty.squeeze(1)
    zero_rows = empty if zero_rows is None else (zero_rows | empty)
    return keep, zero_rows[:, :, None, None], False


def _arg(rest: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    """Argument ``name`` of a registry call: positional slot ``index`` after q/k/v, or keyword."""
    if len(rest) > index:
        return rest[index]
    return kwargs.get(name, default)


def flash_call_on_sdpa(
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None,
    rest: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    """Compute a transformers flash registry call with SDPA (or eager math where SDPA cannot).

    Same inputs (B, H, S, D), same output (B, S, H, D); padding, causality, sliding window and
    packed sequences from the flash call's own arguments.
    """
    dropout = float(_arg(rest, kwargs, 1, "dropout", 0.0) or 0.0)
    scale = _arg(rest, kwargs, 2, "scaling", None)
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = bool(getattr(module, "is_causal", True))
    sq, sk = query.shape[2], key.shape[2]
    segments = None
    if mask is None and query.shape[0] == 1 and sq == sk and sq > 1:
        cu = kwargs.get("cu_seq_lens_k")
        pos = kwargs.get("position_ids")
        if isinstance(cu, Tensor):
            segments = _segments_from_cu(cu.to(query.device), sk)
        elif isinstance(pos, Tensor) and pos.shape[-1] == sk and not events.is_compiling():
            pos = pos.to(query.device).reshape(1, -1)
            if bool((pos[:, 1:] <= pos[:, :-1]).any()):  # packed (padding-free) batch
                segments = _segments(pos)
    keep, zero_rows, is_causal = flash_mask_for_sdpa(
        mask,
        sq,
        sk,
        query.device,
        causal=bool(causal),
        sliding_window=kwargs.get("sliding_window"),
        segments=segments,
    )
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    weights = None
    if kwargs.get("output_attentions") or softcap or sinks is not None:
        if is_causal:  # eager math needs the causal mask spelled out
            keep = torch.ones(sq, sk, dtype=_BOOL, device=query.device).tril(sk - sq)[None, None]
        out, weights = eager_bhsd(
            query, key, value, keep, dropout=dropout, scale=scale, softcap=softcap, sinks=sinks
        )
    else:
        out = sdpa_bhsd(query, key, value, keep, dropout=dropout, scale=scale, is_causal=is_causal)
    if zero_rows is not None:
        out = out.masked_fill(zero_rows, 0.0)
    return out, weights


def _all_sdpa_backends() -> Any:
    """A context letting SDPA's dispatcher choose among all its backends again (after "No
    available kernel" under a narrower ``sdpa_kernel`` context): it still picks the fastest
    kernel that can run, the math one only when none of the fused ones can."""
    import contextlib

    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return contextlib.nullcontext()
    names = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
    backends = [getattr(SDPBackend, n) for n in names if hasattr(SDPBackend, n)]
    return sdpa_kernel(backends)


def _move_tensors(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, Tensor) and obj.device != device:
        return obj.to(device)
    return obj


# --- the transformers attention registry ----------------------------------------------------------

KIND_FLASH = "flash"
KIND_SDPA = "sdpa"
KIND_OTHER = "other"


def registry_kind(name: str) -> str:
    """How the guard treats a registry key: flash rules, sdpa rules, or dtype/device only."""
    low = name.lower()
    if "paged" in low:
        return KIND_OTHER  # the cache update runs inside: never re-run or reroute these
    if "flash" in low:
        return KIND_FLASH
    if low == "sdpa":
        return KIND_SDPA
    return KIND_OTHER


def _mask_dtype_ok(mask_dtype: torch.dtype, dtype: torch.dtype) -> bool:
    return (
        mask_dtype is dtype
        or mask_dtype is _BOOL
        or mask_dtype is _FP32
        or not mask_dtype.is_floating_point
    )


def _flash_cannot_take(query: Tensor, mask: Any, kwargs: dict[str, Any]) -> str | None:
    """Why a flash kernel cannot take this call (reason_code), or None. Pure, cheap."""
    if query.is_cpu:
        return "cpu_tensors"
    if isinstance(mask, Tensor) and mask.dim() == 4:
        return "mask_4d"
    if kwargs.get("output_attentions"):
        return "output_attentions"
    if query.shape[-1] > FLASH_MAX_HEAD_DIM:
        return "head_dim_unsupported"
    return None


_REROUTE_REASONS = {
    "cpu_tensors": "flash attention kernels run on CUDA only; this call got CPU tensors",
    "mask_4d": "flash attention takes a 2D padding mask; this call got a 4D mask",
    "output_attentions": "flash attention cannot return attention weights (output_attentions)",
    "head_dim_unsupported": f"flash attention supports head_dim <= {FLASH_MAX_HEAD_DIM}",
    "fp32_input": "float32 inputs into a half-only flash kernel (ATTNGUARD_FP32_POLICY=fallback)",
}


def _registry_site(name: str, module: Any) -> str:
    return f"transformers.{name}:{type(module).__name__}"


def wrap_registry_entry(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A guarded closure for one attention-registry function (signature preserved).

    Registry functions are called ``fn(module, query, key, value, attention_mask, ...)``. The
    closure takes ``*args`` (forwarding the tuple as it is is the cheapest call Python has) and
    inlines its checks (a helper call would cost as much as a check), inside a ``try``: an odd
    input that makes a check raise goes to the slow path, never to the user. Devices compare as
    ``get_device()`` integers, cheaper than ``torch.device`` objects.
    """
    kind = registry_kind(name)
    rt = runtime
    lat = latched
    slow = functools.partial(_registry_slow, name=name, kind=kind)

    def on_slow(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return _fail_open(_registry_site(name, args[0]), original, slow, args, kwargs)

    def on_error(exc: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if (
            len(args) < 4
            or not rt._settings.enabled
            or events.is_compiling()
            or classify_kernel_error(exc) is None
        ):
            raise exc
        recover = functools.partial(_registry_recover, name=name, kind=kind, error=exc)
        site = _registry_site(name, args[0])
        return _fail_open(site, original, recover, args, kwargs, own_error=exc)

    if kind == KIND_FLASH:

        def attnguard_attention(*args: Any, **kwargs: Any) -> Any:
            if rt._settings.enabled and len(args) > 3:
                try:
                    query = args[1]
                    key = args[2]
                    value = args[3]
                    dt = query.dtype
                    dev = query.get_device()
                    mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
                    bad = (
                        key.dtype is not dt
                        or value.dtype is not dt
                        or (dt is not _BF16 and dt is not _FP16)
                        or query.is_cpu
                        or key.get_device() != dev
                        or value.get_device() != dev
                        or (mask is not None and (mask.get_device() != dev or mask.dim() == 4))
                        or query.shape[3] > FLASH_MAX_HEAD_DIM
                        or kwargs.get("output_attentions")
                        or (lat and (name, type(args[0])) in lat)
                    )
                except Exception:
                    bad = True
                if bad:
                    return on_slow(args, kwargs)
            try:
                return original(*args, **kwargs)
            except Exception as exc:
                return on_error(exc, args, kwargs)

    else:

        def attnguard_attention(*args: Any, **kwargs: Any) -> Any:
            if rt._settings.enabled and len(args) > 3:
                try:
                    query = args[1]
                    key = args[2]
                    value = args[3]
                    dt = query.dtype
                    dev = query.get_device()
                    mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
                    bad = (
                        key.dtype is not dt
                        or value.dtype is not dt
                        or key.get_device() != dev
                        or value.get_device() != dev
                        or (
                            mask is not None
                            and isinstance(mask, Tensor)
                            and (
                                mask.get_device() != dev
                                or (
                                    (md := mask.dtype) is not dt
                                    and md is not _BOOL
                                    and md is not _FP32
                                    and md.is_floating_point
                                )
                            )
                        )
                        or (lat and (name, type(args[0])) in lat)
                    )
                except Exception:
                    bad = True
                if bad:
                    return on_slow(args, kwargs)
            try:
                return original(*args, **kwargs)
            except Exception as exc:
                return on_error(exc, args, kwargs)

    guarded = functools.wraps(original)(attnguard_attention)
    guarded.__attnguard_original__ = original  # type: ignore[attr-defined]
    return guarded


def _registry_slow(call: OriginalCall, *args: Any, name: str, kind: str, **kwargs: Any) -> Any:
    module, query, key, value = args[0], args[1], args[2], args[3]
    rest = args[4:]
    mask_in_args = len(rest) > 0
    mask = rest[0] if mask_in_args else kwargs.get("attention_mask")
    site = _registry_site(name, module)
    latch_key = (name, type(module))
    paged = kwargs.get("cache") is not None
    flash = kind == KIND_FLASH and not paged
    dev = query.device

    # (b) devices first: the dtype decision below must look at tensors on one device.
    strays = {
        n: str(t.device)
        for n, t in (("key", key), ("value", value), ("attention_mask", mask))
        if isinstance(t, Tensor) and t.device != dev
    }
    if strays and decide(
        "align",
        "tensors_aligned",
        site,
        "device_mismatch",
        f"attention inputs on different devices; moved to the query's device {dev}",
        moved=strays,
        to=str(dev),
    ):
        key, value, mask = key.to(dev), value.to(dev), _move_tensors(mask, dev)

    reroute = lat_reason = latched.get(latch_key)
    if flash and reroute is None:
        reroute = _flash_cannot_take(query, mask, kwargs)

    # (a) one dtype for q/k/v (and a float mask).
    autocast_on = autocast_dtype(dev.type) is not None
    wanted = module_dtype(module)
    # The dtype the caller's next layer takes: the module's (under autocast, whatever comes).
    expected = None if autocast_on else wanted
    dts = (query.dtype, key.dtype, value.dtype)
    mixed = dts[1] is not dts[0] or dts[2] is not dts[0]
    if mixed:
        half_only = flash and reroute is None
        target = choose_dtype(dts, dev, preferred=wanted, half_only=half_only)
        if decide(
            "unify",
            "qkv_unified",
            site,
            "mixed_dtypes",
            f"q/k/v dtypes differ; unified to {_name(target)}",
            **{"from": _dtype_names(query=query, key=key, value=value), "to": _name(target)},
        ):
            query, key, value = query.to(target), key.to(target), value.to(target)
    if (
        isinstance(mask, Tensor)
        and mask.dtype.is_floating_point
        and not _mask_dtype_ok(mask.dtype, query.dtype)
        and decide(
            "unify",
            "qkv_unified",
            site,
            "mask_dtype",
            f"float attention mask dtype differs from the query's; cast to {_name(query.dtype)}",
            **{"from": {"attention_mask": _name(mask.dtype)}, "to": _name(query.dtype)},
        )
    ):
        mask = mask.to(query.dtype)

    # (c) float32 into a half-only flash kernel.
    precast = (query, key, value)
    cast_back = None
    if flash and reroute is None and query.dtype not in HALF_DTYPES:
        # transformers casts fp32 inputs itself to the autocast / weight dtype; only when that
        # is float32 too would the kernel raise.
        own_target = autocast_dtype(dev.type) if autocast_on else wanted
        if own_target not in HALF_DTYPES:
            if runtime.settings().fp32_policy == "fallback":
                reroute = "fp32_input"
            else:
                half = half_dtype_for(dev)
                if decide(
                    "cast",
                    "qkv_unified",
                    site,
                    "fp32_into_flash",
                    f"float32 inputs into a half-only flash kernel; run in {_name(half)}, "
                    f"output cast back to {_name(query.dtype)}",
                    **{"from": _dtype_names(query=query), "to": _name(half)},
                ):
                    cast_back = expected or query.dtype
                    query, key, value = query.to(half), key.to(half), value.to(half)

    # (d) this call goes to SDPA.
    rerouted = (
        reroute is not None
        and kind != KIND_OTHER
        and (
            lat_reason is not None
            or decide(
                "reroute",
                "backend_rerouted",
                site,
                reroute,
                _REROUTE_REASONS.get(reroute, f"{name} cannot run this call ({reroute})"),
                requested=name,
                selected="sdpa",
            )
        )
    )
    if rerouted:
        latch(latch_key, reroute)
        out = _run_fallback(kind, module, query, key, value, mask, rest, kwargs, call)
        return _cast_out(out, expected if mixed else None)

    new_args = (module, query, key, value, *((mask,) + rest[1:] if mask_in_args else ()))
    new_kwargs = (
        kwargs
        if mask_in_args or "attention_mask" not in kwargs
        else {
            **kwargs,
            "attention_mask": mask,
        }
    )
    try:
        out = call(*new_args, **new_kwargs)
    except Exception as exc:
        known = classify_kernel_error(exc)
        if known is None or kind == KIND_OTHER or paged:
            raise
        q0, k0, v0 = precast
        out = _recover_and_run(
            known, exc, name, kind, site, latch_key, call, module, q0, k0, v0, mask, rest, kwargs
        )
        return _cast_out(out, expected if (mixed or cast_back is not None) else None)
    return _cast_out(out, cast_back if cast_back is not None else (expected if mixed else None))


def _run_fallback(
    kind: str,
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Any,
    rest: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: OriginalCall,
) -> Any:
    """The fallback for a registry call: flash -> SDPA; sdpa -> SDPA with every backend allowed."""
    if kind == KIND_FLASH:
        return flash_call_on_sdpa(module, query, key, value, mask, rest, kwargs)
    args = (module, query, key, value, *((mask,) + rest[1:] if rest else ()))
    kw = kwargs if rest or "attention_mask" not in kwargs else {**kwargs, "attention_mask": mask}
    kw = {k: _move_tensors(v, query.device) for k, v in kw.items()}
    with _all_sdpa_backends():
        return call.fn(*args, **kw)


def _recover_and_run(
    known: tuple[str, str],
    exc: BaseException,
    name: str,
    kind: str,
    site: str,
    latch_key: Hashable,
    call: OriginalCall,
    module: Any,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Any,
    rest: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    code, first = known
    try:
        recover = decide(
            "recover",
            "kernel_error_recovered",
            site,
            code,
            f"{name} raised: {first}; re-ran the call on sdpa",
            error=first,
            requested=name,
            selected="sdpa",
        )
    except AttnGuardError as strict:
        raise strict from exc
    if not recover:
        raise exc
    latch(latch_key, code)
    dev = query.device
    key, value, mask = key.to(dev), value.to(dev), _move_tensors(mask, dev)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        key, value = key.to(query.dtype), value.to(query.dtype)
    return _run_fallback(kind, module, query, key, value, mask, rest, kwargs, call)


def _registry_recover(
    call: OriginalCall, *args: Any, name: str, kind: str, error: BaseException, **kwargs: Any
) -> Any:
    """The fast path's kernel raised a known error: re-run on the fallback (or re-raise)."""
    module, query, key, value = args[0], args[1], args[2], args[3]
    rest = args[4:]
    mask = rest[0] if rest else kwargs.get("attention_mask")
    known = classify_kernel_error(error)
    paged = kwargs.get("cache") is not None
    if known is None or paged or (kind == KIND_OTHER and known[0] != "device_mismatch"):
        raise error
    if kind == KIND_OTHER:  # device mismatch inside a kernel we cannot replace: align, re-run
        site = _registry_site(name, module)
        if not decide(
            "recover",
            "kernel_error_recovered",
            site,
            known[0],
            f"{name} raised: {known[1]}; re-ran with every tensor on {query.device}",
            error=known[1],
        ):
            raise error
        dev = query.device
        args = tuple(_move_tensors(a, dev) for a in args)
        kwargs = {k: _move_tensors(v, dev) for k, v in kwargs.items()}
        return call.fn(*args, **kwargs)
    return _recover_and_run(
        known,
        error,
        name,
        kind,
        _registry_site(name, module),
        (name, type(module)),
        call,
        module,
        query,
        key,
        value,
        mask,
        rest,
        kwargs,
    )


# --- direct entry points: flash_attn functions, xformers memory_efficient_attention -------------

KIND_XFORMERS = "xformers"

# flash_attn function -> the parameters holding q/k/v-like tensors (the first is the query's)
FLASH_TENSOR_PARAMS: dict[str, tuple[str, ...]] = {
    "flash_attn_func": ("q", "k", "v"),
    "flash_attn_varlen_func": ("q", "k", "v"),
    "flash_attn_qkvpacked_func": ("qkv",),
    "flash_attn_kvpacked_func": ("q", "kv"),
}
XFORMERS_TENSOR_PARAMS = ("query", "key", "value")


class DirectSpec:
    """What the guard needs to know about one direct entry point."""

    __slots__ = ("kind", "original", "params", "site", "tensors", "twin")

    def __init__(
        self,
        site: str,
        kind: str,
        original: Callable[..., Any],
        twin: Callable[..., Any],
        tensors: tuple[str, ...],
    ) -> None:
        self.site = site
        self.kind = kind
        self.original = original
        self.twin = twin
        self.tensors = tensors
        try:
            sig = inspect.signature(original)
        except (TypeError, ValueError):
            sig = inspect.signature(twin)
        # Positional slots, in order: binding by hand stays traceable by torch.compile.
        self.params = tuple(
            n
            for n, p in sig.parameters.items()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        )

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        if len(args) > len(self.params):
            raise TypeError(f"{self.site}: too many positional arguments")
        bound = dict(zip(self.params, args, strict=False))
        for k, v in kwargs.items():
            if k in bound:
                raise TypeError(f"{self.site}: got multiple values for argument {k!r}")
            bound[k] = v
        return bound


# where the head dimension sits in the query of each flash function
_FLASH_HEAD_DIM_AXIS = {
    "flash_attn_func": 3,
    "flash_attn_varlen_func": 2,
    "flash_attn_qkvpacked_func": 4,
    "flash_attn_kvpacked_func": 3,
}


def wrap_direct(spec: DirectSpec) -> Callable[..., Any]:
    """A guarded closure for a flash_attn function or xformers' memory_efficient_attention."""
    original = spec.original
    site = spec.site
    n = len(spec.tensors)
    flash = spec.kind == KIND_FLASH
    head_axis = _FLASH_HEAD_DIM_AXIS.get(site.rsplit(".", 1)[-1], -1)
    rt = runtime
    lat = latched
    slow = functools.partial(_direct_slow, spec=spec)

    def attnguard_direct(*args: Any, **kwargs: Any) -> Any:
        if rt._settings.enabled:
            try:
                q = args[0]
                k = args[1] if n > 1 else q
                v = args[2] if n > 2 else q
                dt = q.dtype
                dev = q.get_device()
                bad = (
                    len(args) < n
                    or k.dtype is not dt
                    or v.dtype is not dt
                    or q.is_cpu
                    or k.get_device() != dev
                    or v.get_device() != dev
                    or (
                        (dt is not _BF16 and dt is not _FP16)
                        or q.shape[head_axis] > FLASH_MAX_HEAD_DIM
                        if flash
                        else _xformers_bias_off(args, kwargs, dt, dev)
                    )
                    or (lat and site in lat)
                )
            except Exception:
                bad = True
            if bad:
                return _fail_open(site, original, slow, args, kwargs)
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            if (
                not rt._settings.enabled
                or events.is_compiling()
                or classify_kernel_error(exc) is None
            ):
                raise
            recover = functools.partial(_direct_recover, spec=spec, error=exc)
            return _fail_open(site, original, recover, args, kwargs, own_error=exc)

    guarded = functools.wraps(original)(attnguard_direct)
    guarded.__attnguard_original__ = original  # type: ignore[attr-defined]
    return guarded


def _xformers_bias_off(
    args: tuple[Any, ...], kwargs: dict[str, Any], dtype: torch.dtype, device: int
) -> bool:
    """True when a tensor attn_bias has another float dtype or device than the query."""
    bias = args[3] if len(args) > 3 else kwargs.get("attn_bias")
    if bias is None or not isinstance(bias, Tensor):
        return False
    return bias.get_device() != device or (bias.dtype is not dtype and bias.dtype.is_floating_point)


_DIRECT_REROUTE_REASONS = {
    "cpu_tensors": "the kernel runs on CUDA only; this call got CPU tensors",
    "head_dim_unsupported": f"flash-attn supports head_dim <= {FLASH_MAX_HEAD_DIM}",
    "fp32_input": "float32 inputs into half-only flash-attn (ATTNGUARD_FP32_POLICY=fallback)",
}


def _direct_slow(call: OriginalCall, *args: Any, spec: DirectSpec, **kwargs: Any) -> Any:
    site = spec.site
    flash = spec.kind == KIND_FLASH
    a = spec.bind(args, kwargs)
    names = spec.tensors
    q = a[names[0]]
    dev = q.device
    bias = a.get("attn_bias") if not flash else None
    bias_t = bias if isinstance(bias, Tensor) else None

    # (b) devices
    strays = {
        n: str(a[n].device) for n in names[1:] if isinstance(a[n], Tensor) and a[n].device != dev
    }
    if bias_t is not None and bias_t.device != dev:
        strays["attn_bias"] = str(bias_t.device)
    if strays and decide(
        "align",
        "tensors_aligned",
        site,
        "device_mismatch",
        f"attention inputs on different devices; moved to the query's device {dev}",
        moved=strays,
        to=str(dev),
    ):
        for n in names[1:]:
            a[n] = _move_tensors(a[n], dev)
        if bias_t is not None:
            bias_t = a["attn_bias"] = bias_t.to(dev)
        alibi = a.get("alibi_slopes")
        if isinstance(alibi, Tensor):
            a["alibi_slopes"] = alibi.to(dev)

    reroute = lat_reason = latched.get(site)
    if reroute is None:
        if q.is_cpu:
            reroute = "cpu_tensors"
        elif flash and q.shape[-1] > FLASH_MAX_HEAD_DIM:
            reroute = "head_dim_unsupported"

    # (a) one dtype
    ts = [a[n] for n in names]
    dts = tuple(t.dtype for t in ts)
    quantized_kv = not flash and dts[1] == dts[2] == torch.int32
    mixed = any(d is not dts[0] for d in dts[1:]) and not quantized_kv
    if mixed:
        target = choose_dtype(dts, dev, half_only=flash and reroute is None)
        if decide(
            "unify",
            "qkv_unified",
            site,
            "mixed_dtypes",
            f"q/k/v dtypes differ; unified to {_name(target)}",
            **{
                "from": {n: _name(t.dtype) for n, t in zip(names, ts, strict=True)},
                "to": _name(target),
            },
        ):
            for n in names:
                a[n] = a[n].to(target)
            if bias_t is not None and bias_t.is_floating_point():
                bias_t = a["attn_bias"] = bias_t.to(target)
    qdt = a[names[0]].dtype
    if (
        bias_t is not None
        and bias_t.is_floating_point()
        and bias_t.dtype != qdt
        and decide(
            "unify",
            "qkv_unified",
            site,
            "bias_dtype",
            f"attn_bias dtype differs from the query's; cast to {_name(qdt)}",
            **{"from": {"attn_bias": _name(bias_t.dtype)}, "to": _name(qdt)},
        )
    ):
        a["attn_bias"] = bias_t.to(qdt)

    # (c) float32 into half-only flash-attn
    precast = {n: a[n] for n in names}
    cast_back = None
    if flash and reroute is None and qdt not in HALF_DTYPES:
        if runtime.settings().fp32_policy == "fallback":
            reroute = "fp32_input"
        else:
            half = half_dtype_for(dev)
            if decide(
                "cast",
                "qkv_unified",
                site,
                "fp32_into_flash",
                f"{_name(qdt)} inputs into half-only flash-attn; run in {_name(half)}, "
                f"output cast back to {_name(qdt)}",
                **{"from": {names[0]: _name(qdt)}, "to": _name(half)},
            ):
                cast_back = qdt
                for n in names:
                    a[n] = a[n].to(half)

    # (d) the kernel cannot run this call: the SDPA twin.
    rerouted = reroute is not None and (
        lat_reason is not None
        or decide(
            "reroute",
            "backend_rerouted",
            site,
            reroute,
            _DIRECT_REROUTE_REASONS.get(reroute, f"{site} cannot run this call ({reroute})"),
            requested=site,
            selected="sdpa",
        )
    )
    if rerouted:
        latch(site, reroute)
        return spec.twin(**a)

    try:
        out = call(**a)
    except Exception as exc:
        known = classify_kernel_error(exc)
        if known is None:
            raise
        a.update(precast)
        return _direct_fallback_after(known, exc, spec, a)
    return _cast_out(out, cast_back)


def _direct_fallback_after(
    known: tuple[str, str], exc: BaseException, spec: DirectSpec, a: dict[str, Any]
) -> Any:
    code, first = known
    try:
        recover = decide(
            "recover",
            "kernel_error_recovered",
            spec.site,
            code,
            f"{spec.site} raised: {first}; re-ran the call on sdpa",
            error=first,
            requested=spec.site,
            selected="sdpa",
        )
    except AttnGuardError as strict:
        raise strict from exc
    if not recover:
        raise exc
    latch(spec.site, code)
    q = a[spec.tensors[0]]
    for n in spec.tensors[1:]:
        a[n] = _move_tensors(a[n], q.device)
    return spec.twin(**a)


def _direct_recover(
    call: OriginalCall, *args: Any, spec: DirectSpec, error: BaseException, **kwargs: Any
) -> Any:
    known = classify_kernel_error(error)
    if known is None:
        raise error
    return _direct_fallback_after(known, error, spec, spec.bind(args, kwargs))
