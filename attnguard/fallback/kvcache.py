"""Twin of flash-attn's ``flash_attn_with_kvcache`` (decode and chunked prefill against a KV cache
updated in place, rotary embedding, paged caches).

Which torch kernel computes a call is decided in :mod:`attnguard.fallback.routes`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from . import attention_sinks, routes, torch_flash, triton_decode
from .dense import check_dtypes, flash_core
from .masks import WindowRule, check_alibi, fa2_rule, kernel_band
from .sdpa import compiling

Tensor = torch.Tensor


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotary embedding on the first ``2 * cos.shape[-1]`` channels of x (B, S, H, D).

    ``cos``/``sin`` are (B, S, rotary_dim / 2), already gathered at each token's position.
    Interleaved rotates channel pairs (0, 1), (2, 3), ...; otherwise (GPT-NeoX style) channel
    ``c`` with ``c + rotary_dim / 2``. As in flash-attn's kernel the rotation is computed in
    float32 (float64 stays float64) and rounded back to x's dtype; channels past rotary_dim are
    left untouched.
    """
    rd = 2 * cos.shape[-1]
    cdt = torch.float64 if x.dtype == torch.float64 else torch.float32
    c, s = cos.to(cdt).unsqueeze(2), sin.to(cdt).unsqueeze(2)
    xr = x[..., :rd].to(cdt)
    if interleaved:
        x0, x1 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    else:
        x0, x1 = xr[..., : rd // 2], xr[..., rd // 2 :]
        rot = torch.cat((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., rd:]), dim=-1)


