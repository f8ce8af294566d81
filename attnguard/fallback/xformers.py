"""Twin of ``xformers.ops.memory_efficient_attention``: layouts ``[B, M, K]``, ``[B, M, H, K]``
and ``[B, M, G, H, K]``; ``attn_bias`` None, an additive tensor, or any
``xformers.ops.fmha.attn_bias`` object (recognised by duck typing; xformers is never imported
here). xformers' ``LowerTriangularMask`` is aligned top-left (query ``i`` sees keys ``j <= i``),
unlike flash-attn's causal mask.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from . import routes, torch_flash
from .sdpa import causal_sdpa, sdpa
from .varlen import run_segments

Tensor = torch.Tensor

_BLOCK_DIAGONAL_KINDS = {
    "BlockDiagonalMask": "none",
    "BlockDiagonalCausalMask": "top_left",
    "BlockDiagonalCausalFromBottomRightMask": "bottom_right",
}


def _seqstart(info: Any, starts: list[int], device: torch.device) -> Tensor:
    """A block-diagonal bias's cu_seqlens as int32 on ``device`` (its own tensor when it has one
    there, else copied from the host list it carries)."""
    held = getattr(info, "seqstart", None)
    if isinstance(held, Tensor) and held.device == device and held.dtype == torch.int32:
        return held
    return torch.tensor(starts, dtype=torch.int32, device=device)


def _xf_block_diagonal(
    q: Tensor, k: Tensor, v: Tensor, bias: Any, kind: str, p: float, scale: float
) -> Tensor:
    """Block-diagonal xformers biases: packed rows, one call of torch's flash kernel where it
    can run (route ``xformers-blocks-flash``), else one SDPA call per group of equal-length
    blocks.

    q/k/v are (1, M, H, D); returns (1, Mq, H, Dv).
    """
    if q.shape[0] != 1:
        raise ValueError("block-diagonal attn_bias expects batch size 1")
    q_starts = [int(x) for x in bias.q_seqinfo.seqstart_py]
    k_starts = [int(x) for x in bias.k_seqinfo.seqstart_py]
    k_lens = [k_starts[i + 1] - k_starts[i] for i in range(len(k_starts) - 1)]
    q_lens = [q_starts[i + 1] - q_starts[i] for i in range(len(q_starts) - 1)]
    route = routes.xformers(
        flash_ok=torch_flash.can_run(q, k, v),
        block_kind=kind,
        equal_lengths=q_lens == k_lens,
    )
    if route == "xformers-blocks-flash":
        cu_q, cu_k = (
            _seqstart(info, starts, q.device)
            for info, starts in ((bias.q_seqinfo, q_starts), (bias.k_seqinfo, k_starts))
        )
        out, _ = torch_flash.attention(
            q[0],
            k[0],
            v[0],
            cu_q,
            cu_k,
            max(q_lens, default=0),
            max(k_lens, default=0),
            dropout_p=p,
            scale=scale,
            window=(-1, -1) if kind == "none" else (-1, 0),
        )
        return out.unsqueeze(0)
    k0, v0 = k[0], v[0]

    def get_kv(i: int) -> tuple[Tensor, Tensor]:
        return k0[k_starts[i] : k_starts[i + 1]], v0[k_starts[i] : k_starts[i + 1]]

    def attend(qb: Tensor, kb: Tensor, vb: Tensor, idx: list[int]) -> tuple[Tensor, None]:
        qt, kt, vt = qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2)
        if qt.shape[2] == 0:
            return qb.new_zeros(qb.shape[0], 0, qb.shape[2], vb.shape[-1]), None
        if kt.shape[2] == 0:
            return qb.new_zeros(*qb.shape[:3], vb.shape[-1]), None
        if kind == "none":
            out = sdpa(qt, kt, vt, None, p, False, scale)
        else:
            offset = 0 if kind == "top_left" else kt.shape[2] - qt.shape[2]
            out = causal_sdpa(qt, kt, vt, offset, p, scale)
        return out.transpose(1, 2), None

    out, _ = run_segments(q[0], q_starts, k_lens, get_kv, attend, False)
    return out.unsqueeze(0)


def _xf_tensor_bias(bias: Tensor, ndim: int, b: int, g: int, h: int, mq: int, mk: int) -> Tensor:
    """Bring an additive tensor bias given in the caller's layout to (B|1, G*H|1, Mq, Mk)."""
    if ndim == 3:
        # [B, Mq, Mk] (or broadcastable) for [B, M, K] inputs.
        return bias.unsqueeze(-3) if bias.dim() >= 3 else bias
    if ndim == 4:
        # (B*H, Mq, Mk) is accepted too; plain broadcasting would read B*H as heads.
        if bias.dim() == 3 and bias.shape[0] == b * h and b > 1:
            return bias.reshape(b, h, bias.shape[-2], bias.shape[-1])
        return bias
    if bias.dim() == 4:
        # A BMHK bias [B, G*H, Mq, Mk] for BMGHK inputs (diffusers' GQA calls): head g*H + h
        # reads bias head g*H + h, as xformers' ROCm kernel computes it once it flattens the
        # groups. Its CUDA kernel takes this bias only where H == 1 (the same heads) and refuses
        # it otherwise ("Bias expected in BMHK format").
        return bias.expand(b, g * h, mq, mk)
    # 5D: [B, G, H, Mq, Mk] (or broadcastable).
    while bias.dim() < 5:
        bias = bias.unsqueeze(0)
    return bias.expand(b, g, h, mq, mk).flatten(1, 2)


