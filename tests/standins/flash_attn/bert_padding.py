"""STAND-IN for flash-attn 2.8.3's ``flash_attn.bert_padding`` (same signatures, plain torch)."""

import torch
import torch.nn.functional as F


def index_first_axis(input, indices):
    """``input[indices]`` over the flattened first axis (keeps the trailing shape)."""
    return input.reshape(input.shape[0], -1)[indices].reshape(-1, *input.shape[1:])


def index_put_first_axis(values, indices, first_axis_dim):
    output = values.new_zeros(first_axis_dim, *values.shape[1:])
    output[indices] = values
    return output


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """(B, S, ...) + (B, S) mask -> (total, ...), indices, cu_seqlens, max_seqlen, seqused."""
    all_masks = (attention_mask + unused_mask) if unused_mask is not None else attention_mask
    seqlens_in_batch = all_masks.sum(dim=-1, dtype=torch.int32)
    used_seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch, used_seqlens_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    """(total, ...) -> (batch, seqlen, ...), zeros where there was padding."""
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.reshape(batch, seqlen, *hidden_states.shape[1:])
