"""``flash_attn.bert_padding`` equivalents (pure torch; flash-attn's own need einops and its
package)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def index_first_axis(x: Tensor, indices: Tensor) -> Tensor:
    """``flash_attn.bert_padding.index_first_axis``: rows ``indices`` of x, shape (n, ...).

    Plain indexing: autograd scatters the gradient back as flash-attn's custom Function does.
    """
    if x.dim() < 2:
        raise ValueError(f"index_first_axis expects a tensor of at least 2 dims, got {x.dim()}")
    return x[indices]


def unpad_input(
    hidden_states: Tensor, attention_mask: Tensor, unused_mask: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor, int, Tensor]:
    """``flash_attn.bert_padding.unpad_input`` of flash-attn 2.8.3 (five return values).

    hidden_states (batch, seqlen, ...), attention_mask (batch, seqlen) bool/int, 1 = valid;
    unused_mask (batch, seqlen), 1 = allocated but unused (selected too, not counted as used).
    Returns (hidden_states (total_nnz, ...), indices (total_nnz,) into the flattened batch,
    cu_seqlens int32 (batch + 1,), max_seqlen_in_batch int, seqused int32 (batch,): tokens
    selected by attention_mask alone). Reads the lengths on the host (``nonzero`` and ``.item()``),
    as flash-attn does, so it is not traceable in one graph by torch.compile.
    """
    all_masks = attention_mask if unused_mask is None else attention_mask + unused_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = int(seqlens_in_batch.max().item())
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return (
        index_first_axis(hidden_states.flatten(0, 1), indices),
        indices,
        cu_seqlens,
        max_seqlen_in_batch,
        used_seqlens_in_batch,
    )


def pad_input(hidden_states: Tensor, indices: Tensor, batch: int, seqlen: int) -> Tensor:
    """``flash_attn.bert_padding.pad_input``: scatter (total_nnz, ...) rows back to
    (batch, seqlen, ...) at ``indices`` of the flattened batch; other positions are zeros.
    """
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out = out.index_put((indices,), hidden_states)
    return out.unflatten(0, (batch, seqlen))
