"""A STAND-IN hub kernel (attnguard tests only): a kernel repository in the `kernels` package's
layout, written where a test wants it and served without network through ``LOCAL_KERNELS``.

``write_repo(path, ...)`` writes ``path/build/torch-<backend>/`` (a "noarch" build variant:
by default the backend the `kernels` package sees on this machine, ``torch-cuda`` wherever torch
is a CUDA build, a GPU or not, else ``torch-cpu``) holding ``metadata.json`` and a Python
package with flash-attn's functions (``flash_attn_func``, ``flash_attn_varlen_func``,
``flash_attn_with_kvcache``; or flash-attn 3's ``flash_attn_func`` / ``flash_attn_varlen_func``,
with their keyword arguments) and a ``flash_attn_interface`` module naming the functions
diffusers' context-parallel code looks up (they raise NotImplementedError). They compute flash-attn's semantics in explicit float32 math
(bottom-right causal alignment, sliding windows, softcap, grouped heads, packed sequences,
attention sinks when the repo declares ``s_aux``) and never import attnguard. Each call appends
one line (the function's name) to the file named by ``$HUB_STANDIN_CALLS``, so a test counts
the calls the program made into the hub kernel.

``LOCAL_KERNELS="kernels-community/flash-attn2=<path>"`` makes ``kernels.get_kernel`` load it
before looking at the hub or its cache (transformers then says "using
`kernels-community/flash-attn2` from the `kernels` library").
"""

from __future__ import annotations

import json
from pathlib import Path

_KERNEL_SOURCE = '''"""STAND-IN hub kernel written by attnguard's tests (tests/standins/hub_kernel.py)."""
import math
import os

import torch

IS_ATTNGUARD_STANDIN = True


def _count(name):
    path = os.environ.get("HUB_STANDIN_CALLS")
    if path:
        with open(path, "a") as f:
            f.write(name + "\\n")


def _attend(q, k, v, scale, causal, window, softcap, sink, lse=False):
    # q (Sq, H, D), k/v (Sk, Hk, D) -> (Sq, H, D) [, LSE (H, Sq)]; flash-attn's masks,
    # bottom-right aligned
    sq, h, d = q.shape
    sk, hk = k.shape[0], k.shape[1]
    if hk != h:
        k = k.repeat_interleave(h // hk, dim=1)
        v = v.repeat_interleave(h // hk, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=q.device)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    left, right = window
    if causal:
        right = 0
    if left >= 0:
        keep &= j >= i - left
    if right >= 0:
        keep &= j <= i + right
    s = s.masked_fill(~keep, float("-inf"))
    if sink is not None:
        logits = torch.cat([s, sink.float().view(h, 1, 1).expand(h, sq, 1)], dim=-1)
        p = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    out = torch.einsum("hqk,khd->qhd", p, v.float()).to(q.dtype)
    return (out, torch.logsumexp(s, dim=-1)) if lse else out

'''

_FA2_SOURCE = """

def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                    return_attn_probs=False__SINK_PARAM__):
    _count("flash_attn_func")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    outs = [_attend(q[b], k[b], v[b], scale, causal, tuple(window_size), softcap,
                    __SINK_ARG__) for b in range(q.shape[0])]
    return torch.stack(outs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           softcap=0.0, alibi_slopes=None, deterministic=False,
                           return_attn_probs=False, block_table=None__SINK_PARAM__):
    _count("flash_attn_varlen_func")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for n in range(len(cq) - 1):
        a, b, c, e = cq[n], cq[n + 1], ck[n], ck[n + 1]
        if b > a:
            out[a:b] = _attend(q[a:b], k[c:e], v[c:e], scale, causal, tuple(window_size),
                               softcap, __SINK_ARG__)
    return out


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False__SINK_PARAM__):
    _count("flash_attn_with_kvcache")
    raise NotImplementedError("hub kernel stand-in: flash_attn_with_kvcache is not implemented")
"""

_FA3_SOURCE = """

def flash_attn_func(q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None,
                    k_descale=None, v_descale=None, window_size=(-1, -1), attention_chunk=0,
                    softcap=0.0, num_splits=1, pack_gqa=None, deterministic=False, sm_margin=0,
                    return_attn_probs=False):
    _count("flash_attn_func")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    parts = [_attend(q[b], k[b], v[b], scale, causal, tuple(window_size), softcap, None, True)
             for b in range(q.shape[0])]
    out = torch.stack([o for o, _ in parts])
    return (out, torch.stack([s for _, s in parts])) if return_attn_probs else out


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                           qv=None, q_descale=None, k_descale=None, v_descale=None,
                           window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                           pack_gqa=None, deterministic=False, sm_margin=0,
                           return_attn_probs=False):
    _count("flash_attn_varlen_func")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for n in range(len(cq) - 1):
        a, b, c, e = cq[n], cq[n + 1], ck[n], ck[n + 1]
        if b > a:
            out[a:b], lse[:, a:b] = _attend(q[a:b], k[c:e], v[c:e], scale, causal,
                                            tuple(window_size), softcap, None, True)
    return (out, lse) if return_attn_probs else out
"""

