"""Attention sinks (``s_aux``): one learned logit per query head that joins every row's softmax,
takes probability mass and contributes no value (GPT-OSS and its kin pass them to the flash path
as ``s_aux``; flash-attn 3 builds that serve them call them so, flash-attn 4 ``learnable_sink``).

With ``out`` and ``lse`` the plain attention's output and log-sum-exp of one (row, head), the
sink's softmax over keys and sink gives

    out_sink = out * exp(lse) / (exp(lse) + exp(sink)) = out * sigmoid(lse - sink)
    lse_sink = logaddexp(lse, sink)

so every twin computes sinks from the kernel it already runs, provided the ``lse`` carries its
gradient when one is needed (:func:`needs_grad`: then the twins take a kernel whose ``lse`` is
differentiable). A row that sees no key gives zeros, as without a sink, and the sink's own lse
(the sink alone is in its softmax), as the kernels with sinks give it (vLLM's flash-attn 3,
hopper/softmax.h ``finalize_aux``; flash-attn 4, flash_attn/cute/softmax.py ``finalize``).
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def needs_grad(sinks: Tensor | None, *tensors: Tensor | None) -> bool:
    """True when a backward pass will need the gradient through the lse (sinks given, autograd
    on, and a tensor that requires grad). Decided from flags only (traces under compile)."""
    if sinks is None or not torch.is_grad_enabled():
        return False
    return sinks.requires_grad or any(t is not None and t.requires_grad for t in tensors)


def check(sinks: Tensor | None, heads: int) -> None:
    """Sinks of any shape holding one logit per query head, as eager attention takes them
    (``sinks.reshape(1, -1, 1, 1)``): (H,), (H, 1), (1, H), ..."""
    if sinks is not None and sinks.numel() != heads:
        raise ValueError(
            f"s_aux must hold one sink logit per query head: {heads} values, as shape "
            f"({heads},) or any shape that reshapes to it, got {tuple(sinks.shape)}"
        )


def apply(out: Tensor, lse: Tensor, sinks: Tensor, *, packed: bool) -> tuple[Tensor, Tensor]:
    """(out_sink, lse_sink) from a twin's (out, lse): dense ``out`` (B, S, H, Dv) with ``lse``
    (B, H, S); ``packed`` ``out`` (T, H, Dv) with ``lse`` (H, T). ``sinks``: H values, any
    shape (:func:`check`)."""
    cdt = torch.float64 if out.dtype == torch.float64 else torch.float32
    # a row with no visible key (+inf by flash-attn 2's convention) has an empty sum: -inf here,
    # so that its gate is 0 and its lse the sink's (and no inf - inf in a gradient)
    lse = lse.to(cdt).masked_fill(torch.isposinf(lse), -math.inf)
    s = sinks.reshape(-1).to(device=lse.device, dtype=cdt)
    s = s[:, None] if packed else s[None, :, None]
    gate = torch.sigmoid(lse - s)  # (H, T) or (B, H, S)
    gate = gate.transpose(0, 1) if packed else gate.transpose(1, 2)
    scaled = out.to(cdt) * gate.unsqueeze(-1)
    return scaled.to(out.dtype), torch.logaddexp(lse, s).float()
