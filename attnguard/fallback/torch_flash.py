"""torch's own flash-attention kernel: FlashAttention-2 as built into CUDA builds of torch
(``torch.ops.aten._flash_attention_forward``, the kernel behind SDPA's flash backend and
``torch.nn.attention.varlen``).

It is flash-attn's own algorithm, so it computes flash-attn's semantics natively: packed rows
through ``cu_seqlens`` (no host read of the lengths), GQA/MQA without repeated key/value heads,
bottom-right causal alignment, sliding windows, dropout, the softmax LSE, and per-sequence key
counts (``seqused_k``, a KV cache read only up to each sequence's length), with gradients
(aten's ``FlashAttentionBackward``). It cannot do softcap, and torch's build refuses ALiBi
("This flash attention build does not support alibi", torch 2.11 on an H100, 2026-11-24): those
calls go to another kernel (:mod:`attnguard.fallback.routes` decides). It needs a CUDA GPU of
compute capability 8.0 or newer, fp16/bf16 and head_dim <= 256 (other head dims up to 256 are
zero-padded to a multiple of 8 here, as SDPA's flash path pads them).

Measured against the real flash-attn 2.8.3 kernel on an H100 (torch 2.11, bf16, 2026-11-24):
outputs within bf16 rounding (max |diff| 0.0078 on a pack of 64 sequences, 18.3k tokens,
32/8 heads, head_dim 128; 0 on small shapes), same gradients within bf16 rounding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .sdpa import compiling

Tensor = torch.Tensor

MAX_HEAD_DIM = 256
MIN_CAPABILITY = (8, 0)
_HALF = (torch.float16, torch.bfloat16)


def _op() -> Any:
    try:
        return torch.ops.aten._flash_attention_forward
    except (AttributeError, RuntimeError):
        return None


_OP = _op()


def _op_parameters(op: Any) -> frozenset[str]:
    """The parameters this torch's ``op`` takes (the kernel's: window sizes, ``seqused_k``, ...:
    what it can express here)."""
    try:
        return frozenset(a.name for a in op.default._schema.arguments)
    except Exception:
        return frozenset()


# Facts read outside any trace: torch.compile traces through a cached function (and cannot wrap
# the op's FunctionSchema: a graph break), but reads a module-level constant or dict entry as a
# constant. The parameters are read at import (no GPU touched); each GPU is judged at its first
# eager call.
OP_PARAMETERS = _op_parameters(_OP)
_GPU_OK: dict[int, bool] = {}


def _gpu_ok(index: int) -> bool:
    ok = _GPU_OK.get(index)
    if ok is None:
        if compiling():
            return False  # not judged outside a trace yet: another kernel computes the call
        try:
            ok = bool(
                torch.backends.cuda.is_flash_attention_available()
                and torch.cuda.get_device_capability(index) >= MIN_CAPABILITY
            )
        except Exception:
            ok = False
        _GPU_OK[index] = ok
    return ok


def can_run(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    window: bool = False,
    seqused: bool = False,
    deterministic: bool = False,
) -> bool:
    """Whether torch's flash kernel can take q/k/v (devices, dtypes, head dims, this torch's
    parameters; ``deterministic``: with its deterministic backward). Decided from tensor
    metadata only: no tensor value is read."""
    if _OP is None or not q.is_cuda:
        return False
    if deterministic and not DETERMINISTIC_BACKWARD:
        return False
    dt = q.dtype
    if dt not in _HALF or k.dtype is not dt or v.dtype is not dt:
        return False
    d = q.shape[-1]
    if d > MAX_HEAD_DIM or k.shape[-1] != d or v.shape[-1] != d:
        return False
    if k.device != q.device or v.device != q.device:
        return False
    if window and "window_size_left" not in OP_PARAMETERS:
        return False
    if seqused and "seqused_k" not in OP_PARAMETERS:
        return False
    index = q.device.index
    return _gpu_ok(torch.cuda.current_device() if index is None else index)


def windowed(window: tuple[int, int]) -> bool:
    """A normalised flash-attn window that is neither full (-1, -1) nor causal (-1, 0): the
    kernel needs its window parameters for it."""
    left, right = window
    return left >= 0 or right > 0


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_k: Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    dropout_p: float,
    scale: float,
    window: tuple[int, int],
    seqused_k: Tensor | None = None,
    deterministic: bool = False,
) -> tuple[Tensor, Tensor]:
    """One kernel call. Dense: q (B, Sq, H, D), k/v (B, Sk, Hk, D), no cu_seqlens. Varlen:
    q (total_q, H, D), k/v (total_k, Hk, D) with int32 cu_seqlens on q's device.

    ``window`` is flash-attn's normalised (left, right); (-1, 0) is causal. ``deterministic``:
    the backward pass runs in the kernel's deterministic mode ("the deterministic backward"
    below). Returns (out in q's layout, float32 LSE: (B, H, Sq) dense, (H, total_q) varlen).
    """
    d = q.shape[-1]
    pad = (-d) % 8
    if pad:  # the kernel takes head dims in multiples of 8; zeros change no score
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    left, right = window
    causal = left < 0 and right == 0
    if (
        deterministic
        and seqused_k is None
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        win = windowed(window)
        out, lse = _DETERMINISTIC(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            float(dropout_p),
            causal,
            scale,
            left if win else None,
            right if win else None,
        )[:2]
    else:
        kwargs: dict[str, Any] = {"scale": scale}
        if windowed(window):
            kwargs["window_size_left"] = left
            kwargs["window_size_right"] = right
        if seqused_k is not None:
            kwargs["seqused_k"] = seqused_k
        out, lse = _OP(
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            max_seqlen_q,
            max_seqlen_k,
            float(dropout_p),
            causal,
            False,
            **kwargs,
        )[:2]
    if pad:
        out = out[..., :d]
    if cu_seqlens_q is not None and lse.dim() == 3:
        lse = packed_lse(lse, cu_seqlens_q, q.shape[0])
    return out, lse


def packed_lse(lse: Tensor, cu_seqlens_q: Tensor, total_q: int) -> Tensor:
    """A varlen LSE in flash-attn's packed layout (H, total_q), from the padded (B, H, max_q)
    that the kernel of torch 2.4 to 2.6 returns (torch's own shape rule for the op says which:
    recognised here by the tensor's shape, which is static under torch.compile too). Gathered
    with index tensors: no length is read on the host. Tokens after the last sequence (no
    sequence's) get the last row's value, which nothing reads."""
    t = torch.arange(total_q, device=lse.device)
    seq = torch.bucketize(t, cu_seqlens_q[1:].to(t.dtype), right=True).clamp(max=lse.shape[0] - 1)
    row = (t - cu_seqlens_q[seq].to(t.dtype)).clamp(0, lse.shape[2] - 1)
    return lse[seq, :, row].transpose(0, 1).contiguous()


# --- the deterministic backward ------------------------------------------------------------------
#
# torch's flash backward has flash-attn's deterministic mode (dq accumulated in one buffer per
# split, summed in a fixed order, instead of atomic adds into one), but it takes no argument for
# it: it reads torch's global flag (``torch.use_deterministic_algorithms(True)``, not warn-only),
# at::globalContext() in aten's _flash_attention_backward (torch 2.4 to 2.13). A call that asks
# for determinism (flash-attn's ``deterministic=True``) runs the backward kernel with that flag
# set for the one call and restored right after; uninitialised-memory filling, which the flag
# also switches on, stays off unless the caller had it on. The flag is process-global: another
# thread launching a kernel in that window sees it too (a deterministic choice or, for an op
# without a deterministic implementation, torch's error). Forward and backward are registered
# as custom ops (as torch's own ``torch.nn.attention.varlen`` does), so torch.compile keeps them
# whole: a global flag flipped inside a traced backward would not survive tracing.

_BACKWARD = getattr(torch.ops.aten, "_flash_attention_backward", None)


def _call_with_deterministic_flag(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with torch's deterministic-algorithms flag on (not warn-only),
    restored afterwards."""
    was_on = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    if was_on and not warn_only:
        return fn(*args, **kwargs)
    fill = torch._C._get_deterministic_fill_uninitialized_memory()
    torch._C._set_deterministic_algorithms(True, warn_only=False)
    if not was_on:  # the fill is a cost of the flag the caller did not ask for
        torch._C._set_deterministic_fill_uninitialized_memory(False)
    try:
        return fn(*args, **kwargs)
    finally:
        torch._C._set_deterministic_algorithms(was_on, warn_only=warn_only)
        torch._C._set_deterministic_fill_uninitialized_memory(fill)


def _window_kwargs(scale: float, left: int | None, right: int | None) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"scale": scale}
    if left is not None:
        kwargs["window_size_left"] = left
        kwargs["window_size_right"] = right
    return kwargs


def _forward_impl(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor | None,
    cu_k: Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    causal: bool,
    scale: float,
    left: int | None,
    right: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    res = _OP(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        causal,
        False,
        **_window_kwargs(scale, left, right),
    )
    return res[0], res[1], res[2], res[3]


def _backward_impl(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_q: Tensor | None,
    cu_k: Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    causal: bool,
    rng_state: Tensor,
    unused: Tensor,
    scale: float,
    left: int | None,
    right: int | None,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _call_with_deterministic_flag(
        _BACKWARD,
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        causal,
        rng_state,
        unused,
        **_window_kwargs(scale, left, right),
    )
    return dq, dk, dv


# Whether this torch's kernel gives its random state as ``rng_state`` (a (2,) uint64 seed, a ()
# uint64 offset) rather than torch 2.4's int64 scalar ``philox_seed`` / ``philox_offset``: read from
# its backward's parameters, for the shapes computed where torch has no shape rule of its own.
_RNG_STATE = "rng_state" in _op_parameters(_BACKWARD)


def _forward_fake(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Tensor | None,
    cu_k: Tensor | None,
    max_q: int,
    max_k: int,
    dropout_p: float,
    causal: bool,
    scale: float,
    left: int | None,
    right: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The shapes of :func:`_forward_impl`'s results, no kernel run (torch.compile's tracing,
    meta tensors). torch's own shape rule for aten's kernel where this torch has one for these
    tensors (aten's Meta kernel from torch 2.5; on 2.4 only FakeTensorMode's rule), which knows
    this release's layouts; else (meta tensors on torch 2.4, which has no Meta kernel for it)
    computed here, as torch 2.4's kernel returns them: out like q; LSE (B, H, Sq) dense, padded
    (B, H, max_q) packed; int64 scalar seed and offset."""
    try:
        return _forward_impl(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, left, right
        )
    except NotImplementedError:
        pass
    heads = q.shape[-2]
    if cu_q is None:
        lse = q.new_empty((q.shape[0], heads, q.shape[1]), dtype=torch.float32)
    else:
        lse = q.new_empty((cu_q.shape[0] - 1, heads, max_q), dtype=torch.float32)
    if _RNG_STATE:
        seed, offset = q.new_empty((2,), dtype=torch.uint64), q.new_empty((), dtype=torch.uint64)
    else:
        seed, offset = q.new_empty((), dtype=torch.int64), q.new_empty((), dtype=torch.int64)
    return q.new_empty(q.shape), lse, seed, offset


def _backward_fake(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, *_: Any
) -> tuple[Tensor, ...]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, scale, left, right = inputs
    out, lse, rng_state, unused = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng_state, unused)
    # no gradient flows through the LSE, as in flash-attn's functions and aten's kernel
    ctx.args = (max_q, max_k, dropout_p, causal, scale, left, right)
    ctx.mark_non_differentiable(lse)


def _backward(ctx: Any, grad_out: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, cu_q, cu_k, rng_state, unused = ctx.saved_tensors
    max_q, max_k, dropout_p, causal, scale, left, right = ctx.args
    dq, dk, dv = _DETERMINISTIC_BACKWARD(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        cu_q,
        cu_k,
        max_q,
        max_k,
        dropout_p,
        causal,
        rng_state,
        unused,
        scale,
        left,
        right,
    )
    return (dq, dk, dv) + (None,) * 9


_FORWARD_SCHEMA = (
    "flash_attention_deterministic(Tensor q, Tensor k, Tensor v, Tensor? cu_seqlens_q, "
    "Tensor? cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, "
    "bool causal, float scale, SymInt? window_size_left, SymInt? window_size_right) "
    "-> (Tensor, Tensor, Tensor, Tensor)"
)
_BACKWARD_SCHEMA = (
    "flash_attention_deterministic_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, "
    "Tensor out, Tensor logsumexp, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, bool causal, Tensor rng_state, "
    "Tensor unused, float scale, SymInt? window_size_left, SymInt? window_size_right) "
    "-> (Tensor, Tensor, Tensor)"
)


def _register() -> tuple[Any, Any, Any]:
    """The two custom ops (``torch.ops.attnguard.flash_attention_deterministic[_backward]``),
    registered once per process; (None, None, None) where this torch cannot (no flash kernel,
    no ``torch.library.register_autograd``): deterministic calls then take another kernel."""
    ops = torch.ops.attnguard
    if hasattr(ops, "flash_attention_deterministic"):  # registered by an earlier import
        return None, ops.flash_attention_deterministic, ops.flash_attention_deterministic_backward
    if _OP is None or _BACKWARD is None or not hasattr(torch.library, "register_autograd"):
        return None, None, None
    try:
        lib = torch.library.Library("attnguard", "FRAGMENT")
        # dropout draws from torch's generator, as aten's op does: never merged or reordered
        lib.define(_FORWARD_SCHEMA, tags=(torch.Tag.nondeterministic_seeded,))
        lib.define(_BACKWARD_SCHEMA)
        lib.impl("flash_attention_deterministic", _forward_impl, "CUDA")
        lib.impl("flash_attention_deterministic_backward", _backward_impl, "CUDA")
        torch.library.register_fake(
            "attnguard::flash_attention_deterministic", _forward_fake, lib=lib
        )
        torch.library.register_fake(
            "attnguard::flash_attention_deterministic_backward", _backward_fake, lib=lib
        )
        torch.library.register_autograd(
            "attnguard::flash_attention_deterministic",
            _backward,
            setup_context=_setup_context,
            lib=lib,
        )
    except Exception:
        return None, None, None
    return lib, ops.flash_attention_deterministic, ops.flash_attention_deterministic_backward


# the Library object holds the registrations: they last as long as this module
_LIBRARY, _DETERMINISTIC, _DETERMINISTIC_BACKWARD = _register()
DETERMINISTIC_BACKWARD = _DETERMINISTIC is not None


_CU_CACHE: dict[tuple[Any, int, int], Tensor] = {}


def strided_cu(n: int, step: int, device: torch.device) -> Tensor:
    """int32 ``[0, step, 2 * step, ..., n * step]`` on ``device``, made once per (device, n,
    step): the cu_seqlens of n equal-length sequences (decode steps reuse them)."""
    key = (device, n, step)
    found = _CU_CACHE.get(key)
    if found is None:
        if len(_CU_CACHE) > 256:
            _CU_CACHE.clear()
        found = _CU_CACHE[key] = torch.arange(0, n + 1, dtype=torch.int32, device=device) * step
    return found
