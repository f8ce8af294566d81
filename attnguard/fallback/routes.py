"""Which torch kernel computes a twin's call, and why: the one table.

"Which kernel computes this call" is decided at two levels. :mod:`attnguard.kernels` decides
whether a call runs on the kernel the caller asked for or on attnguard's twin of it. This module
decides, inside the twin, which of torch's kernels computes it: the fastest one this torch and
GPU offer that can express the call's semantics (packed rows, windows, softcap, ALiBi, GQA,
bottom-right causal alignment), and where a kernel cannot express a feature, one that can.

The kernels, fastest first where they apply:

* ``torch_flash``: torch's own FlashAttention-2 (:mod:`.torch_flash`): CUDA, compute capability
  >= 8.0, fp16/bf16, head_dim <= 256. flash-attn's algorithm, so packed rows, windows and
  bottom-right causality are native and nothing is read on the host. No softcap, no ALiBi.
* ``sdpa``: ``scaled_dot_product_attention`` without a mask, no backend forced: the dispatcher
  picks cuDNN on Hopper, torch's flash kernel on Ampere, memory-efficient attention elsewhere,
  math only where no fused kernel takes the call. For plain dense calls (full, or causal with as
  many queries as keys) it is the fastest there is (docs/benchmarks.md).
* ``sdpa_mask``: SDPA with a boolean keep-mask and/or an additive float bias: windows, bottom-
  right causality, ALiBi and padded batches where torch's flash kernel cannot run (CPU, fp32,
  old GPUs) or ALiBi is asked for (memory-efficient or math backend).
* ``explicit``: softmax attention written out in float32 (query rows in chunks): softcap, the
  softmax LSE where torch's flash kernel cannot give it, and a reproducible backward where
  neither torch's flash kernel nor torch's deterministic flag gives one.
* ``per_sequence``: a packed call split at ``cu_seqlens`` (read on the host) into batches of
  equal-length sequences, each computed as a dense call (rows above).
* ``triton_decode``: attnguard's own Triton kernel for one decode step of a KV cache
  (:mod:`.triton_decode`): the append and the attention in one launch, where Triton imports and
  the call is the common decode call.
* ``padded``: a packed call gathered into a padded (sequences x max_seqlen) batch with masks per
  sequence, nothing read on the host (torch.compile, KV caches the fast path cannot take).

Determinism. flash-attn's ``deterministic=True`` promises a bitwise-reproducible backward pass.
Of torch's GPU attention kernels, torch's flash kernel has such a mode (flash-attn's own: dq
accumulated per split, summed in a fixed order), which aten switches on only under
``torch.use_deterministic_algorithms(True)`` (not warn-only): :mod:`.torch_flash` runs that
backward with torch's flag set for the one call. The memory-efficient kernel's backward is
deterministic under torch's flag too (one key split); torch runs cuDNN's with no deterministic
mode (under torch's flag SDPA's dispatcher does not choose it; warn-only, it warns). So a call
that asks for determinism goes to torch's flash kernel where it can run; elsewhere on a GPU,
SDPA's dispatcher serves it only under torch's flag, and the explicit path (matmuls and a
softmax, reproducible) otherwise. On CPU SDPA's kernels are reproducible run to run anyway. Under
``torch.use_deterministic_algorithms(True)`` without ``deterministic=True``, torch's kernels
themselves keep the promise (a warn-only flag warns, as torch does).

Every route is a row of :data:`TABLE` (``attnguard doctor`` could print it; the tests walk every
row). The route functions are pure: facts in, a row id out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Route:
    """One row of the table: for calls of ``call`` when ``when`` holds, ``kernel`` computes."""

    id: str
    call: str  # dense | varlen | kvcache | xformers
    kernel: str  # torch_flash | sdpa | sdpa_mask | explicit | per_sequence | padded | triton_decode
    when: str
    why: str


TABLE: tuple[Route, ...] = (
    # --- flash_attn_func and its packed variants (and each batch of per_sequence) ---
    Route(
        "dense-softcap",
        "dense",
        "explicit",
        "softcap > 0",
        "no torch kernel computes flash-attn's tanh softcapping of the scores",
    ),
    Route(
        "dense-lse-flash",
        "dense",
        "torch_flash",
        "the LSE is asked for (return_attn_probs, or attention sinks computed from it without "
        "a backward through it), no ALiBi, torch's flash kernel can run",
        "it returns flash-attn's float32 LSE with the output, in one fused call",
    ),
    Route(
        "dense-lse",
        "dense",
        "explicit",
        "the LSE is asked for and torch's flash kernel cannot give it (CPU, fp32, ALiBi, ...), "
        "or attention sinks need its gradient",
        "SDPA does not return the LSE; torch's flash kernel's LSE carries no gradient",
    ),
    Route(
        "dense-alibi",
        "dense",
        "sdpa_mask",
        "alibi_slopes given",
        "torch's flash build refuses ALiBi; SDPA takes it as an additive float32 bias",
    ),
    Route(
        "dense-deterministic-flash",
        "dense",
        "torch_flash",
        "deterministic=True (a reproducible backward), no ALiBi, torch's flash kernel can run",
        "its backward has flash-attn's deterministic mode (run with torch's deterministic flag "
        "for that call); SDPA's dispatcher would pick cuDNN on Hopper, whose backward torch runs "
        "with no deterministic mode",
    ),
    Route(
        "dense-deterministic",
        "dense",
        "explicit",
        "deterministic=True on a GPU where torch's flash kernel cannot run (fp32, ALiBi, before "
        "sm80), torch's deterministic flag off",
        "SDPA's GPU backwards reproduce only under torch's flag (no cuDNN, memory-efficient with "
        "one key split); matmuls and a softmax reproduce bit for bit",
    ),
    Route(
        "dense-plain",
        "dense",
        "sdpa",
        "no window, and full attention or causal with as many queries as keys",
        "SDPA's dispatcher picks the fastest fused kernel (cuDNN on Hopper: faster than "
        "flash-attn there); its causal mask is flash-attn's when Sq == Sk",
    ),
    Route(
        "dense-window-flash",
        "dense",
        "torch_flash",
        "a sliding window, or causal with fewer/more queries than keys; torch's flash kernel "
        "can run",
        "windows and bottom-right causality are native there: no mask tensor, a fused kernel",
    ),
    Route(
        "dense-mask",
        "dense",
        "sdpa_mask",
        "a sliding window or bottom-right causality where torch's flash kernel cannot run",
        "SDPA with flash-attn's band as a boolean mask computes the same",
    ),
    # --- flash_attn_varlen_func and its packed variants ---
    Route(
        "varlen-flash",
        "varlen",
        "torch_flash",
        "torch's flash kernel can run; no softcap, no ALiBi, no block_table",
        "packed rows in one call, lengths never read on the host (as fast as flash-attn's varlen "
        "kernel: docs/benchmarks.md); with deterministic=True its deterministic backward",
    ),
    Route(
        "varlen-compile",
        "varlen",
        "padded",
        "under torch.compile, where varlen-flash does not apply",
        "cu_seqlens are data: reading them would break the graph; max_seqlen bounds the shapes "
        "(masked SDPA, or the explicit path where determinism asks for it: sdpa_reproducible)",
    ),
    Route(
        "varlen-segments",
        "varlen",
        "per_sequence",
        "otherwise (CPU, fp32, softcap, ALiBi, a paged block_table)",
        "each sequence computed exactly as a dense call; equal lengths batched together",
    ),
    # --- flash_attn_with_kvcache ---
    Route(
        "kvcache-decode",
        "kvcache",
        "triton_decode",
        "one query token, at most one new token, rows 0..B-1 of the cache (no block_table, "
        "cache_batch_idx, cache_leftpad, rotary, softcap or ALiBi), fp16/bf16 on a CUDA GPU, "
        "head_dim <= 256 and a multiple of 8, Triton importable, not under torch.compile",
        "a decode step is bound by the host: one Triton launch (two for a split cache) appends "
        "and attends, where torch's ops take five; the cache split over the whole GPU",
    ),
    Route(
        "kvcache-flash",
        "kvcache",
        "torch_flash",
        "torch's flash kernel can run (with seqused_k); contiguous caches; no block_table, "
        "cache_batch_idx, cache_leftpad, softcap or ALiBi",
        "new keys written in place with one index_copy_ each, then one call reading each "
        "sequence's cache up to its length (seqused_k): no host read, no gathered copy",
    ),
    Route(
        "kvcache-general",
        "kvcache",
        "padded",
        "otherwise",
        "the cache gathered per sequence (pages, batch index, left padding) and masked per "
        "sequence; the dense rows compute it",
    ),
    # --- xformers.ops.memory_efficient_attention ---
    Route(
        "xformers-blocks-flash",
        "xformers",
        "torch_flash",
        "a BlockDiagonal(Causal|CausalFromBottomRight)Mask bias (top-left causal only where each "
        "block has as many queries as keys); torch's flash kernel can run",
        "the blocks are packed rows: one varlen call",
    ),
    Route(
        "xformers-blocks",
        "xformers",
        "per_sequence",
        "any other block-diagonal bias",
        "blocks of equal lengths batched into one SDPA call each",
    ),
    Route(
        "xformers-bias",
        "xformers",
        "sdpa_mask",
        "no bias, a tensor bias, a (bottom-right) lower-triangular mask or any other bias "
        "object (materialised)",
        "SDPA takes the bias as a mask; without one it is plain SDPA",
    ),
)

ROUTES = {r.id: r for r in TABLE}


def sdpa_reproducible(*, deterministic: bool, torch_deterministic: bool, gpu: bool) -> bool:
    """Whether SDPA's dispatcher may serve a call: always, unless the call asks for a
    reproducible backward (``deterministic``) on a GPU and torch's deterministic flag
    (``torch_deterministic``, which makes SDPA's GPU backwards deterministic) is off. On CPU
    SDPA's kernels reproduce run to run."""
    return not (deterministic and gpu and not torch_deterministic)


def dense(
    *,
    flash_ok: bool,
    window: tuple[int, int],
    sq: int,
    sk: int,
    softcap: float,
    alibi: bool,
    need_lse: bool,
    deterministic: bool = False,
    torch_deterministic: bool = False,
    gpu: bool = False,
) -> str:
    """Route of a dense call; ``window`` is flash-attn's normalised (left, right), causal =
    (-1, 0); ``flash_ok``: torch's flash kernel can take these tensors (with a window and, if
    asked, its deterministic backward); ``deterministic``: the call asks for a reproducible
    backward; ``torch_deterministic``: ``torch.are_deterministic_algorithms_enabled()``;
    ``gpu``: the tensors are on a GPU."""
    if softcap > 0:
        return "dense-softcap"
    if need_lse:
        return "dense-lse-flash" if flash_ok and not alibi else "dense-lse"
    if deterministic and flash_ok and not alibi:
        return "dense-deterministic-flash"
    if not sdpa_reproducible(
        deterministic=deterministic, torch_deterministic=torch_deterministic, gpu=gpu
    ):
        return "dense-deterministic"
    if alibi:
        return "dense-alibi"
    left, right = window
    full = left < 0 and right < 0
    causal_aligned = left < 0 and right == 0 and sq == sk
    if full or causal_aligned:
        return "dense-plain"
    return "dense-window-flash" if flash_ok else "dense-mask"


def varlen(*, flash_ok: bool, softcap: float, alibi: bool, paged: bool, compiling: bool) -> str:
    """Route of a packed (varlen) call."""
    if flash_ok and softcap <= 0 and not alibi and not paged:
        return "varlen-flash"
    return "varlen-compile" if compiling else "varlen-segments"


def kvcache(
    *,
    decode: bool = False,
    flash_ok: bool = False,
    contiguous: bool = False,
    paged: bool = False,
    batch_idx: bool = False,
    leftpad: bool = False,
    softcap: float = 0.0,
    alibi: bool = False,
) -> str:
    """Route of a ``flash_attn_with_kvcache`` call. ``decode``: one query token on rows 0..B-1
    of the cache, no rotary, softcap or ALiBi: the decode kernel is tried first
    (:func:`attnguard.fallback.triton_decode.decode` checks the rest and declines what it cannot
    take); the other facts are asked only where it declines."""
    if decode:
        return "kvcache-decode"
    if flash_ok and contiguous and not (paged or batch_idx or leftpad or alibi) and softcap <= 0:
        return "kvcache-flash"
    return "kvcache-general"


def xformers(*, flash_ok: bool, block_kind: str | None, equal_lengths: bool) -> str:
    """Route of an xformers call; ``block_kind`` is none / top_left / bottom_right for the
    block-diagonal biases, None for every other bias."""
    if block_kind is None:
        return "xformers-bias"
    if flash_ok and (block_kind != "top_left" or equal_lengths):
        return "xformers-blocks-flash"
    return "xformers-blocks"
