"""xformers installed but its kernels cannot run (CPU tensors, or a wheel built for another torch).

Original: code written against xformers (Mistral's reference inference with block-diagonal masks,
LLaMA forks with ``LowerTriangularMask``, diffusion models with an additive bias) calls
``xformers.ops.memory_efficient_attention`` directly. When the ops do not load next to the
installed torch (the PyPI wheel pins one torch build; see "xFormers can't load C++/CUDA
extensions" at import) or the tensors are on the CPU, every call fails with
"NotImplementedError: No operator found for `memory_efficient_attention_forward` with inputs".
Users reinstalled xformers to match torch or rewrote the call with torch SDPA by hand.

attnguard: the call is carried by its SDPA twin of ``memory_efficient_attention``, with the
same layouts and bias objects (tensor bias, ``LowerTriangularMask``, ``BlockDiagonalMask``, ...),
and says so once per call site (``backend_rerouted`` on CPU tensors; on a GPU whose xformers ops
did not load, ``kernel_error_recovered``). Each result is compared with a float64 reference.

Run: ``python examples/xformers_unusable.py`` (needs ``pip install xformers``; without it the
example says so and exits with status 3). GPU: not needed.
"""

from __future__ import annotations

import os

if os.environ.get("ATTNGUARD_LOG", "stderr") == "stderr":  # human-readable; log files stay JSON
    os.environ.setdefault("ATTNGUARD_LOG_FORMAT", "console")

import attnguard  # noqa: E402, F401  (importing activates the guard, before xformers is imported)
import torch  # noqa: E402
from _shared import cannot_show, finish, without_attnguard  # noqa: E402
from attnguard.observability import events  # noqa: E402

try:
    import xformers.ops as xops
    from xformers.ops import fmha
except ImportError:
    xops = None


def reference(q, k, v, keep=None, bias=None):  # float64, layout [B, M, H, K]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if bias is not None:
        scores = scores + bias.double()
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def main() -> None:
    if xops is None:
        cannot_show("xformers is not installed (`pip install xformers`, or the xformers extra)")
    torch.manual_seed(0)
    B, M, H, K = 2, 8, 4, 16
    q, k, v = (torch.randn(B, M, H, K, dtype=torch.float16) for _ in range(3))
    bias = torch.randn(B, H, M, M, dtype=torch.float16)
    lower = torch.ones(M, M, dtype=torch.bool).tril()  # xformers' causal mask is top-left
    seqlens = [3, 5]  # two sequences packed into one row
    packed = [t[:1] for t in (q, k, v)]
    block = torch.block_diag(*(torch.ones(n, n, dtype=torch.bool) for n in seqlens))
    cases = [
        ("tensor bias", (q, k, v), dict(attn_bias=bias), reference(q, k, v, bias=bias)),
        (
            "LowerTriangularMask",
            (q, k, v),
            dict(attn_bias=fmha.attn_bias.LowerTriangularMask()),
            reference(q, k, v, keep=lower),
        ),
        (
            "BlockDiagonalMask",
            packed,
            dict(attn_bias=fmha.attn_bias.BlockDiagonalMask.from_seqlens(seqlens)),
            reference(*packed, keep=block),
        ),
    ]
    first = cases[0]
    call = xops.memory_efficient_attention
    print("without attnguard:", without_attnguard(lambda: call(*first[1], **first[2])))
    with events.capture() as captured:
        for name, args, kwargs, ref in cases:
            out = call(*args, **kwargs)
            err = (out.double() - ref).abs().max().item()
            print(f"with attnguard, {name}: {tuple(out.shape)} {out.dtype}, max error {err:.5f}")
            print(f"MAX_ERR {name}: {err:.6f} (scale {ref.abs().max().item():.3f})")
    finish(captured)


if __name__ == "__main__":
    main()