def _xf_materialize(bias: Any, ndim: int, b: int, g: int, h: int, mq: int, mk: int, q: Tensor):
    """Materialise an xformers AttentionBias to an additive (B|1, G*H|1, Mq, Mk) tensor."""
    if ndim == 3:
        shape: tuple[int, ...] = (b, mq, mk)
    elif ndim == 4:
        shape = (b, h, mq, mk)
    else:
        shape = (b, g, h, mq, mk)
    mask = bias.materialize(shape, dtype=q.dtype, device=q.device)
    if mask.shape[-1] < mk:  # e.g. paged biases cover only the used pages
        pad = mask.new_full((*mask.shape[:-1], mk - mask.shape[-1]), -math.inf)
        mask = torch.cat([mask, pad], dim=-1)
    if ndim == 3:
        mask = mask.unsqueeze(-3)
    elif ndim == 5:
        mask = mask.flatten(1, 2)
    return mask


def xformers_memory_efficient_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_bias: Any = None,
    p: float = 0.0,
    scale: float | None = None,
    *,
    op: Any = None,
    output_dtype: torch.dtype | None = None,
) -> Tensor:
    """SDPA stand-in for ``xformers.ops.memory_efficient_attention``."""
    ndim = query.dim()
    if ndim not in (3, 4, 5) or key.dim() != ndim or value.dim() != ndim:
        raise ValueError(
            "query/key/value must all be [B, M, K], [B, M, H, K] or [B, M, G, H, K]; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if not (query.is_floating_point() and key.is_floating_point() and value.is_floating_point()):
        # xformers' quantized key/value (int32: packed int4 with scales) or a caller's integer
        # or complex tensors: casting them would make numbers out of them
        raise NotImplementedError(
            "attnguard's twin of memory_efficient_attention computes floating query/key/value "
            f"only; got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if key.dtype != query.dtype:
        key = key.to(query.dtype)
    if value.dtype != query.dtype:
        value = value.to(query.dtype)
    b, mq = query.shape[:2]
    mk = key.shape[1]
    g, h = 1, 1
    if ndim == 3:
        q4, k4, v4 = query.unsqueeze(2), key.unsqueeze(2), value.unsqueeze(2)
    elif ndim == 4:
        h = query.shape[2]
        q4, k4, v4 = query, key, value
        if h > 1 and key.stride(2) == 0 and value.stride(2) == 0:  # MQA via expand()
            k4, v4 = key[:, :, :1], value[:, :, :1]
    else:
        g, h = query.shape[2], query.shape[3]
        q4 = query.flatten(2, 3)
        if h > 1 and key.stride(3) == 0 and value.stride(3) == 0:  # GQA via expand()
            k4, v4 = key[:, :, :, 0], value[:, :, :, 0]
        else:
            k4, v4 = key.flatten(2, 3), value.flatten(2, 3)
    sc = query.shape[-1] ** -0.5 if scale is None else float(scale)
    qt, kt, vt = q4.transpose(1, 2), k4.transpose(1, 2), v4.transpose(1, 2)

    name = type(attn_bias).__name__
    if attn_bias is None:
        out = sdpa(qt, kt, vt, None, p, False, sc).transpose(1, 2)
    elif isinstance(attn_bias, torch.Tensor) and not hasattr(type(attn_bias), "materialize"):
        # a tensor bias; xformers' LowerTriangularMask (and ...WithTensorBias) are tensors too in
        # 0.0.27 (torch.Tensor subclasses), read below as the bias classes they are (the class's
        # attribute: torch 2.4's torch.compile cannot ask a tensor for one)
        mask = _xf_tensor_bias(attn_bias, ndim, b, g, h, mq, mk)
        if mask.dtype != torch.bool:
            mask = mask.to(query.dtype)
        out = sdpa(qt, kt, vt, mask, p, False, sc).transpose(1, 2)
    elif not hasattr(type(attn_bias), "materialize"):
        raise TypeError(f"unsupported attn_bias type: {type(attn_bias)!r}")
    elif name == "LowerTriangularMask":
        out = causal_sdpa(qt, kt, vt, 0, p, sc).transpose(1, 2)
    elif name == "LowerTriangularFromBottomRightMask":
        out = causal_sdpa(qt, kt, vt, mk - mq, p, sc).transpose(1, 2)
    elif name in _BLOCK_DIAGONAL_KINDS and hasattr(attn_bias, "q_seqinfo"):
        kind = _BLOCK_DIAGONAL_KINDS[name]
        out = _xf_block_diagonal(q4, k4, v4, attn_bias, kind, p, sc)
    else:
        mask = _xf_materialize(attn_bias, ndim, b, g, h, mq, mk, query)
        # Rows the bias masks entirely give zeros: unmask them for a finite softmax, then zero
        # their output. Done unconditionally with tensor ops (the rows depend on the bias's
        # values, and a host-side check would break torch.compile graphs).
        empty = torch.isneginf(mask).all(dim=-1, keepdim=True)
        mask = mask.masked_fill(empty, 0.0)
        out = sdpa(qt, kt, vt, mask, p, False, sc).masked_fill(empty, 0.0)
        out = out.transpose(1, 2)

    if ndim == 3:
        out = out.squeeze(2)
    elif ndim == 5:
        out = out.unflatten(2, (g, h))
    out = out.contiguous()
    if output_dtype is not None:
        out = out.to(output_dtype)
    return out
