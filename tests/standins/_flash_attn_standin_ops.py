"""STAND-IN for flash-attn 2.8.3's CUDA extension (attnguard tests only): the torch custom ops.

Kept out of the ``flash_attn`` package so tests can drop ``flash_attn`` from ``sys.modules`` and
import it again: torch.library ops can be defined once per process.

Enforces the real contract with the real messages (``csrc/flash_attn/flash_api.cpp``):
CUDA tensors only (the forward is a torch custom op registered for CUDA only, so CPU inputs get
the dispatcher's "Could not run 'flash_attn::_flash_attn_forward' with arguments from the 'CPU'
backend"), sm80-sm90 GPUs, fp16/bf16, one dtype for q/k/v, head_dim <= 256. Computes with torch
SDPA (explicit fp32 math where SDPA cannot: softcap, ALiBi, the log-sum-exp). Independent of
attnguard on purpose: it stands in for the kernel attnguard guards.
"""

import math

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)


def _not_implemented(what: str) -> NotImplementedError:
    return NotImplementedError(f"flash-attn stand-in: {what} is not implemented")


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """mha_fwd's checks, in its order (flash-attn 2.8.3)."""
    major, minor = torch.cuda.get_device_capability(q.device)
    is_sm8x = major == 8 and minor >= 0
    is_sm90 = major == 9 and minor == 0
    if not (is_sm90 or is_sm8x):
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")
    if q.dtype not in _HALF:
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if v.dtype != q.dtype:
        raise RuntimeError("query and value must have the same dtype")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_cuda:
            raise RuntimeError(f"{name} must be on CUDA")
    if q.shape[-1] > 256 or v.shape[-1] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256")
    if q.shape[-2] % k.shape[-2] != 0:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    dropout_p: float,
    scale: float,
    causal: bool,
    window: tuple[int, int],
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    need_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence batch (B, S, H, D) -> (out (B, Sq, H, Dv), lse (B, H, Sq) float32)."""
    b, sq, h, _ = q.shape
    sk, hk = k.shape[1], k.shape[2]
    left, right = window
    if left >= sk:
        left = -1
    if right >= sk:
        right = -1
    if sq == 1 and alibi_slopes is None:
        causal = False
    if causal:
        right = 0
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if hk != h:
        kt = kt.repeat_interleave(h // hk, dim=1)
        vt = vt.repeat_interleave(h // hk, dim=1)
    keep = None
    if left >= 0 or right >= 0:
        i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)  # bottom-right aligned
        j = torch.arange(sk, device=q.device)[None, :]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
        if left >= 0:
            keep &= j >= i - left
        if right >= 0:
            keep &= j <= i + right
    lse = torch.full((b, h, sq), float("nan"), dtype=torch.float32, device=q.device)
    if softcap > 0 or alibi_slopes is not None or need_lse:
        s = torch.matmul(qt.float(), kt.float().transpose(-1, -2)) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        if alibi_slopes is not None:
            i = torch.arange(sq, device=q.device, dtype=torch.float32)[:, None] + (sk - sq)
            j = torch.arange(sk, device=q.device, dtype=torch.float32)[None, :]
            slopes = alibi_slopes.float().reshape(-1 if alibi_slopes.dim() == 2 else 1, h, 1, 1)
            s = s - slopes * (i - j).abs()
        if keep is not None:
            s = s.masked_fill(~keep, -math.inf)
        lse = torch.logsumexp(s, dim=-1)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
        if dropout_p > 0:
            p = F.dropout(p, dropout_p)
        out = torch.matmul(p, vt.float()).to(q.dtype)
    else:
        mask = keep
        empty = None
        if keep is not None:
            empty = ~keep.any(-1, keepdim=True)
            mask = keep | empty
        out = F.scaled_dot_product_attention(
            qt, kt, vt, attn_mask=mask, dropout_p=dropout_p, scale=scale
        )
        if empty is not None:
            out = out.masked_fill(empty, 0.0)
    return out.transpose(1, 2).contiguous(), lse


@torch.library.custom_op("flash_attn::_flash_attn_forward", mutates_args=(), device_types="cuda")
def _flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v)
    out, lse = _attend(
        q,
        k,
        v,
        dropout_p=dropout_p,
        scale=softmax_scale,
        causal=causal,
        window=(window_size_left, window_size_right),
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        need_lse=return_softmax,
    )
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    rng_state = torch.zeros((2,), dtype=torch.int64, device=q.device)
    return out, lse, s_dmask, rng_state


@_flash_attn_forward.register_fake
def _(q, k, v, dropout_p, softmax_scale, causal, wl, wr, softcap, alibi_slopes, return_softmax):
    b, sq, h, _ = q.shape
    out = q.new_empty(b, sq, h, v.shape[-1])
    lse = q.new_empty(b, h, sq, dtype=torch.float32)
    return out, lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)


def _fwd_setup(ctx, inputs, output):
    q, k, v, dropout_p, scale, causal, wl, wr, softcap, alibi, _ = inputs
    ctx.save_for_backward(q, k, v)
    ctx.params = (dropout_p, scale, causal, (wl, wr), softcap, alibi)


def _fwd_backward(ctx, dout, _dlse, _ds, _drng):
    dropout_p, scale, causal, window, softcap, alibi = ctx.params
    if dropout_p > 0:
        raise _not_implemented("backward with dropout")
    q, k, v = ctx.saved_tensors
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        out, _ = _attend(
            qg,
            kg,
            vg,
            dropout_p=0.0,
            scale=scale,
            causal=causal,
            window=window,
            softcap=softcap,
            alibi_slopes=alibi,
            need_lse=False,
        )
        dq, dk, dv = torch.autograd.grad(out, (qg, kg, vg), dout)
    return dq, dk, dv, None, None, None, None, None, None, None, None


_flash_attn_forward.register_autograd(_fwd_backward, setup_context=_fwd_setup)


@torch.library.custom_op(
    "flash_attn::_flash_attn_varlen_forward", mutates_args=(), device_types="cuda"
)
def _flash_attn_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int = -1,
    window_size_right: int = -1,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    return_softmax: bool = False,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_inputs(q, k, v)
    if cu_seqlens_q.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_q must have dtype int32")
    if cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("cu_seqlens_k must have dtype int32")
    if block_table is not None:
        raise _not_implemented("paged KV (block_table)")
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    lse = torch.full((q.shape[1], q.shape[0]), math.inf, dtype=torch.float32, device=q.device)
    for b in range(len(cq) - 1):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        if cq[b + 1] == cq[b]:
            continue
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[b] if alibi_slopes.dim() == 2 else alibi_slopes
        o, l_ = _attend(
            q[qs].unsqueeze(0),
            k[ks].unsqueeze(0),
            v[ks].unsqueeze(0),
            dropout_p=dropout_p,
            scale=softmax_scale,
            causal=causal,
            window=(window_size_left, window_size_right),
            softcap=softcap,
            alibi_slopes=slopes,
            need_lse=return_softmax,
        )
        out[qs] = o[0]
        lse[:, qs] = l_[0]
    s_dmask = torch.empty((0,), dtype=q.dtype, device=q.device)
    return out, lse, s_dmask, torch.zeros((2,), dtype=torch.int64, device=q.device)


@_flash_attn_varlen_forward.register_fake
def _(
    q,
    k,
    v,
    cu_q,
    cu_k,
    mq,
    mk,
    dropout_p,
    scale,
    causal,
    wl=-1,
    wr=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
    block_table=None,
):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
    lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    return out, lse, q.new_empty(0), q.new_empty(2, dtype=torch.int64)
