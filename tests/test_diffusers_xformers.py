"""diffusers and xformers: what diffusers hands xformers (its ``xformers`` backend's grouped-query
calls with a mask).

Here xformers is the PyPI wheel whose ops do not run on a CPU.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest
import torch
from conftest import diffusers_dispatch

import attnguard
from attnguard import callguard
from attnguard.fallback import xformers_memory_efficient_attention
from attnguard.observability import events

ad = diffusers_dispatch()  # or the module skips, saying why diffusers is not here


@pytest.fixture(autouse=True)
def _quiet_diffusers() -> Any:
    logging.disable(logging.WARNING)  # "Attention backends are an experimental feature"
    yield
    logging.disable(logging.NOTSET)
    ad._AttentionBackendRegistry._active_backend = ad.AttentionBackendName.NATIVE
    callguard.reset_latches()
    events.reset_counts()


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# --- the grouped-query call diffusers' xformers backend makes ------------------------------------


def _xformers_bmghk_reference(q, k, v, bias, scale=None):
    """xformers' semantics of BMGHK q/k/v ``(B, M, G, H, K)`` with a BMHK tensor bias
    ``(B, G*H, Mq, Mk)``, in float64: the groups flattened (head ``g*H + h``), each head with
    its own bias row (what xformers' ROCm kernel computes; its CUDA kernel takes the bias only
    where H == 1 and refuses it otherwise)."""
    b, mq, g, h, d = q.shape
    scale = d**-0.5 if scale is None else scale
    qd, kd, vd = (x.double().flatten(2, 3).transpose(1, 2) for x in (q, k, v))
    s = qd @ kd.transpose(-1, -2) * scale + bias.double().expand(b, g * h, mq, k.shape[1])
    out = torch.softmax(s, dim=-1) @ vd
    return out.transpose(1, 2).unflatten(2, (g, h))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [2, 1])
def test_xformers_twin_takes_a_bmhk_bias_for_grouped_heads(dtype: torch.dtype, h: int) -> None:
    """diffusers' xformers backend with ``enable_gqa``: q/k/v unflattened to BMGHK (k/v
    expanded over H) with the 4D bias it built for the query heads."""
    b, mq, mk, g, d = 2, 5, 7, 2, 16
    q = _rand(b, mq, g, h, d, seed=1, dtype=dtype)
    k = _rand(b, mk, g, 1, d, seed=2, dtype=dtype).expand(b, mk, g, h, d)
    v = _rand(b, mk, g, 1, d, seed=3, dtype=dtype).expand(b, mk, g, h, d)
    per_head = _rand(b, g * h, mq, mk, seed=4).to(dtype)  # another bias row for every head
    padding = torch.zeros(b, 1, 1, mk).masked_fill(torch.arange(mk) >= 5, -math.inf)
    for bias in (per_head, padding.expand(b, g * h, mq, mk).to(dtype)):
        out = xformers_memory_efficient_attention(q, k, v, bias, 0.0, 0.3)
        assert out.shape == (b, mq, g, h, d) and out.dtype == dtype
        want = _xformers_bmghk_reference(q, k, v, bias, scale=0.3)
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.skipif(ad.xops is None, reason="xformers is not importable here")
def test_xformers_backend_gqa_with_a_mask_computes_natives_numbers(
    captured: list[dict[str, Any]],
) -> None:
    """Through diffusers' dispatcher: xformers' ops cannot run here, the xformers integration
    reroutes each call to the twin, which must take what diffusers hands xformers."""
    q, k, v = _rand(2, 12, 4, 16, seed=5), _rand(2, 12, 2, 16, seed=6), _rand(2, 12, 2, 16, seed=7)
    xf, native = ad.AttentionBackendName.XFORMERS, ad.AttentionBackendName.NATIVE
    keep = torch.arange(12) < torch.tensor([12, 8])[:, None]  # the second row padded
    masks = {
        "padding": torch.zeros(2, 1, 1, 12).masked_fill(~keep[:, None, None, :], -math.inf),
        "per_head": _rand(2, 4, 12, 12, seed=8),
    }
    with pytest.raises(NotImplementedError, match="No operator found"):
        ad.dispatch_attention_fn(q, k, v, attn_mask=masks["padding"], enable_gqa=True, backend=xf)
    attnguard.activate(log="none")
    for mask in masks.values():
        got = ad.dispatch_attention_fn(q, k, v, attn_mask=mask, enable_gqa=True, backend=xf)
        want = ad.dispatch_attention_fn(q, k, v, attn_mask=mask, enable_gqa=True, backend=native)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
    assert [(e["event"], e["reason_code"]) for e in captured[1:]] == [
        ("backend_rerouted", "cpu_tensors")
    ]
