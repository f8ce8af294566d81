"""flash-attn's masks from shapes and window values: windows normalised as its C++ entry points
do, bottom-right aligned causal bands, per-sequence bands of a padded batch, ALiBi biases.

Every decision here is made from Python ints (shapes, window values), never from tensor values,
so the masks are static under ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

Tensor = torch.Tensor


def normalize_window(window_size: Sequence[int], causal: bool, seqlen_k: int) -> tuple[int, int]:
    """Window (left, right) as flash-attn's mha_fwd / set_params_fprop normalise it."""
    left, right = int(window_size[0]), int(window_size[1])
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


# A family's window rule: (window_size, causal, seqlen_q, seqlen_k) -> the band (left, right)
# around the bottom-right diagonal, -1 an open side (what :func:`band_mask` and the twins take).
WindowRule = Callable[[Sequence[Any], bool, int, int], tuple[int, int]]


def fa2_rule(
    window_size: Sequence[Any], causal: bool, seqlen_q: int, seqlen_k: int
) -> tuple[int, int]:
    """flash-attn 2's rule (:func:`normalize_window`; seqlen_q plays no part)."""
    return normalize_window(window_size, causal, seqlen_k)


def band_rule(
    window_size: Sequence[Any], causal: bool, seqlen_q: int, seqlen_k: int
) -> tuple[int, int]:
    """A window already resolved into a band (flash-attn 4's: :func:`fa4_window`), as given."""
    return int(window_size[0]), int(window_size[1])


def fa3_window(
    window_size: Sequence[int], causal: bool, seqlen_q: int, seqlen_k: int
) -> tuple[int, int]:
    """Window (left, right) as flash-attn 3 normalises it (hopper/flash_api.cpp, ``mha_fwd``
    then ``set_params_fprop``; the vLLM build's hopper/flash_api.cpp alike): a side at or past
    the last key (left >= seqlen_k - 1) or query (right >= seqlen_q - 1) reaches nothing more
    and is open; causal sets right = 0; an open side stays open (``set_params_fprop`` gives it
    seqlen_k - 1 / seqlen_q - 1, every key on that side). Varlen calls pass max_seqlen_q/k.
    flash-attn 2 (:func:`normalize_window`) instead closes an open side at seqlen_k."""
    left, right = int(window_size[0]), int(window_size[1])
    if left >= seqlen_k - 1:
        left = -1
    if right >= seqlen_q - 1:
        right = -1
    if causal:
        right = 0
    return max(left, -1), max(right, -1)


def fa4_window(window_size: Sequence[int | None], causal: bool) -> tuple[int, int] | None:
    """Window (left, right) as flash-attn 4 resolves it (flash_attn/cute/interface.py,
    ``_resolve_causal_local_window``): ``None`` is an open side; causal sets right = 0; two
    ints summing below 0 mean no window (so (-1, -1), and (-1, 0) without causal, are full
    attention; with causal, causal attention); other ints bound the band as given, also below
    0 (its mask, flash_attn/cute/mask.py, reads them literally). Returns the band with -1 for
    an open side, or None where a side is a negative int (a band that excludes the diagonal:
    not computed by the twins)."""
    left, right = window_size[0], window_size[1]
    if causal:
        right = 0
    if left is not None and right is not None and int(left) + int(right) < 0:
        left = right = None  # no window; a causal call stays causal (its flag is kept)
        right = 0 if causal else None
    bounds = tuple(-1 if w is None else int(w) for w in (left, right))
    if any(w < 0 for w, given in zip(bounds, (left, right), strict=True) if given is not None):
        return None
    return bounds[0], bounds[1]


def kernel_band(window: tuple[int, int], seqlen_q: int, seqlen_k: int) -> bool:
    """Whether torch's flash kernel, given ``window`` (a band: -1 an open side), computes that
    band for (seqlen_q, seqlen_k): it normalises a window as flash-attn 2 does (aten's copy of
    flash_api.cpp, ``mha_fwd`` / ``set_params_fprop``: a side >= seqlen_k opens, an open side
    beside a closed one closes at seqlen_k). A window normalised by :func:`normalize_window`
    always passes; flash-attn 3's open side beside a closed one passes only where seqlen_k
    reaches every query (seqlen_q <= seqlen_k + 1). Varlen calls pass the max seqlens."""
    left, right = window
    kl = -1 if left >= seqlen_k else left
    kr = -1 if right >= seqlen_k else right
    if kl < 0 <= kr:
        kl = seqlen_k
    if kl >= 0 > kr:
        kr = seqlen_k
    return _band(kl, kr, seqlen_q, seqlen_k) == _band(left, right, seqlen_q, seqlen_k)


