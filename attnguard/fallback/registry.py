"""The SDPA twin of transformers' flash registry entry, for calls its code path cannot take.

transformers' flash path (``flash_attention_forward`` -> ``_flash_attention_forward``) takes a 2D
padding mask and returns no attention weights. A call with a 4D mask or ``output_attentions=True``
is computed here instead, in the registry's (B, H, S, D) -> (B, S, H, D) layout, with flash's own
semantics: padding, bottom-right causal alignment, sliding window, packed sequences (from
``cu_seq_lens_k`` or restarting ``position_ids``), softcap and attention sinks. SDPA where it can
express the call (no backend forced: the dispatcher picks the fused kernel), explicit attention
math where it cannot (attention weights, softcap, sinks).

Calls the flash path *can* take stay on it: when the flash-attn kernel cannot run, its kernel
functions are served by the twins of :mod:`attnguard.fallback` instead (see
:mod:`attnguard.kernels`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..observability import events
from .sdpa import SDPA_TAKES_GQA, repeat_kv_heads

Tensor = torch.Tensor
_BOOL = torch.bool
_FP32 = torch.float32


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
        if mask is None and SDPA_TAKES_GQA:
            extra["enable_gqa"] = True
        else:  # with a mask, repeated heads keep the fused kernels eligible (and torch < 2.5
            # has no enable_gqa)
            key, value = repeat_kv_heads(key, n_rep), repeat_kv_heads(value, n_rep)
    if mask is not None and mask.dtype != _BOOL and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
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
    key, value = repeat_kv_heads(key, n_rep), repeat_kv_heads(value, n_rep)
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
    window: tuple[int, int] | None = None,
    segments: Tensor | None = None,
) -> tuple[Tensor | None, Tensor | None, bool]:
    """Build what SDPA needs from what a flash path receives.

    ``mask`` is the 2D (B, S) padding mask (1 = token) flash functions get, or a 4D mask in SDPA
    form (used as it is), or None. Causality is bottom-right aligned as flash-attn's (query ``i``
    sees keys ``j <= i + sk - sq``). ``window`` is flash-attn's ``window_size`` (left, right):
    query ``i`` sees keys ``i - left <= j <= i + right``, -1 for no bound. Returns (keep mask (B|1, 1, sq, sk) bool or a 4D float mask
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
    if window is not None and window[0] < 0 and (causal or window[1] < 0):
        window = None
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
        left, right = window
        if left >= 0:
            keep = keep & ((i - j) <= left)
        if right >= 0 and not causal:
            keep = keep & ((j - i) <= right)
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
    *,
    window: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Compute a transformers flash registry call with SDPA (or eager math where SDPA cannot).

    Same inputs (B, H, S, D), same output (B, S, H, D); padding, causality and packed sequences
    from the flash call's own arguments; ``window``: the flash ``window_size`` that the call's
    ``sliding_window`` becomes on this transformers release (the caller knows the convention).
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
        window=window,
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


def all_sdpa_backends() -> Any:
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


def move_tensors(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, Tensor) and obj.device != device:
        return obj.to(device)
    return obj
