"""What a flash-attention call is, for the opt-in selection: its bucket, and the candidates that
may compute it (pure: no tensor value read but a packed call's longest lengths, no side effect;
it runs inside torch.compile traces).

* :func:`describe_call`: everything the selection knows of a call, in one pass (a
  :class:`Call`): its signature (read by :func:`attnguard.selection.served.served`), its bucket
  or why the switch leaves it alone, its facts and its candidates.
* :func:`bucket`: the call's *bucket* — the decision's key: the entry point, dtype, head dims,
  features (causal, window, LSE, gradients) and the shapes rounded up to powers of two. Calls
  the switch never touches get a reason instead (dropout, ``deterministic=True``, ALiBi,
  softcap, a paged or indexed KV cache, ...): their numbers could not be compared, or no other
  kernel computes them.
* :data:`CANDIDATES`: which kernels may serve a call of each kind, and when; :func:`candidates`:
  the ones for one described call.
* :data:`TOLERANCE`: how close a candidate's numbers must be to the requested kernel's.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

REQUESTED = "requested"
NOT_CUDA = "not a CUDA flash-attention call"
# max |candidate - requested| / max |requested|, outputs and gradients (the dtype's rounding:
# bf16 keeps 8 bits, fp16 11; accumulated over a softmax row in a different order)
TOLERANCE = {"bfloat16": 2e-2, "float16": 5e-3}
SELECTED_ENTRIES = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")


@dataclass(frozen=True)
class Candidate:
    name: str
    entries: tuple[str, ...]
    when: str
    what: str


CANDIDATES: tuple[Candidate, ...] = (
    Candidate(
        REQUESTED,
        SELECTED_ENTRIES,
        "always",
        "the kernel the caller asked for (flash-attn); the reference every other is compared to",
    ),
    Candidate(
        "sdpa",
        ("flash_attn_func",),
        "always",
        "attnguard's twin: torch SDPA with the dispatcher's own choice (cuDNN on Hopper), or "
        "torch's flash kernel for windows / bottom-right causality (attnguard.fallback.routes)",
    ),
    Candidate(
        "sdpa_cudnn",
        ("flash_attn_func",),
        "full attention or causal with Sq == Sk, no window",
        "torch SDPA with only the cuDNN backend allowed",
    ),
    Candidate(
        "sdpa_flash",
        ("flash_attn_func",),
        "full attention or causal with Sq == Sk, no window",
        "torch SDPA with only its flash backend allowed",
    ),
    Candidate(
        "sdpa_efficient",
        ("flash_attn_func",),
        "full attention or causal with Sq == Sk, no window",
        "torch SDPA with only the memory-efficient backend allowed",
    ),
    Candidate(
        "torch_flash",
        SELECTED_ENTRIES,
        "torch's flash kernel can run the call",
        "torch's own FlashAttention-2 (packed rows and KV caches natively)",
    ),
)
_BY_NAME = {c.name: c for c in CANDIDATES}
SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_flash": "FLASH_ATTENTION"}
SDPA_BACKENDS["sdpa_efficient"] = "EFFICIENT_ATTENTION"


def _pow2(n: int) -> int:
    """n rounded up to a power of two (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def _grad_enabled() -> bool:
    """Whether autograd records (a call under no_grad / inference_mode runs no backward: its
    gradients are neither raced nor compared)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.is_grad_enabled()


def _max_len(value: Any) -> int | None:
    """max_seqlen as an int. transformers' packed-row path passes a 0-d tensor; flash-attn's
    own wrapper reads it on the host anyway, so an eager call may too; a trace may not."""
    if isinstance(value, int):
        return value
    if hasattr(value, "item") and getattr(value, "numel", lambda: 0)() == 1:
        torch = sys.modules.get("torch")
        compiling = torch is not None and torch.compiler.is_compiling()
        return None if compiling else int(value.item())
    return None


_DTYPE_NAMES: dict[Any, str] = {}


def _dtype(t: Any) -> str:
    dt = getattr(t, "dtype", "")
    found = _DTYPE_NAMES.get(dt)
    if found is None:
        found = _DTYPE_NAMES[dt] = str(dt).replace("torch.", "")
    return found


@dataclass(frozen=True)
class Call:
    """What the rules need to know about one call (from its arguments; no tensor value)."""

    entry: str
    bucket: tuple[Any, ...] = ()
    skip: str | None = None  # why the switch leaves this call to the requested kernel
    dtype: str = ""
    plain: bool = False  # dense: full attention or causal with Sq == Sk, no window
    lse: bool = False  # the call returns the softmax LSE
    grad: bool = False  # q, k or v requires grad: gradients are compared and timed too
    signature: tuple[Any, ...] = ()  # served.served()'s key for calls like this one (empty: none)
    candidates: tuple[str, ...] = ()  # what may compute it here, the requested kernel first

    @property
    def label(self) -> str:
        """A short, readable name of the bucket (event sites)."""
        return "/".join(str(x) for x in self.bucket[1:])


def bucket(entry: str, call: dict[str, Any]) -> tuple[Any, ...] | str:
    """The call's bucket — ``(entry, dtype, head_dim, heads, kv_heads, causal, window, lse, grad,
    plain, *shape)`` with shapes rounded up to powers of two — or, as a string, why the switch
    leaves the call to the requested kernel. ``call`` maps the entry's parameter names to the
    values passed. Plain ints, strings and tuples only: it runs inside torch.compile traces.

    Packed rows (``flash_attn_varlen_func``) are bucketed by their total and longest lengths, not
    by how many sequences they hold: a padding-free training job whose packs change from step to
    step meets few buckets, and each is raced once."""
    q = call.get("q")
    if entry not in SELECTED_ENTRIES or q is None or not getattr(q, "is_cuda", False):
        return NOT_CUDA
    dtype = _dtype(q)
    if dtype not in TOLERANCE:
        return f"{dtype} inputs"
    if float(call.get("dropout_p") or 0.0) > 0.0:
        return "dropout: outputs are random, no comparison possible"
    if call.get("deterministic"):
        return "deterministic=True asked of the kernel"
    if call.get("alibi_slopes") is not None:
        return "ALiBi: no other fused kernel computes it"
    if float(call.get("softcap") or 0.0) > 0.0:
        return "softcap: no other fused kernel computes it"
    window = tuple(int(w) for w in (call.get("window_size") or (-1, -1)))
    causal = bool(call.get("causal"))
    lse = bool(call.get("return_attn_probs") or call.get("return_softmax_lse"))
    heads, d = int(q.shape[-2]), int(q.shape[-1])
    k = call.get("k") if entry != "flash_attn_with_kvcache" else call.get("k_cache")
    kv_heads = int(k.shape[-2]) if k is not None else heads
    grad = _grad_enabled() and bool(
        getattr(q, "requires_grad", False)
        or getattr(call.get("k"), "requires_grad", False)
        or getattr(call.get("v"), "requires_grad", False)
    )
    common = (entry, dtype, d, heads, kv_heads, causal, window, lse, grad)
    if entry == "flash_attn_func":
        b, sq, sk = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
        plain = window == (-1, -1) and (not causal or sq == sk)
        return (*common, plain, "B", _pow2(b), "Sq", _pow2(sq), "Sk", _pow2(sk))
    if entry == "flash_attn_varlen_func":
        if call.get("block_table") is not None:
            return "a paged block_table"
        total = int(q.shape[0])
        mq, mk = _max_len(call.get("max_seqlen_q")), _max_len(call.get("max_seqlen_k"))
        if mq is None or mk is None:
            return "max_seqlen given as a tensor inside a torch.compile trace"
        shape = ("T", _pow2(total), "maxq", _pow2(mq), "maxk", _pow2(mk))
        return (*common, False, *shape)
    # flash_attn_with_kvcache
    for name in ("block_table", "cache_batch_idx", "cache_leftpad", "rotary_cos"):
        if call.get(name) is not None:
            return f"a KV cache call with {name}"
    b, sq, cap = int(q.shape[0]), int(q.shape[1]), int(k.shape[1])
    new = call.get("k") is not None
    return (*common, False, "B", _pow2(b), "Sq", _pow2(sq), "cap", _pow2(cap), "new", new)


def describe_call(
    entry: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    signature: tuple[Any, ...] = (),
    tracing: bool = False,
) -> Call:
    """The call, described once: its ``signature`` (as :func:`~.served.served` read it), its
    bucket or why the switch leaves it alone, the facts the race needs and its candidates here
    (none inside a trace, where nothing is decided)."""
    named = dict(zip(entry.params, args, strict=False))
    named.update(kwargs)
    return describe(entry.name, named, signature, tracing)


def describe(
    entry: str, call: dict[str, Any], signature: tuple[Any, ...] = (), tracing: bool = False
) -> Call:
    """:func:`describe_call` for a call given as a mapping of the entry's parameter names."""
    key = bucket(entry, call)
    if isinstance(key, str):
        return Call(entry, skip=key, signature=signature)
    dtype, lse, grad, plain = key[1], key[7], key[8], key[9]
    found: tuple[str, ...] = ()
    if not tracing:
        from ..fallback import torch_flash

        q = call["q"]
        found = _candidates(entry, plain, lse, torch_flash.can_run(q, q, q))
    return Call(entry, key, None, dtype, plain, lse, grad, signature, found)


def candidates(call: Call, torch_flash_ok: bool) -> list[str]:
    """Candidate names for a described call, the requested kernel first."""
    return list(_candidates(call.entry, call.plain, call.lse, torch_flash_ok))


def _candidates(entry: str, plain: bool, lse: bool, torch_flash_ok: bool) -> tuple[str, ...]:
    out = [REQUESTED]
    for c in CANDIDATES[1:]:
        if entry not in c.entries:
            continue
        if c.name == "torch_flash" and not torch_flash_ok:
            continue
        if c.name in SDPA_BACKENDS and (not plain or lse):  # SDPA returns no LSE
            continue
        out.append(c.name)
    return tuple(out)


def candidate(name: str) -> Candidate:
    return _BY_NAME[name]