def _band(left: int, right: int, sq: int, sk: int) -> tuple[int, int]:
    """A band in one spelling: a side that bounds no row (left >= sk - 1: the last query's lower
    bound is key 0 or before; right >= sq - 1: the first query's upper bound is the last key or
    after) is -1, open."""
    return (left if 0 <= left < sk - 1 else -1, right if 0 <= right < sq - 1 else -1)


def band_mask(
    sq: int, sk: int, offset: int, left: int, right: int, device: torch.device
) -> tuple[Tensor | None, Tensor | None]:
    """Keep-mask for query ``i`` seeing keys ``i + offset - left <= j <= i + offset + right``.

    A negative ``left``/``right`` leaves that side open. Returns ``(keep, empty)``: the (Sq, Sk)
    bool keep-mask, None when every key is visible to every query, and the (Sq,) bool mask of
    rows that see no key, None when there are none. Both decisions are made from the Python
    ints alone, never from tensor values, so they are static under ``torch.compile`` (a host
    read such as ``bool(keep.all())`` would break the graph). Needs ``sq, sk >= 1``.
    """
    # Row i sees keys [max(0, i + offset - left), min(sk - 1, i + offset + right)]; the last
    # row has the largest lower bound and row 0 the smallest upper bound.
    lower_open = left < 0 or sq - 1 + offset - left <= 0
    upper_open = right < 0 or offset + right >= sk - 1
    if lower_open and upper_open:
        return None, None
    i = torch.arange(sq, device=device).unsqueeze(1) + offset
    j = torch.arange(sk, device=device).unsqueeze(0)
    keep: Tensor | None = None
    if not lower_open:
        keep = j >= i - left
    if not upper_open:
        below = j <= i + right
        keep = below if keep is None else keep & below
    assert keep is not None
    # Rows [first_seen, end_seen) see at least one key: the upper bound must reach key 0 and
    # the lower bound must stay within key sk - 1 (with both bounds set, lower <= upper).
    first_seen = max(0, -(offset + right)) if right >= 0 else 0
    end_seen = min(sq, sk - offset + left) if left >= 0 else sq
    if first_seen == 0 and end_seen >= sq:
        return keep, None
    r = torch.arange(sq, device=device)
    return keep, (r < first_seen) | (r >= end_seen)


def padded_band(
    len_q: Tensor, len_k: Tensor, sq: int, sk: int, left: int, right: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Masks for a padded batch of sequences with their own lengths (bottom-right aligned).

    Returns keep (B, 1, Sq, Sk): key ``j < len_k[b]`` inside the (left, right) window of query
    ``i`` aligned to sequence ``b``'s lengths; empty (B, 1, Sq): rows with no visible key;
    rel (B, 1, Sq, Sk): ``i + len_k[b] - len_q[b] - j`` (for ALiBi). All tensor ops: the
    lengths are data, not shapes.
    """
    dev = len_q.device
    i = torch.arange(sq, device=dev).view(1, sq, 1) + (len_k - len_q).view(-1, 1, 1)
    j = torch.arange(sk, device=dev).view(1, 1, sk)
    rel = i - j
    keep = (j < len_k.view(-1, 1, 1)).expand(-1, sq, -1)
    if left >= 0:
        keep = keep & (rel <= left)
    if right >= 0:
        keep = keep & (rel >= -right)
    keep = keep.unsqueeze(1)
    return keep, ~keep.any(dim=-1), rel.unsqueeze(1)


def alibi_bias(
    slopes: Tensor, row0: int, row1: int, sq: int, sk: int, dtype: torch.dtype
) -> Tensor:
    """ALiBi bias -slope * |i + Sk - Sq - j| for query rows [row0, row1): (B|1, H, rows, Sk)."""
    slopes = slopes.to(dtype)
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0)
    i = torch.arange(row0, row1, device=slopes.device, dtype=dtype).unsqueeze(1) + (sk - sq)
    j = torch.arange(sk, device=slopes.device, dtype=dtype).unsqueeze(0)
    return -slopes[:, :, None, None] * (i - j).abs()


def check_alibi(alibi_slopes: Tensor | None, batch: int, nheads: int) -> None:
    if alibi_slopes is None:
        return
    if tuple(alibi_slopes.shape) not in ((nheads,), (batch, nheads)):
        raise ValueError(
            f"alibi_slopes must have shape ({nheads},) or ({batch}, {nheads}), "
            f"got {tuple(alibi_slopes.shape)}"
        )
