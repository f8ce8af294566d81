"""Attention sinks (``s_aux``: one learned logit per query head that joins each row's softmax and
gives no value) computed by the twins, as GPT-OSS and its kin pass them to the flash path.

Against a float64 reference written out by hand (tests/helpers/tensors.py: softmax over the keys
and the sink, the sink's column dropped): the dense, packed (varlen) and KV-cache twins, forward
and backward (float64 ``gradcheck`` and the reference's own gradients), under
``torch.compile(fullgraph=True)``; then a tiny GPT-OSS through transformers' flash path on the
twins against the same model on eager, logits and every parameter's gradient.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from helpers.models import save_gpt_oss
from helpers.tensors import sinks_reference

import attnguard
from attnguard import fallback
from attnguard.observability import events

B, S, H, HK, D = 2, 9, 4, 2, 8


def tensors(dtype: torch.dtype = torch.float64, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, S, H, D), (B, S, HK, D), (B, S, HK, D), (H,)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def grads(out: torch.Tensor, inputs: list[torch.Tensor], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cotangent = torch.randn(out.shape, generator=g, dtype=torch.float64)
    return list(torch.autograd.grad((out.double() * cotangent).sum(), inputs))


CASES = {
    "causal": {"causal": True},
    "encoder": {"causal": False},
    "window": {"causal": True, "window": (3, 0)},
    "softcap": {"causal": True, "softcap": 1.5},
}


@pytest.mark.smoke
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dense_twin_computes_sinks(case: str, dtype: torch.dtype) -> None:
    opts = CASES[case]
    q, k, v, s = tensors(dtype)
    window = opts.get("window", (-1, -1))
    out = fallback.flash_attn_func(
        q,
        k,
        v,
        causal=opts["causal"],
        window_size=window,
        softcap=opts.get("softcap", 0.0),
        s_aux=s,
    )
    want = sinks_reference(
        q, k, v, s, causal=opts["causal"], window=window, softcap=opts.get("softcap", 0)
    )
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)
    no_sinks = fallback.flash_attn_func(q, k, v, causal=opts["causal"], window_size=window)
    assert (out - no_sinks).abs().max() > 1e-2, "the sinks matter here"
    for got, ref in zip(grads(out, [q, k, v, s]), grads(want, [q, k, v, s]), strict=True):
        torch.testing.assert_close(got, ref, atol=tol * 10, rtol=tol * 10)


def test_dense_twin_gradcheck() -> None:
    q, k, v, s = (t.detach()[:1, :5].clone() if t.dim() > 1 else t.detach() for t in tensors())
    inputs = tuple(t.clone().requires_grad_() for t in (q, k, v, s))
    assert torch.autograd.gradcheck(
        lambda a, b, c, d: fallback.flash_attn_func(a, b, c, causal=True, s_aux=d), inputs
    )


LENGTHS = (3, 6)


def packed(t: torch.Tensor) -> torch.Tensor:
    """The first sequence of length LENGTHS[0] of row 0 and LENGTHS[1] of row 1, packed."""
    return torch.cat([t[0, : LENGTHS[0]], t[1, : LENGTHS[1]]])


@pytest.mark.parametrize("window", [(-1, -1), (2, 0)])
def test_varlen_twin_computes_sinks_per_sequence(window: tuple[int, int]) -> None:
    q, k, v, s = tensors()
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
    out = fallback.flash_attn_varlen_func(
        packed(q), packed(k), packed(v), cu, cu, max(LENGTHS), max(LENGTHS), causal=True,
        window_size=window, s_aux=s,
    )  # fmt: skip
    want = torch.cat(
        [
            sinks_reference(q[b : b + 1, :n], k[b : b + 1, :n], v[b : b + 1, :n], s, window=window)[
                0
            ]
            for b, n in enumerate(LENGTHS)
        ]
    )
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    for got, ref in zip(grads(out, [q, k, s]), grads(want, [q, k, s]), strict=True):
        torch.testing.assert_close(got, ref, atol=1e-11, rtol=1e-11)


def test_varlen_twin_gradcheck() -> None:
    q, k, v, s = (t.detach() for t in tensors())
    inputs = tuple(t.clone().requires_grad_() for t in (packed(q), packed(k), packed(v), s))
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)

    def fn(a: Any, b: Any, c: Any, d: Any) -> Any:
        return fallback.flash_attn_varlen_func(a, b, c, cu, cu, 6, 6, causal=True, s_aux=d)

    assert torch.autograd.gradcheck(fn, inputs)


def test_kvcache_twin_decodes_with_sinks() -> None:
    """One new token against a cache of 6 (and a second sequence with 4), written in place."""
    q, k, v, s = (t.detach() for t in tensors())
    k_cache = torch.zeros(B, 12, HK, D, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    lens = [6, 4]
    for b, n in enumerate(lens):
        k_cache[b, :n], v_cache[b, :n] = k[b, :n], v[b, :n]
    new = [q[b, n : n + 1] for b, n in enumerate(lens)]
    out = fallback.flash_attn_with_kvcache(
        torch.stack(new),
        k_cache,
        v_cache,
        torch.stack([k[b, n : n + 1] for b, n in enumerate(lens)]),
        torch.stack([v[b, n : n + 1] for b, n in enumerate(lens)]),
        cache_seqlens=torch.tensor(lens, dtype=torch.int32),
        causal=True,
        s_aux=s,
    )
    for b, n in enumerate(lens):
        want = sinks_reference(new[b][None], k[b : b + 1, : n + 1], v[b : b + 1, : n + 1], s)
        torch.testing.assert_close(out[b : b + 1], want, atol=1e-12, rtol=1e-12)


def test_a_row_that_sees_no_key_gives_zeros() -> None:
    """Only the sink is left (causal, more queries than keys: the first rows see no key, as
    bottom-right aligned): the sink gives no value, so zeros, as without sinks."""
    q, k, v, s = (t.detach() for t in tensors())
    out = fallback.flash_attn_func(q[:, :6], k[:, :2], v[:, :2], causal=True, s_aux=s)
    assert torch.equal(out[:, :4], torch.zeros_like(out[:, :4]))
    torch.testing.assert_close(out, sinks_reference(q[:, :6], k[:, :2], v[:, :2], s).nan_to_num())


def test_sinks_must_be_one_per_query_head() -> None:
    q, k, v, s = (t.detach() for t in tensors())
    with pytest.raises(ValueError, match="one sink logit per query head"):
        fallback.flash_attn_func(q, k, v, s_aux=s[:2])


@pytest.mark.parametrize("shape", [(H, 1), (1, H), (1, H, 1, 1)])
def test_sinks_of_any_shape_holding_one_per_head(shape: tuple[int, ...]) -> None:
    """What eager accepts (``sinks.reshape(1, -1, 1, 1)``): any shape holding one logit per
    head. The dense, packed and KV-cache twins compute it, forward and backward, as (H,)."""
    q, k, v, s = tensors()
    shaped = s.detach().reshape(shape).requires_grad_()
    want = fallback.flash_attn_func(q, k, v, causal=True, s_aux=s)
    got = fallback.flash_attn_func(q, k, v, causal=True, s_aux=shaped)
    torch.testing.assert_close(got, want)
    (g_want,) = torch.autograd.grad(want.sum(), [s])
    (g_got,) = torch.autograd.grad(got.sum(), [shaped])
    assert g_got.shape == shape
    torch.testing.assert_close(g_got.reshape(-1), g_want)
    q, k, v = (t.detach() for t in (q, k, v))
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
    args = (packed(q), packed(k), packed(v), cu, cu, 6, 6)
    torch.testing.assert_close(
        fallback.flash_attn_varlen_func(*args, causal=True, s_aux=shaped.detach()),
        fallback.flash_attn_varlen_func(*args, causal=True, s_aux=s.detach()),
    )
    torch.testing.assert_close(
        fallback.flash_attn_with_kvcache(q[:, -1:], k, v, causal=True, s_aux=shaped.detach()),
        fallback.flash_attn_with_kvcache(q[:, -1:], k, v, causal=True, s_aux=s.detach()),
    )


def test_sinks_trace_whole_under_compile() -> None:
    """fullgraph: forward and backward of the dense and packed twins with sinks, one graph."""
    q, k, v, s = tensors(torch.float32)
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)

    def both(a: Any, b: Any, c: Any, d: Any) -> Any:
        dense = fallback.flash_attn_func(a, b, c, causal=True, s_aux=d)
        var = fallback.flash_attn_varlen_func(
            packed(a), packed(b), packed(c), cu, cu, 6, 6, causal=True, s_aux=d
        )
        return dense, var

    torch._dynamo.reset()
    compiled = torch.compile(both, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, s)
    want = both(q, k, v, s)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    g_got = torch.autograd.grad(sum(t.sum() for t in got), [q, k, v, s])
    g_want = torch.autograd.grad(sum(t.sum() for t in want), [q, k, v, s])
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --- through transformers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not hasattr(transformers, "GptOssForCausalLM"):
        pytest.skip("this transformers release has no GPT-OSS")
    return save_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))


def test_gpt_oss_on_the_flash_path_equals_eager_forward_and_backward(gpt_oss: Any) -> None:
    """A GPT-OSS flash request where flash-attn is missing: transformers would route it to a hub
    kernel with sinks; guarded, the twins compute the sinks. Logits and every gradient equal the
    eager model's (which spells the sinks out), and the event names transformers' choice."""
    attnguard.activate(log="none")
    events.reset_counts()
    with events.capture() as seen:
        flash = transformers.GptOssForCausalLM.from_pretrained(
            gpt_oss, attn_implementation="flash_attention_2"
        )
    attnguard.deactivate()
    eager = transformers.GptOssForCausalLM.from_pretrained(gpt_oss, attn_implementation="eager")
    attnguard.activate(log="none")
    (said,) = [e for e in seen if e["event"] == "backend_fallback"]
    if getattr(transformers.GptOssForCausalLM, "_compatible_flash_implementations", None):
        # transformers routes it to a hub kernel with sinks, which cannot load here (no
        # `kernels`): the twins compute that kernel's functions, and the event names it
        assert said["rule"] == "hub-on-sdpa"
        assert said["transformers_chooses"] in said["reason"]
        assert flash.config._attn_implementation == said["transformers_chooses"]
    else:
        assert said["rule"] == "flash-on-sdpa"
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    for model in (flash, eager):
        model.train()
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
        out.loss.backward()
    real = mask.bool()
    got = flash(input_ids=ids, attention_mask=mask).logits[real]
    want = eager(input_ids=ids, attention_mask=mask).logits[real]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    for (name, p), (_, r) in zip(flash.named_parameters(), eager.named_parameters(), strict=True):
        assert p.grad is not None and r.grad is not None, name
        torch.testing.assert_close(p.grad, r.grad, atol=5e-5, rtol=1e-3, msg=name)
    sinks = flash.model.layers[0].self_attn.sinks.grad
    assert sinks is not None and sinks.abs().max() > 1e-4, "the sinks learn"


def test_a_custom_attention_passing_sinks_of_shape_heads_by_1(gpt_oss: Any) -> None:
    """A model of one's own whose attention keeps its sinks as (H, 1) (eager reshapes them and
    runs): the flash request on the twins raised attnguard's own ValueError at the first
    forward. Now it computes what eager computes, logits and the sinks' gradient."""
    models = {}
    attnguard.activate(log="none")
    for impl in ("flash_attention_2", "eager"):
        if impl == "eager":
            attnguard.deactivate()  # the reference: transformers' own eager code
        model = transformers.GptOssForCausalLM.from_pretrained(gpt_oss, attn_implementation=impl)
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            layer.self_attn.sinks = torch.nn.Parameter(sinks.detach().reshape(-1, 1).clone())
        models[impl] = model
    attnguard.activate(log="none")
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(3))
    logits = {}
    for impl, model in models.items():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        logits[impl] = out.logits
    torch.testing.assert_close(logits["flash_attention_2"], logits["eager"], atol=2e-5, rtol=1e-4)
    for flash_layer, eager_layer in zip(
        models["flash_attention_2"].model.layers, models["eager"].model.layers, strict=True
    ):
        got, want = flash_layer.self_attn.sinks.grad, eager_layer.self_attn.sinks.grad
        assert got is not None and got.shape == want.shape == (4, 1)
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-3)
