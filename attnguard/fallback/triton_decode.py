"""A decode step of ``flash_attn_with_kvcache`` in one Triton kernel: the new key/value appended
to the cache and one query token attending to it, split over the cache (flash-decoding).

Why a kernel of our own: a decode step is a few microseconds of GPU work, so its cost is the
host's. flash-attn appends and attends in one C++ call; torch has no such op, and computing the
step from torch ops (the appends, the lengths, torch's flash kernel) costs four to five launches
from Python, two to four times flash-attn's host time per call. This kernel is one launch (two
when the cache is split: the partial results are combined by a second, small one), launched
directly once compiled. It also spreads a long cache over the whole GPU (one program per cache
split, kv head and sequence, the query heads of a kv head together), where torch's varlen flash
kernel gives one program per query head.

What it computes is flash-attn's: the new key/value written at ``cache_seqlens[b]`` of row ``b``
(when given), then query ``b`` attends to keys ``[start, cache_seqlens[b] + new)`` with ``start``
from a left window; softmax in float32 with the probabilities rounded to the input dtype for the
value product, as flash-attn's kernel rounds them; the output in the input dtype; the LSE in
float32, ``+inf`` for a row that sees no key.

It takes only the common decode call (:func:`eligible`): one query token, at most one new token,
contiguous rows 0..B-1 of a cache (no pages, batch index, left padding, rotary, softcap, ALiBi),
fp16/bf16 on a CUDA GPU, head_dim <= 256 and a multiple of 8, strides in multiples of 8 elements.
Every other call takes the routes of :mod:`attnguard.fallback.routes`. It is used only where
``triton`` imports (never imported before the first such call) and never inside a torch.compile
trace; a kernel that fails to compile or launch is not tried again in the process, and that call
and every later one take the torch route (:func:`disabled`).
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch

Tensor = torch.Tensor

_HALF = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
BLOCK_N = 64  # keys per step of a program
# a second launch (the combine) costs the host more than a short cache costs one program: no
# split shorter than this (measured on an H100: a 1k cache is faster unsplit, an 8k one split)
_MIN_KEYS_PER_SPLIT = 1024
_MAX_SPLITS = 64

_state: dict[str, Any] = {"kernels": None, "why_not": None}
_lock = threading.Lock()
# (device index, dtype, flags and constexprs) -> a compiled kernel, launched without Triton's
# per-call argument binding (its specialisation key is ours: see _launch)
_compiled: dict[tuple[Any, ...], Any] = {}
_sms: dict[int, int] = {}


def disabled() -> str | None:
    """Why this process does not use the kernel (None: it does, or has not tried yet)."""
    return _state["why_not"]


def _disable(why: str) -> None:
    _state["why_not"] = why
    _state["kernels"] = None


def _kernels() -> Any:
    """(decode kernel, combine kernel, triton module), built at the first call; None where
    Triton is unusable here."""
    k = _state["kernels"]
    if k is not None or _state["why_not"] is not None:
        return k
    with _lock:
        if _state["kernels"] is None and _state["why_not"] is None:
            try:
                _state["kernels"] = _build()
            except Exception as exc:  # no triton, an old one, ...
                _disable(f"triton unusable: {type(exc).__name__}: {str(exc)[:200]}")
    return _state["kernels"]


_NO_STRIDES = (0, 0, 0, 1)


def decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    k: Tensor | None,
    v: Tensor | None,
    cache_seqlens: int | Tensor | None,
    *,
    scale: float,
    window_left: int,
    need_lse: bool,
) -> tuple[Tensor, Tensor | None] | None:
    """The call on the kernel: (out (B, 1, H, D), lse (B, H, 1) float32 if ``need_lse``), or
    None, with nothing written, where the kernel cannot take it (the caller has excluded pages,
    batch index, left padding, rotary, softcap and ALiBi; the rest is checked here from
    metadata, no tensor value read) or cannot run here (:func:`disabled`).
    ``window_left``: flash-attn's normalised left window, -1 for none.

    Every attribute is read once: on a GPU server's host a tensor attribute read costs a few
    hundred nanoseconds, and this runs once per layer and token."""
    if not q.is_cuda:
        return None
    kernels = _state["kernels"]
    if kernels is None:
        kernels = _kernels()
        if kernels is None:
            return None
    b, sq_len, h, d = q.shape
    kb, capacity, hk, kd = k_cache.shape
    dt = q.dtype
    if sq_len != 1 or d > MAX_HEAD_DIM or d & 7 or kd != d or v_cache.shape[3] != d:
        return None
    if hk == 0 or h % hk or k_cache.dtype is not dt or v_cache.dtype is not dt:
        return None
    dev = q.get_device()
    if dev != _current_device() or k_cache.get_device() != dev or v_cache.get_device() != dev:
        return None
    sq, sk, sv = q.stride(), k_cache.stride(), v_cache.stride()
    if k is not None:
        assert v is not None
        if k.shape[1] != 1 or k.dtype is not dt or v.dtype is not dt:
            return None
        if k.get_device() != dev or v.get_device() != dev:
            return None
        sn, snv = k.stride(), v.stride()
        kp, vp = k.data_ptr(), v.data_ptr()
    else:
        sn = snv = _NO_STRIDES
        kp = vp = 0
    seq_tensor = isinstance(cache_seqlens, Tensor)
    if seq_tensor:
        assert isinstance(cache_seqlens, Tensor)
        if cache_seqlens.dtype is not torch.int32 or cache_seqlens.get_device() != dev:
            return None
        seq_stride = cache_seqlens.stride(0) if cache_seqlens.dim() else 0
        seq_const, seqp = 0, cache_seqlens.data_ptr()
    else:
        seq_stride, seqp = 0, 0
        seq_const = capacity if cache_seqlens is None else int(cache_seqlens)
    strides = (sq[0], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sn[0], sn[2])
    strides += (snv[0], snv[2])
    last = sq[3] | sk[3] | sv[3] | sn[3] | snv[3]
    if last != 1 or (sq[0] | sq[2] | sk[0] | sk[1] | sk[2] | sv[0] | sv[1] | sv[2]) & 7:
        return None  # rows are read as 16-byte vectors: unit last stride, others multiples of 8
    if (sn[0] | sn[2] | snv[0] | snv[2]) & 7:
        return None
    layout = _layouts.get((b, hk, capacity, dev))
    if layout is None:
        layout = _layout(b, hk, capacity, dev)
    splits, split_len = layout
    g = h // hk
    out = torch.empty((b, 1, h, d), dtype=dt, device=q.device)
    lse = torch.empty((b, h, 1), dtype=torch.float32, device=q.device) if need_lse else out
    part = out
    if splits > 1:
        part = torch.empty((b * h * splits * (d + 1),), dtype=torch.float32, device=q.device)
    tensors = (q, k_cache, v_cache, k if k is not None else q, v if v is not None else q)
    tensors += (cache_seqlens if seq_tensor else q, part, out, lse)  # type: ignore[assignment]
    ptrs = (q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), kp, vp, seqp)
    ptrs += (part.data_ptr(), out.data_ptr(), lse.data_ptr())
    lse_offset = b * h * splits * d
    ints = (seq_const, seq_stride, scale * _LOG2E, window_left, split_len, capacity, hk)
    ints += (*(x >> 3 for x in strides), lse_offset)
    single = splits == 1
    consts = (g, max(16, 1 << (g - 1).bit_length()), d, max(16, 1 << (d - 1).bit_length()))
    consts += (BLOCK_N, k is not None, seq_tensor, single, need_lse)
    aligned = not (ptrs[0] | ptrs[1] | ptrs[2] | kp | vp | seqp | ptrs[6] | ptrs[7] | ptrs[8]) & 15
    key = (0, dev, dt, aligned, *consts)
    grid = (splits, b * hk, 1)
    if not _launch(kernels[0], key, grid, tensors, ptrs, ints, consts, dev):
        return None
    if not single:
        block_s = max(2, 1 << (splits - 1).bit_length())
        consts = (d, consts[3], block_s, need_lse)
        key = (1, dev, dt, aligned, *consts)
        grid = (b * h, 1, 1)
        ints = (splits, lse_offset)
        if not _launch(kernels[1], key, grid, (part, out, lse), ptrs[6:], ints, consts, dev):
            # the first kernel has appended: the caller's route appends the same values again
            return None
    return out, (lse if need_lse else None)


_LOG2E = 1.0 / math.log(2.0)
_layouts: dict[tuple[int, int, int, int], tuple[int, int]] = {}


def _current_device() -> int:
    return torch._C._cuda_getDevice()


def _layout(b: int, hk: int, capacity: int, device: int) -> tuple[int, int]:
    """(splits, keys per split) of a cache: enough programs to fill the GPU (about two per SM),
    no split shorter than 1024 keys; splits a multiple of the kernel's step."""
    sms = _sms.get(device)
    if sms is None:
        sms = _sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
    programs = b * hk
    if programs * 5 >= sms * 4:
        splits = 1
    else:
        want = -(-2 * sms // programs)
        splits = max(1, min(want, capacity // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))
    split_len = -(-capacity // splits)
    split_len = max(BLOCK_N, -(-split_len // BLOCK_N) * BLOCK_N)
    splits = max(1, -(-capacity // split_len))
    if len(_layouts) > 1024:
        _layouts.clear()
    _layouts[(b, hk, capacity, device)] = (splits, split_len)
    return splits, split_len


def _launch(
    kernel: Any,
    key: tuple[Any, ...],
    grid: tuple[int, int, int],
    tensors: tuple[Tensor, ...],
    ptrs: tuple[int, ...],
    ints: tuple[Any, ...],
    consts: tuple[Any, ...],
    dev: int,
) -> bool:
    """Launch ``kernel``: the first time per specialisation through Triton's own entry (which
    compiles it), later directly through its compiled launcher with the pointers as integers
    (Triton's entry binds and checks every argument in Python at each call: tens of
    microseconds per launch on a GPU server's host). ``key`` names what Triton specialises this
    kernel on: the dtype, whether every pointer is 16-byte aligned (its ints are annotated
    int64 and never specialised), the constexprs, the device. Returns False where the kernel is
    not built yet and a CUDA graph is being captured (building it there would break the
    capture), and (the kernel off for this process) where the first launch fails: a kernel
    that does not build or load here. A later launch's error (the GPU's state, out of memory)
    is the caller's, raised as torch would raise it."""
    found = _compiled.get(key)
    if found is not None:
        launch, function, meta, coop, pdl = found
        stream = torch._C._cuda_getCurrentRawStream(dev)
        launch(grid[0], grid[1], grid[2], stream, function, coop, pdl, None, None, meta,
               None, None, None, *ptrs, *ints, *consts)  # fmt: skip
        return True
    if torch.cuda.is_current_stream_capturing():
        return False  # no compiling or loading inside a CUDA graph capture: torch's route
    names = kernel.arg_names[len(tensors) + len(ints) :]
    try:
        compiled = kernel[grid](
            *tensors, *ints, **dict(zip(names, consts, strict=True)), num_warps=4, num_stages=2
        )
        if hasattr(compiled, "result"):
            compiled = compiled.result()
    except Exception as exc:
        if key in _tried:
            raise
        _disable(f"{type(exc).__name__}: {str(exc)[:300]}")
        return False
    _tried.add(key)
    # Triton specialises each pointer on its alignment; the key says only "all aligned", so only
    # those kernels are launched directly (an unaligned call binds through Triton each time)
    direct = _direct_launch(compiled) if key[3] else None
    if direct is not None and len(_compiled) < 512:
        _compiled[key] = direct
    return True


def _direct_launch(compiled: Any) -> tuple[Any, ...] | None:
    """(launch function, kernel, metadata, cooperative, pdl) to launch a compiled kernel the way
    Triton's launcher does, minus its Python: only where the launcher would add nothing (no
    scratch memory, no tensor descriptors, no launch hooks) and the shapes are the ones this
    module knows (the Triton releases in _DIRECT_LAUNCH_RELEASES); None otherwise (Triton's own entry at every call)."""
    try:
        if (
            _state.get("triton_release") not in _DIRECT_LAUNCH_RELEASES
            or _knobs_hooks() is not None
        ):
            return None
        launcher = compiled.run
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        launch = launcher.launch
        if getattr(launch, "__name__", "") != "launch":  # wrapped for tensor descriptors
            return None
        meta = compiled.packed_metadata
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        return launch, compiled.function, meta, coop, pdl
    except Exception:
        return None


# Triton releases whose compiled launcher's argument order the direct launch was checked against
# (its C launcher takes positional arguments: another order would not fail cleanly)
_DIRECT_LAUNCH_RELEASES = ((3, 6),)
_tried: set[tuple[Any, ...]] = set()  # launched through Triton's entry at least once


def _knobs_hooks() -> Any:
    """Triton's launch hooks (profilers set them): with one set, every launch goes through
    Triton's own entry, which calls them. Triton 3.6 keeps them as chains (empty: none set),
    earlier releases as a callable or None."""
    knobs = _state.get("knobs")
    if knobs is None:
        return None
    rt = knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return rt
    return None


def _build() -> tuple[Any, Any, Any]:
    import triton
    import triton.language as tl
    from triton import knobs

    _state["knobs"] = knobs
    _state["triton_release"] = tuple(int(p) for p in triton.__version__.split(".")[:2])
    ints = [
        "seq_const", "seq_stride", "scale_log2", "window_left", "split_len", "capacity",
        "hk_heads", "sqb", "sqh", "skb", "sks", "skh", "svb", "svs", "svh", "snkb", "snkh",
        "snvb", "snvh", "lse_offset",
    ]  # fmt: skip

    @triton.jit(do_not_specialize=ints)
    def decode_kernel(
        Q, KC, VC, KN, VN, SEQ, PART, OUT, LSE,
        seq_const: tl.int64, seq_stride: tl.int64, scale_log2: tl.float32, window_left: tl.int64,
        split_len: tl.int64, capacity: tl.int64, hk_heads: tl.int64,
        sqb: tl.int64, sqh: tl.int64, skb: tl.int64, sks: tl.int64, skh: tl.int64,
        svb: tl.int64, svs: tl.int64, svh: tl.int64, snkb: tl.int64, snkh: tl.int64, snvb: tl.int64, snvh: tl.int64,
        lse_offset: tl.int64,
        G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK: tl.constexpr, NEW: tl.constexpr, SEQ_TENSOR: tl.constexpr, SINGLE: tl.constexpr,
        NEED_LSE: tl.constexpr,
    ):  # fmt: skip
        split = tl.program_id(0)
        splits = tl.num_programs(0)
        bh = tl.program_id(1)
        b = bh // hk_heads
        kh = bh % hk_heads
        cached = tl.load(SEQ + b * seq_stride).to(tl.int64) if SEQ_TENSOR else seq_const
        cached = tl.maximum(cached, 0)
        stored = tl.minimum(cached, capacity)  # keys readable from the cache
        end = cached + NEW  # keys of this sequence, the new one included
        start = tl.where(window_left >= 0, tl.maximum(end - 1 - window_left, 0), 0)
        lo = tl.maximum(split * split_len, start)
        hi = tl.minimum(split * split_len + split_len, stored)
        g = tl.arange(0, BLOCK_G)
        dd = tl.arange(0, BLOCK_D)
        gm = g < G
        dm = dd < D
        heads = kh * G + g
        # strides arrive divided by 8: "x * 8" tells the compiler rows are 16-byte aligned
        q = tl.load(
            Q + b * (sqb * 8) + heads[:, None] * (sqh * 8) + dd[None, :],
            mask=gm[:, None] & dm[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        k_row = KC + b * (skb * 8) + kh * (skh * 8)
        v_row = VC + b * (svb * 8) + kh * (svh * 8)
        for n0 in range(lo, hi, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            nm = n < hi
            kt = tl.load(
                k_row + n[:, None] * (sks * 8) + dd[None, :],
                mask=nm[:, None] & dm[None, :],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(kt)) * scale_log2
            s = tl.where(nm[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(
                v_row + n[:, None] * (svs * 8) + dd[None, :],
                mask=nm[:, None] & dm[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        if NEW:
            # the new token: the last split scores it from k/v and writes it to the cache (no
            # program reads position `cached` of the cache, so no program races the write)
            last = split == splits - 1
            kn = tl.load(KN + b * (snkb * 8) + kh * (snkh * 8) + dd, mask=dm, other=0.0)
            vn = tl.load(VN + b * (snvb * 8) + kh * (snvh * 8) + dd, mask=dm, other=0.0)
            s_new = tl.sum(q.to(tl.float32) * kn.to(tl.float32)[None, :], 1) * scale_log2
            s_new = tl.where(last, s_new, float("-inf"))
            m_new = tl.maximum(m_i, s_new)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p_new = tl.exp2(s_new - m_safe)
            l_i = l_i * alpha + p_new
            p_half = p_new.to(vn.dtype).to(tl.float32)
            acc = acc * alpha[:, None] + p_half[:, None] * vn.to(tl.float32)[None, :]
            m_i = m_new
            fits = dm & last & (cached < capacity)
            tl.store(KC + b * (skb * 8) + cached * (sks * 8) + kh * (skh * 8) + dd, kn, mask=fits)
            tl.store(VC + b * (svb * 8) + cached * (svs * 8) + kh * (svh * 8) + dd, vn, mask=fits)
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        o = acc / l_safe[:, None]
        row = b * (hk_heads * G) + heads  # (sequence, query head) of each row
        if SINGLE:
            tl.store(
                OUT + row[:, None] * D + dd[None, :],
                o.to(OUT.dtype.element_ty),
                mask=gm[:, None] & dm[None, :],
            )
            if NEED_LSE:
                lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("inf"))
                tl.store(LSE + row, lse, mask=gm)
        else:
            at = row * splits + split
            tl.store(PART + at[:, None] * D + dd[None, :], o, mask=gm[:, None] & dm[None, :])
            lse2 = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(PART + lse_offset + at, lse2, mask=gm)

    @triton.jit(do_not_specialize=["splits", "lse_offset"])
    def combine_kernel(
        PART, OUT, LSE, splits: tl.int64, lse_offset: tl.int64,
        D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, NEED_LSE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        s = tl.arange(0, BLOCK_S)
        dd = tl.arange(0, BLOCK_D)
        sm = s < splits
        dm = dd < D
        lse2 = tl.load(PART + lse_offset + row * splits + s, mask=sm, other=float("-inf"))
        m = tl.max(lse2, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp2(lse2 - m_safe)
        total = tl.sum(w, 0)
        o = tl.load(
            PART + (row * splits + s)[:, None] * D + dd[None, :],
            mask=sm[:, None] & dm[None, :],
            other=0.0,
        )
        seen = total > 0.0
        out = tl.sum(o * w[:, None], 0) / tl.where(seen, total, 1.0)
        tl.store(OUT + row * D + dd, out.to(OUT.dtype.element_ty), mask=dm)
        if NEED_LSE:
            lse = tl.where(seen, (m_safe + tl.log2(total)) * 0.6931471805599453, float("inf"))
            tl.store(LSE + row, lse)

    return decode_kernel, combine_kernel, triton
