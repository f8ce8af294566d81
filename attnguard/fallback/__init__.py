"""attnguard's twins of flash-attn 2.x and xformers attention, computed with torch's own kernels.

attnguard uses these where the requested kernel cannot run (CPU tensors, flash-attn missing or
broken, xformers ops not loadable, a call the kernel refuses): each function takes exactly the
arguments of the function it mirrors, returns the same shapes and computes the same thing. Which
torch kernel computes a call (torch's own flash kernel, SDPA's dispatcher, per-sequence SDPA,
explicit math) and why is decided in one place, :mod:`attnguard.fallback.routes`.

The package, split by what its parts stand for:

* :mod:`.dense`: ``flash_attn_func`` and its qkv/kv-packed variants;
* :mod:`.varlen`: ``flash_attn_varlen_func`` and its qkv/kv-packed variants (packed rows);
* :mod:`.kvcache`: ``flash_attn_with_kvcache``;
* :mod:`.fa3`, :mod:`.fa4`: flash-attn 3's (and vLLM's build of them) and flash-attn 4's
  functions, each under its own family's rules; :mod:`.families`: which twins stand for which
  flash-attn family (the conventions below are flash-attn 2's);
* :mod:`.padding`: ``flash_attn.bert_padding``'s ``index_first_axis``, ``unpad_input``,
  ``pad_input``;
* :mod:`.xformers`: ``xformers.ops.memory_efficient_attention``;
* :mod:`.masks` (windows, bands, ALiBi), :mod:`.sdpa` (SDPA plumbing, explicit attention) and
  :mod:`.torch_flash` (torch's bundled flash kernel) underneath, and :mod:`.kernels`, the table.

Conventions kept from the real kernels:

* flash-attn: layout ``(batch, seqlen, nheads, headdim)``; varlen ``(total, nheads, headdim)``
  with int32 ``cu_seqlens`` and no attention across sequences; GQA/MQA when k/v have fewer
  heads; causal masks and sliding windows are aligned to the bottom-right corner (query ``i``
  sees keys ``j <= i + seqlen_k - seqlen_q``), window values normalised as flash-attn's C++
  entry points do; rows with no visible key give zeros; ``softcap > 0`` computes
  ``softcap * tanh(scores * scale / softcap)``; ALiBi adds ``-slope * |i + Sk - Sq - j|``
  after scaling and softcapping; dropout is applied whenever ``dropout_p > 0``.
* ``return_attn_probs=True`` returns ``(out, softmax_lse, None)``: ``softmax_lse`` is float32,
  ``(batch, nheads, seqlen_q)`` (varlen: ``(nheads, total_q)``), ``+inf`` for fully masked
  rows like flash-attn; the third item (flash-attn's debug ``S_dmask``, which is empty unless
  dropout is on) is always ``None``. With causal ALiBi, flash-attn's own kernel drops the
  row-constant part of the bias, so its lse differs from ours by that constant; ``out`` agrees.
* ``deterministic=True`` keeps flash-attn's promise of a bitwise-reproducible backward pass (the
  forward pass is reproducible anyway): torch's flash kernel in its deterministic mode where it
  can run, elsewhere kernels that reproduce (:mod:`attnguard.fallback.routes`). Under
  ``torch.use_deterministic_algorithms(True)`` torch's own kernels keep that promise.
* ``torch.compile(fullgraph=True)`` traces every function as one graph: mask decisions are
  made from shapes and window values, never from tensor values. Where torch's flash kernel
  serves a varlen call it needs no host read at all; elsewhere ``flash_attn_varlen_func`` reads
  ``cu_seqlens`` on the host in eager calls and under compile switches to a padded-batch
  formulation that needs ``max_seqlen_q/k`` to bound the lengths, as flash-attn does. Block-
  diagonal xformers biases carry their lengths as Python lists: one graph per distinct list.
  ``flash_attn_with_kvcache`` keeps its lengths as tensors and traces whole too;
  ``unpad_input`` reads lengths on the host as flash-attn's does and does not.
* ``flash_attn_with_kvcache`` updates ``k_cache``/``v_cache`` in place like the kernel, rotary
  embedding included (rounded to the cache dtype as the kernel rounds it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .dense import flash_attn_func, flash_attn_kvpacked_func, flash_attn_qkvpacked_func
from .kvcache import flash_attn_with_kvcache
from .padding import index_first_axis, pad_input, unpad_input
from .varlen import (
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)
from .xformers import xformers_memory_efficient_attention

__all__ = [
    "FLASH_FUNCTIONS",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "index_first_axis",
    "pad_input",
    "unpad_input",
    "xformers_memory_efficient_attention",
]

FLASH_FUNCTIONS: dict[str, Callable[..., Any]] = {
    "flash_attn_func": flash_attn_func,
    "flash_attn_varlen_func": flash_attn_varlen_func,
    "flash_attn_qkvpacked_func": flash_attn_qkvpacked_func,
    "flash_attn_kvpacked_func": flash_attn_kvpacked_func,
    "flash_attn_varlen_qkvpacked_func": flash_attn_varlen_qkvpacked_func,
    "flash_attn_varlen_kvpacked_func": flash_attn_varlen_kvpacked_func,
    "flash_attn_with_kvcache": flash_attn_with_kvcache,
    # flash_attn.bert_padding
    "index_first_axis": index_first_axis,
    "unpad_input": unpad_input,
    "pad_input": pad_input,
}
