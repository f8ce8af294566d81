"""Attention sinks on the GPU (the GPU half of tests/test_attention_sinks.py): no flash kernel
with sinks is on the GPU image, so the twins are compared with a float64 reference of the same
semantics, and a tiny GPT-OSS on transformers' flash path (twins) with the same model on eager.

On a GPU the twins compute sinks from torch's flash kernel in inference (its lse gives the sink
factor) and from explicit math where a backward pass needs the lse's gradient; both are checked,
in bf16 and fp16, dense, packed and KV-cache decode.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from helpers.models import save_gpt_oss  # noqa: E402
from helpers.tensors import sinks_reference  # noqa: E402

from attnguard import fallback  # noqa: E402

DEV = "cuda:0"
B, S, H, HK, D = 2, 257, 8, 2, 64


def tensors(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(0)
    shapes = [(B, S, H, D), (B, S, HK, D), (B, S, HK, D)]
    out = [torch.randn(s, generator=g, device=DEV, dtype=dtype) for s in shapes]
    return [*out, torch.randn(H, generator=g, device=DEV, dtype=torch.float32)]


def bound(want: torch.Tensor, dtype: torch.dtype) -> float:
    return (2e-2 if dtype == torch.bfloat16 else 4e-3) * want.abs().max().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_and_packed_sinks_in_inference(dtype: torch.dtype) -> None:
    q, k, v, s = tensors(dtype)
    with torch.no_grad():
        out = fallback.flash_attn_func(q, k, v, causal=True, s_aux=s)
        want = sinks_reference(q, k, v, s)
        assert (out.double() - want).abs().max().item() <= bound(want, dtype)
        lengths = (100, S)
        cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32, device=DEV)
        packed = [torch.cat([t[0, : lengths[0]], t[1]]) for t in (q, k, v)]
        out = fallback.flash_attn_varlen_func(*packed, cu, cu, S, S, causal=True, s_aux=s)
        want = torch.cat(
            [sinks_reference(q[:1, : lengths[0]], k[:1, : lengths[0]], v[:1, : lengths[0]], s)[0],
             sinks_reference(q[1:], k[1:], v[1:], s)[0]]
        )  # fmt: skip
        assert (out.double() - want).abs().max().item() <= bound(want, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kvcache_decode_with_sinks(dtype: torch.dtype) -> None:
    q, k, v, s = tensors(dtype)
    k_cache = torch.zeros(B, 512, HK, D, device=DEV, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    k_cache[:, : S - 1], v_cache[:, : S - 1] = k[:, : S - 1], v[:, : S - 1]
    lens = torch.full((B,), S - 1, dtype=torch.int32, device=DEV)
    with torch.no_grad():
        out = fallback.flash_attn_with_kvcache(
            q[:, -1:], k_cache, v_cache, k[:, -1:], v[:, -1:], cache_seqlens=lens, causal=True,
            s_aux=s,
        )  # fmt: skip
    want = sinks_reference(q[:, -1:], k, v, s)
    assert (out.double() - want).abs().max().item() <= bound(want, dtype)


def test_sink_gradients_on_the_gpu() -> None:
    q, k, v, s = (t.requires_grad_() for t in tensors(torch.bfloat16))
    out = fallback.flash_attn_func(q, k, v, causal=True, s_aux=s)
    g = torch.randn(out.shape, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1))
    got = torch.autograd.grad((out.float() * g).sum(), (q, k, v, s))
    want = torch.autograd.grad((sinks_reference(q, k, v, s) * g.double()).sum(), (q, k, v, s))
    for a, b in zip(got, want, strict=True):
        assert (a.double() - b).abs().max().item() <= 3e-2 * b.abs().max().item()


def test_gpt_oss_on_the_twins_equals_eager_on_the_gpu(tmp_path: Any) -> None:
    import transformers

    import attnguard

    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers release has no GPT-OSS")
    save_gpt_oss(tmp_path, hidden_size=64, intermediate_size=64, head_dim=16, sliding_window=8)
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2)).to(DEV)
    load = dict(dtype=torch.bfloat16, device_map={"": 0})
    eager = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", **load
    )
    with torch.no_grad():
        want = eager(input_ids=ids).logits.float()
    attnguard.activate(log="none")
    try:
        flash = transformers.GptOssForCausalLM.from_pretrained(
            tmp_path, attn_implementation="flash_attention_2", **load
        )
        with torch.no_grad():
            got = flash(input_ids=ids).logits.float()
    except ImportError as exc:  # a flash-attn is installed here: transformers routes the model
        pytest.skip(f"flash-attn is installed in this process: {exc}")
    finally:
        attnguard.deactivate()
    assert (got - want).abs().max().item() <= 5e-2 * want.abs().max().item()