# A hub kernel that ships its own attention function (transformers registers ``flash_attn_forward``
# under the request's name, with sdpa's 4-D masks): here local attention, each query seeing the
# ``OWN_WINDOW`` keys up to itself, whatever mask it is also given. Its semantics are its own.
_OWN_SOURCE = """

OWN_WINDOW = 3
supports_flash_attn = True


def flash_attn_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                       **kwargs):
    _count("flash_attn_forward")
    b, h, sq, d = query.shape
    hk, sk = key.shape[1], key.shape[2]
    if hk != h:
        key = key.repeat_interleave(h // hk, dim=1)
        value = value.repeat_interleave(h // hk, dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(d)
    s = torch.einsum("bhqd,bhkd->bhqk", query.float(), key.float()) * scale
    i = torch.arange(sq, device=query.device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=query.device)[None, :]
    keep = (j <= i) & (j > i - OWN_WINDOW)
    if attention_mask is not None:
        keep = keep & (attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(torch.softmax(s, dim=-1), nan=0.0)
    out = torch.einsum("bhqk,bhkd->bhqd", p, value.float()).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None
"""

# what diffusers' context-parallel code reaches through ``flash_attn_interface`` (not computed)
_INTERFACE_SOURCE = """from . import _count


def _unsupported(name):
    def function(*args, **kwargs):
        _count(name)
        raise NotImplementedError(f"hub kernel stand-in: {name} is not implemented")

    return function


for _name in __NAMES__:
    globals()[_name] = _unsupported(_name)
"""
_INTERFACE_NAMES = {
    "fa2": (
        "_flash_attn_forward",
        "_flash_attn_backward",
        "_flash_attn_varlen_forward",
        "_flash_attn_varlen_backward",
    ),
    "fa3": ("_flash_attn_forward", "_flash_attn_backward"),
}


def system_backend() -> str:
    """The build variant's backend the `kernels` package selects here: ``cuda`` for a CUDA build
    of torch (with or without a GPU: kernels reads ``torch.version.cuda``), else ``cpu``."""
    import torch

    return "cuda" if torch.version.cuda is not None else "cpu"


def other_backend() -> str:
    """A backend the `kernels` package does not select here: a build with no variant for this
    system."""
    return "cpu" if system_backend() == "cuda" else "cuda"


def write_repo(
    path: Path,
    *,
    name: str = "flash-attn2",
    backend: str | None = None,
    version: int = 3,
    sinks: bool = False,
    broken: bool = False,
    interface: str = "fa2",
) -> Path:
    """Write a stand-in hub kernel repository at ``path`` and return ``path``.

    ``name``: the repo's name (its package is ``name`` with ``-`` as ``_``); ``backend``: the
    build variant (``cpu``: ``torch-cpu``, ``cuda``: ``torch-cuda``; None: ``system_backend()``);
    ``sinks``: the functions take ``s_aux`` (as vllm-flash-attn3); ``broken``: the package raises
    at import (a build whose import fails); ``interface``: ``"fa2"`` (flash-attn 2's functions) or
    ``"fa3"`` (flash-attn 3's: the keyword arguments of kernels-community/flash-attn3, which
    diffusers' ``_flash_3_hub`` backends pass) or ``"own"`` (no flash-attn function: an attention
    function of its own, ``flash_attn_forward`` with ``supports_flash_attn``, computing local
    attention). Each has a ``flash_attn_interface`` module with the functions diffusers'
    context-parallel code resolves (they raise NotImplementedError)."""
    package = name.replace("-", "_")
    backend = backend or system_backend()
    variant = path / "build" / f"torch-{backend}"
    (variant / package).mkdir(parents=True, exist_ok=True)
    metadata = {
        "name": name,
        "id": f"_{package}_attnguard_standin",
        "version": version,
        "license": "Apache-2.0",
        "python-depends": [],
        "backend": {"type": backend},
    }
    (variant / "metadata.json").write_text(json.dumps(metadata))
    functions = {"fa3": _FA3_SOURCE, "own": _OWN_SOURCE}.get(interface, _FA2_SOURCE)
    source = _KERNEL_SOURCE + functions + "\n\nfrom . import flash_attn_interface  # noqa: E402\n"
    source = source.replace("__SINK_PARAM__", ", s_aux=None" if sinks else "")
    source = source.replace("__SINK_ARG__", "s_aux" if sinks else "None")
    if broken:
        source = 'raise ImportError("hub kernel stand-in: this build does not import")\n' + source
    (variant / package / "__init__.py").write_text(source)
    names = repr(_INTERFACE_NAMES.get(interface, ()))
    (variant / package / "flash_attn_interface.py").write_text(
        _INTERFACE_SOURCE.replace("__NAMES__", names)
    )
    return path