def rotate_at(x: Tensor, pos: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """x (B, S, H, D) rotated at positions ``pos`` (B, S) of the rotary tables (clamped to them,
    as the kernel reads them)."""
    pos = pos.clamp(0, cos.shape[0] - 1).to(cos.device)
    return apply_rotary(x, cos[pos].to(x.device), sin[pos].to(x.device), interleaved)


def _check_kvcache_args(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    rotary_cos: Tensor | None,
    rotary_sin: Tensor | None,
    cache_seqlens: int | Tensor | None,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    block_table: Tensor | None,
) -> int:
    """flash-attn's argument checks for ``flash_attn_with_kvcache`` (shapes, and dtypes no twin
    computes: :func:`.dense.check_dtypes`; they hold under torch.compile). Kernel limits (half
    dtypes, head_dim <= 256, page size a multiple of 256, rotary_dim a multiple of 16) are not
    enforced: lifting them is what the twin is for.
    Returns the cache capacity per sequence (flash-attn's ``seqlen_k``).
    """
    # Every decode step of every layer pays for these checks: torch.Size compared with tuples
    # directly, messages built only on failure.
    check_dtypes(q, k_cache, v_cache)  # an int8 cache is not cast into numbers
    if k is not None and v is not None:
        check_dtypes(q, k, v)
    qs, ks, vs = q.shape, k_cache.shape, v_cache.shape
    if len(qs) != 4:
        raise ValueError("q must have shape (batch_size, seqlen, nheads, headdim)")
    b = qs[0]
    if len(ks) != 4 or len(vs) != 4 or ks[:3] != vs[:3]:
        raise ValueError(
            "k_cache/v_cache must have shape (batch_size_cache, seqlen_cache, nheads_k, headdim) "
            "or (num_blocks, page_block_size, nheads_k, headdim); got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if block_table is not None:
        if cache_batch_idx is not None:
            raise ValueError("Paged KVcache does not support cache_batch_idx")
        if cache_leftpad is not None:
            raise ValueError("We don't support Paged KV and leftpad_k running at the same time yet")
        if block_table.dim() != 2 or block_table.shape[0] != b:
            raise ValueError(
                f"block_table must have shape ({b}, max_num_blocks_per_seq), "
                f"got {tuple(block_table.shape)}"
            )
        capacity = block_table.shape[1] * ks[1]
    else:
        capacity = ks[1]
        if cache_batch_idx is None and ks[0] < b:
            raise ValueError(
                f"k_cache holds {ks[0]} sequences for a batch of {b} "
                "(pass cache_batch_idx to pick cache rows)"
            )
    if cache_batch_idx is not None or cache_leftpad is not None:
        for name, t in (("cache_batch_idx", cache_batch_idx), ("cache_leftpad", cache_leftpad)):
            if t is not None and t.shape != (b,):
                raise ValueError(f"{name} must have shape ({b},), got {tuple(t.shape)}")
    if isinstance(cache_seqlens, Tensor) and cache_seqlens.shape not in ((), (b,)):
        raise ValueError(
            f"cache_seqlens must be an int or have shape ({b},), got {tuple(cache_seqlens.shape)}"
        )
    if (k is None) != (v is None):
        raise ValueError("If key is supplied, value must also be passed in")
    if k is not None:
        assert v is not None
        if cache_seqlens is None:
            raise ValueError("If key is supplied, seqlens_k must also be passed in")
        kn, vn = k.shape, v.shape
        if (
            len(kn) != 4
            or len(vn) != 4
            or kn[0] != b
            or kn[2] != ks[2]
            or vn[:3] != kn[:3]
            or kn[3] != ks[3]
            or vn[3] != vs[3]
        ):
            raise ValueError(
                f"k/v must have shape ({b}, seqlen_new, {ks[2]}, headdim) matching the cache; got "
                f"{tuple(k.shape)} and {tuple(v.shape)}"
            )
    if rotary_cos is not None or rotary_sin is not None:
        if k is None:
            raise ValueError(
                "If rotary cos/sin are provided, new key / value to be appended to KV cache "
                "must also be provided"
            )
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("If rotary cos is provided, rotary sin must also be provided")
        if rotary_cos.dim() != 2 or rotary_sin.shape != rotary_cos.shape:
            raise ValueError("rotary_cos/rotary_sin must both have shape (seqlen_ro, rotary_dim/2)")
        if 2 * rotary_cos.shape[1] > qs[3]:
            raise ValueError("rotary_dim must be <= headdim")
        if rotary_cos.shape[0] < capacity:
            raise ValueError("cos/sin seqlen must be at least the seqlen of KV cache")
    return capacity


def flash_attn_with_kvcache(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None = None,
    v: Tensor | None = None,
    rotary_cos: Tensor | None = None,
    rotary_sin: Tensor | None = None,
    cache_seqlens: int | Tensor | None = None,
    cache_batch_idx: Tensor | None = None,
    cache_leftpad: Tensor | None = None,
    block_table: Tensor | None = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    rotary_interleaved: bool = True,
    alibi_slopes: Tensor | None = None,
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    s_aux: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """SDPA stand-in for ``flash_attn.flash_attn_with_kvcache`` (flash-attn 2.x).

    As the kernel does: new ``k``/``v`` (rotated first when ``rotary_cos/sin`` are given, at
    positions ``cache_seqlens + t``) are written *in place* into the cache at ``cache_seqlens``
    (cache rows picked by ``cache_batch_idx``, or pages by ``block_table``); ``q`` is rotated at
    ``cache_seqlens + i`` when causal or local, else at ``cache_seqlens`` for every row. Then
    sequence ``b`` attends to its cache keys ``[cache_leftpad[b], cache_seqlens[b] + seqlen_new)``
    (the whole cache when ``cache_seqlens`` is None), with the causal mask / window aligned to
    that end, windows normalised against the cache capacity. Returns ``out``, or
    ``(out, softmax_lse)`` with ``return_softmax_lse`` (float32 (batch, nheads, seqlen_q), +inf
    for rows that see no key). ``num_splits`` only tunes the kernel and is ignored.

    Lengths stay tensors throughout (nothing is read on the host), so this traces under
    ``torch.compile(fullgraph=True)``; an int ``cache_seqlens`` is a constant of the graph.
    ``s_aux``: attention sinks, one logit per query head (:mod:`.attention_sinks`).
    """
    out, lse = kvcache_attention(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
        softmax_scale=softmax_scale,
        rule=fa2_rule,
        window_size=window_size,
        causal=causal,
        softcap=softcap,
        rotary_interleaved=rotary_interleaved,
        alibi_slopes=alibi_slopes,
        need_lse=return_softmax_lse,
        s_aux=s_aux,
    )
    if return_softmax_lse:
        assert lse is not None
        return out, lse
    return out


def kvcache_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    rotary_cos: Tensor | None,
    rotary_sin: Tensor | None,
    cache_seqlens: int | Tensor | None,
    cache_batch_idx: Tensor | None,
    cache_leftpad: Tensor | None,
    block_table: Tensor | None,
    *,
    softmax_scale: float | None,
    rule: WindowRule,
    window_size: Sequence[Any],
    causal: bool,
    softcap: float,
    rotary_interleaved: bool,
    alibi_slopes: Tensor | None,
    need_lse: bool,
    s_aux: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`flash_attn_with_kvcache`'s computation with the window ``rule`` of the family
    whose twin calls it (applied to (seqlen_q, the cache capacity), as the kernels do).
    Returns (out, lse (B, H, Sq) float32 with +inf for rows that see no key, or None)."""

    capacity = _check_kvcache_args(
        q,
        k_cache,
        v_cache,
        k,
        v,
        rotary_cos,
        rotary_sin,
        cache_seqlens,
        cache_batch_idx,
        cache_leftpad,
        block_table,
    )
    b, sq, h, d = q.shape
    check_alibi(alibi_slopes, b, h)
    scale = d**-0.5 if softmax_scale is None else float(softmax_scale)
    window = rule(window_size, causal, sq, capacity)
    # The kernel rotates q per position exactly when it runs causal or local (window set).
    q_per_position = window[0] >= 0 or window[1] >= 0
    attention_sinks.check(s_aux, h)
    # One query token on rows 0..B-1 of the cache and nothing the decode kernel does not
    # compute: the whole step in one launch, where Triton is here (triton_decode's module doc).
    if (
        sq == 1
        and rotary_cos is None
        and block_table is None
        and cache_batch_idx is None
        and cache_leftpad is None
        and alibi_slopes is None
        and softcap <= 0
        and routes.kvcache(decode=True) == "kvcache-decode"
        and not compiling()
        and not attention_sinks.needs_grad(s_aux, q, k_cache, v_cache, k, v)
    ):
        done = triton_decode.decode(
            q,
            k_cache,
            v_cache,
            k,
            v,
            cache_seqlens,
            scale=scale,
            window_left=window[0],
            need_lse=need_lse or s_aux is not None,
        )
        if done is not None:
            out, lse = done
            if s_aux is not None:
                assert lse is not None
                out, lse = attention_sinks.apply(out, lse, s_aux, packed=False)
            return out, (lse if need_lse else None)
        # not a call it takes, or not usable here (triton_decode.disabled()): torch's kernels
    new_kv_fits = k is None or (
        k.dtype is k_cache.dtype and v.dtype is v_cache.dtype and k.device == k_cache.device
    )
    route = routes.kvcache(
        flash_ok=new_kv_fits
        and not attention_sinks.needs_grad(s_aux, q, k_cache, v_cache, k, v)
        and torch_flash.can_run(
            q, k_cache, v_cache, window=torch_flash.windowed(window), seqused=True
        )
        and kernel_band(window, sq, capacity),
        contiguous=k_cache.is_contiguous() and v_cache.is_contiguous(),
        paged=block_table is not None,
        batch_idx=cache_batch_idx is not None,
        leftpad=cache_leftpad is not None,
        softcap=softcap,
        alibi=alibi_slopes is not None,
    )
    if route == "kvcache-flash":
        out, lse = _on_torch_flash(
            q,
            k_cache,
            v_cache,
            k,
            v,
            rotary_cos,
            rotary_sin,
            cache_seqlens,
            scale=scale,
            window=window,
            rotary_interleaved=rotary_interleaved,
            q_per_position=q_per_position,
            need_lse=need_lse or s_aux is not None,
        )
        if s_aux is not None:
            assert lse is not None
            out, lse = attention_sinks.apply(out, lse, s_aux, packed=False)
        return out, (lse if need_lse else None)

    dev, cdev = q.device, k_cache.device
    if cache_seqlens is None:
        seqlens = torch.full((b,), capacity, dtype=torch.long, device=dev)
    elif isinstance(cache_seqlens, Tensor):
        seqlens = cache_seqlens.to(device=dev, dtype=torch.long).expand(b)
    else:
        seqlens = torch.full((b,), int(cache_seqlens), dtype=torch.long, device=dev)
    leftpad = None if cache_leftpad is None else cache_leftpad.to(device=dev, dtype=torch.long)
    table = None if block_table is None else block_table.to(device=cdev, dtype=torch.long)
    page = k_cache.shape[1]
    rows: Tensor | None = None
    if table is None:
        if cache_batch_idx is None:
            rows = torch.arange(b, device=cdev)
        else:
            rows = cache_batch_idx.to(device=cdev, dtype=torch.long)

    def cache_index(pos: Tensor) -> tuple[Tensor, Tensor]:
        """(B, N) logical positions -> index tensors into the cache's first two dims."""
        pos = pos.to(cdev)
        if table is None:
            assert rows is not None
            return rows[:, None].expand_as(pos), pos
        return table.gather(1, torch.div(pos, page, rounding_mode="floor")), pos % page

    rotary = rotary_cos is not None and rotary_sin is not None

    def rotate(x: Tensor, pos: Tensor) -> Tensor:
        assert rotary_cos is not None and rotary_sin is not None
        return rotate_at(x, pos, rotary_cos, rotary_sin, rotary_interleaved)

    seqlen_new = 0
    if k is not None and v is not None:
        seqlen_new = k.shape[1]
        pos_new = seqlens[:, None] + torch.arange(seqlen_new, device=dev)
        if rotary:
            k = rotate(k, pos_new)
        idx = cache_index(pos_new)
        k_cache.index_put_(idx, k.to(device=cdev, dtype=k_cache.dtype))
        v_cache.index_put_(idx, v.to(device=cdev, dtype=v_cache.dtype))
    if rotary:
        # Causal/local: query i sits at cache_seqlens + i; otherwise all at cache_seqlens.
        steps = torch.arange(sq, device=dev) * int(q_per_position)
        q = rotate(q, seqlens[:, None] + steps)

    # Each sequence's keys from its leftpad on, as the kernel reads them: key j of the gathered
    # batch is cache position leftpad + j, and len_k = end - leftpad keys are real. The masks of
    # flash_core's padded-batch path then align causal/window/ALiBi to that end.
    end = seqlens + seqlen_new
    len_k = end if leftpad is None else end - leftpad
    # Keys past the longest sequence are masked anyway. Eager calls gather only up to it (one
    # host read, as the eager varlen path makes): a decode step on a large, mostly empty cache
    # then costs what its lengths cost. Under compile shapes must not depend on data, so the
    # graph keeps the full capacity.
    span = capacity
    if not compiling() and b > 0:
        span = max(0, min(capacity, int(len_k.max())))
    if leftpad is None and table is None and cache_batch_idx is None:
        kb, vb = k_cache[:b, :span], v_cache[:b, :span]
    else:
        src = torch.arange(span, device=dev).expand(b, span)
        if leftpad is not None:
            src = (leftpad[:, None] + src).clamp(max=capacity - 1)
        idx = cache_index(src)
        kb, vb = k_cache[idx], v_cache[idx]
    len_q = torch.full((b,), sq, dtype=torch.long, device=dev)
    out, lse = flash_core(
        q,
        kb.to(dev),
        vb.to(dev),
        dropout_p=0.0,
        softmax_scale=scale,
        window=window,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        need_lse=need_lse,
        lens=(len_q, len_k),
        sinks=s_aux,
    )
    return out, lse


_POSITIONS: dict[tuple[torch.device, int, int, int], Tensor] = {}


def _row_starts(b: int, capacity: int, n: int, device: torch.device) -> Tensor:
    """int64 (b * n,): ``row * capacity + t``, the flat cache index of new token t of row
    ``row`` at length 0, rows one after the other (made once per shape and device; decode steps
    reuse it)."""
    key = (device, b, capacity, n)
    found = _POSITIONS.get(key)
    if found is None:
        if len(_POSITIONS) > 256:
            _POSITIONS.clear()
        rows = torch.arange(b, device=device, dtype=torch.long)[:, None] * capacity
        found = _POSITIONS[key] = (rows + torch.arange(n, device=device, dtype=torch.long)).view(-1)
    return found


def _on_torch_flash(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    rotary_cos: Tensor | None,
    rotary_sin: Tensor | None,
    cache_seqlens: int | Tensor | None,
    *,
    scale: float,
    window: tuple[int, int],
    rotary_interleaved: bool,
    q_per_position: bool,
    need_lse: bool,
) -> tuple[Tensor, Tensor | None]:
    """The route ``kvcache-flash``: contiguous caches, rows 0..b-1 of the cache.

    New keys/values are written in place (one ``index_copy_`` each into the flattened cache),
    then torch's flash kernel reads each row of the cache as one packed sequence of
    ``capacity`` slots of which the first ``cache_seqlens + seqlen_new`` are real
    (``seqused_k``): the kernel's own causal/window alignment to that end, no host read, no
    gathered copy of the cache. Returns (out (b, sq, h, dv), lse (b, h, sq) if ``need_lse``).

    A decode step is bound by the host here (each torch op costs microseconds of Python and
    dispatch, the kernels take less): beside the attention kernel it launches four small ones
    (the flat index of the new tokens, two appends, the lengths the kernel reads) and creates
    as few views as the kernel's layout needs. torch ships no kernel that appends and attends
    in one launch (flash-attn's ``mha_fwd_kvcache`` is not among aten's ops).
    """
    b, sq, h, d = q.shape
    capacity, hk, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    dev = q.device
    seqlens = cache_seqlens
    if isinstance(seqlens, Tensor) and (
        seqlens.dtype is not torch.int32 or seqlens.device != dev or seqlens.dim() != 1
    ):
        seqlens = seqlens.to(device=dev, dtype=torch.int32).expand(b)
    k_flat = k_cache.view(-1, hk, d)
    v_flat = v_cache.view(-1, hk, dv)
    rotary = rotary_cos is not None and rotary_sin is not None
    n = 0
    if k is not None and v is not None:
        n = k.shape[1]
        starts = _row_starts(b, capacity, n, dev)
        if isinstance(seqlens, Tensor):
            lengths: Tensor | int = seqlens if n == 1 else seqlens.repeat_interleave(n)
        else:
            lengths = int(seqlens or 0)
        flat = starts + lengths
        if rotary:
            assert rotary_cos is not None and rotary_sin is not None
            # new token t of a row sits at cache_seqlens + t
            pos = torch.arange(n, device=dev).expand(b, n) + (
                lengths.view(b, n) if isinstance(lengths, Tensor) else lengths
            )
            k = rotate_at(k, pos, rotary_cos, rotary_sin, rotary_interleaved)
        k_flat.index_copy_(0, flat, k.reshape(b * n, hk, d))
        v_flat.index_copy_(0, flat, v.reshape(b * n, hk, dv))
    if rotary:
        assert rotary_cos is not None and rotary_sin is not None
        # Causal/local: query i sits at cache_seqlens + i; otherwise all at cache_seqlens.
        steps = torch.arange(sq, device=dev).expand(b, sq) * int(q_per_position)
        at = seqlens.view(b, 1) if isinstance(seqlens, Tensor) else int(seqlens or 0)
        q = rotate_at(q, steps + at, rotary_cos, rotary_sin, rotary_interleaved)
    used: Tensor | None = None
    if isinstance(seqlens, Tensor):
        used = seqlens + n
    elif seqlens is not None:
        used = torch.full((b,), int(seqlens) + n, dtype=torch.int32, device=dev)
    out, lse = torch_flash.attention(
        q.reshape(b * sq, h, d),
        k_flat,
        v_flat,
        torch_flash.strided_cu(b, sq, dev),
        torch_flash.strided_cu(b, capacity, dev),
        sq,
        capacity,
        dropout_p=0.0,
        scale=scale,
        window=window,
        seqused_k=used,
    )
    if not need_lse:
        return out.view(b, sq, h, dv), None
    return out.view(b, sq, h, dv), lse.view(h, b, sq).transpose(0, 1)
