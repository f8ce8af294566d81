"""STAND-IN for flash-attn 2.8.3's ``flash_attn.flash_attn_interface`` (attnguard tests only).

The Python API with the real signatures; the kernels are torch custom ops registered for CUDA
only (``_flash_attn_standin_ops``), so CPU inputs fail in the torch dispatcher exactly as with the
real package. See ``tests/standins/README.md``.
"""

import torch
from _flash_attn_standin_ops import _attend, _check_inputs, _not_implemented  # noqa: F401

# The real module binds its CUDA extension here (``import flash_attn_2_cuda as flash_attn_gpu``);
# xformers reads this name when it is imported. The stand-in has no extension module to offer.
flash_attn_gpu = None


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, Sq, H, D), k/v (B, Sk, Hk, D) -> out (B, Sq, H, Dv) [, lse, S_dmask]."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    out, lse, s_dmask, _ = torch.ops.flash_attn._flash_attn_forward(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size[0],
        window_size[1],
        softcap,
        alibi_slopes,
        return_attn_probs,
    )
    return out if not return_attn_probs else (out, lse, s_dmask)


def flash_attn_qkvpacked_func(
    qkv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """qkv (B, S, 3, H, D)."""
    q, k, v = qkv.unbind(dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_kvpacked_func(
    q,
    kv,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, Sq, H, D), kv (B, Sk, 2, Hk, D)."""
    k, v = kv.unbind(dim=2)
    return flash_attn_func(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        return_attn_probs,
    )


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """q (total_q, H, D), k/v (total_k, Hk, D), int32 cu_seqlens (B + 1)."""
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    out, lse, s_dmask, _ = torch.ops.flash_attn._flash_attn_varlen_forward(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        dropout_p,
        softmax_scale,
        causal,
        window_size[0],
        window_size[1],
        softcap,
        alibi_slopes,
        return_attn_probs,
        block_table,
    )
    return out if not return_attn_probs else (out, lse, s_dmask)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Decode against a (B, S_max, Hk, D) cache, appending k/v in place at ``cache_seqlens``."""
    if rotary_cos is not None or cache_batch_idx is not None or cache_leftpad is not None:
        raise _not_implemented("rotary / cache_batch_idx / cache_leftpad")
    if block_table is not None:
        raise _not_implemented("paged KV (block_table)")
    # The real fwd_kvcache is a plain extension call (not a torch custom op): its CUDAGuard on
    # q's device is what rejects CPU tensors, before mha_fwd's other checks.
    if not q.is_cuda:
        raise RuntimeError(f"CUDAGuardImpl initialized with non-CUDA DeviceType: {q.device.type}")
    _check_inputs(q, k_cache, v_cache)
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** (-0.5)
    b = q.shape[0]
    if cache_seqlens is None:
        lens = [k_cache.shape[1]] * b
    elif isinstance(cache_seqlens, int):
        lens = [cache_seqlens] * b
    else:
        lens = [int(x) for x in cache_seqlens.tolist()]
    outs, lses = [], []
    for i in range(b):
        n = lens[i]
        if k is not None:
            s_new = k.shape[1]
            k_cache[i, n : n + s_new] = k[i]
            v_cache[i, n : n + s_new] = v[i]
            n += s_new
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes[i] if alibi_slopes.dim() == 2 else alibi_slopes
        o, l_ = _attend(
            q[i : i + 1],
            k_cache[i : i + 1, :n],
            v_cache[i : i + 1, :n],
            dropout_p=0.0,
            scale=softmax_scale,
            causal=causal,
            window=tuple(window_size),
            softcap=softcap,
            alibi_slopes=slopes,
            need_lse=return_softmax_lse,
        )
        outs.append(o)
        lses.append(l_)
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_softmax_lse else out


# The real module's internal wrappers of its custom ops, which diffusers' context-parallel
# attention imports (diffusers >= 0.36): present with the real names, not implemented.
def _wrapped_flash_attn_forward(*args, **kwargs):
    raise _not_implemented("_wrapped_flash_attn_forward")


def _wrapped_flash_attn_backward(*args, **kwargs):
    raise _not_implemented("_wrapped_flash_attn_backward")
