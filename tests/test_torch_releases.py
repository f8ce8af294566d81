"""Every torch release the package declares (torch >= 2.4): what differs between them is decided
once, outside traced code, and nothing on a traced path breaks a graph on any of them.

* ``enable_gqa`` (SDPA takes key/value heads fewer than the query's from torch 2.5): read from the
  op's schema at import; where the torch lacks it the twins, the registry's SDPA twin and the
  race's single-backend candidates repeat the key/value heads instead of passing it (a
  TypeError, a graph break under torch.compile and an error with ``fullgraph=True`` on 2.4);
* torch's own flash kernel as a custom op: its shapes on meta tensors (torch 2.4 has no Meta
  kernel for ``aten::_flash_attention_forward``), and the varlen LSE in flash-attn's packed
  layout whatever this torch's kernel returns (torch 2.4 to 2.6 pad it);
* no lock, ``dict.setdefault`` or slot read on a traced path (torch 2.4 and 2.8 break graphs
  there).

CI runs this file in each torch lane (the newest torch, the floor, one between); tests/test_compile.py
and the twins' compile tests (tests/test_fallback*.py, tests/test_kvcache_twin.py) run there too.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from attnguard import fallback
from attnguard.fallback import registry, torch_flash, varlen
from attnguard.fallback import sdpa as sdpa_module
from attnguard.selection import race

F32 = torch.float32


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def reference(q, k, v, causal=False):
    """(B, H, S, D) attention in float64 with the key/value heads repeated by hand."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), -math.inf)
    return (s.softmax(-1) @ v).float()


@pytest.fixture
def torch_without_gqa(monkeypatch):
    """This torch as torch 2.4 has it: SDPA without ``enable_gqa`` (a TypeError if passed)."""
    plain = F.scaled_dot_product_attention

    def sdpa_2_4(*args, **kwargs):
        if "enable_gqa" in kwargs:
            raise TypeError("scaled_dot_product_attention() got an unexpected keyword 'enable_gqa'")
        return plain(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_2_4)
    for module in (sdpa_module, registry, race):
        monkeypatch.setattr(module, "SDPA_TAKES_GQA", False)


def test_enable_gqa_is_read_from_this_torch():
    schema = torch.ops.aten.scaled_dot_product_attention.default._schema
    assert ("enable_gqa" in [a.name for a in schema.arguments]) == sdpa_module.SDPA_TAKES_GQA
    assert registry.SDPA_TAKES_GQA is race.SDPA_TAKES_GQA is sdpa_module.SDPA_TAKES_GQA


@pytest.mark.parametrize("gqa", ["this torch", "torch 2.4"])
def test_gqa_twins_compute_on_either_sdpa(request, gqa):
    if gqa == "torch 2.4":
        request.getfixturevalue("torch_without_gqa")
    q, k, v = rand(2, 4, 6, 8, seed=1), rand(2, 2, 6, 8, seed=2), rand(2, 2, 6, 8, seed=3)
    want = reference(q, k, v, causal=True)
    # the dense twin (flash layout), the registry's SDPA twin, the race's SDPA candidate
    got = fallback.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
    got = registry.sdpa_bhsd(q, k, v, None, dropout=0.0, scale=None, is_causal=True)
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)
    candidate = race._sdpa_backend(("q", "k", "v", "dropout_p", "softmax_scale", "causal"), "MATH")
    got = candidate(tuple(t.transpose(1, 2) for t in (q, k, v)), {"causal": True})
    torch.testing.assert_close(got.transpose(1, 2), want, atol=1e-5, rtol=1e-5)


def one_graph(fn, *args):
    """fn(*args) compiled whole (fullgraph: any break is an error); its result."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*args)
    assert explained.graph_break_count == 0, [str(b.reason)[:200] for b in explained.break_reasons]
    torch._dynamo.reset()
    try:
        return torch.compile(fn, backend="eager", fullgraph=True)(*args)
    finally:
        torch._dynamo.reset()


def test_registry_sdpa_twin_compiles_whole_with_gqa():
    """transformers' flash registry calls computed on SDPA (a 4D mask, attention weights asked
    for, ...) with fewer key/value heads: one graph on every torch."""
    q, k, v = rand(1, 4, 5, 8, seed=4), rand(1, 2, 5, 8, seed=5), rand(1, 2, 5, 8, seed=6)

    def attend(q, k, v):
        return registry.sdpa_bhsd(q, k, v, None, dropout=0.0, scale=None, is_causal=True)

    torch.testing.assert_close(one_graph(attend, q, k, v), attend(q, k, v))


def test_packed_varlen_segments_compile_whole():
    """Packed sequences split at lengths known while tracing (xformers' block-diagonal biases
    carry them as Python ints): grouped without ``dict.setdefault``, which torch 2.4 cannot
    trace."""
    lens = [3, 2, 3]
    starts = [0, 3, 5, 8]
    q, k, v = rand(8, 2, 4, seed=7), rand(8, 2, 4, seed=8), rand(8, 2, 4, seed=9)

    def get_kv(i):
        return k[starts[i] : starts[i + 1]], v[starts[i] : starts[i + 1]]

    def attend(qb, kb, vb, idx):
        out = F.scaled_dot_product_attention(
            qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2)
        )
        return out.transpose(1, 2), None

    def packed(q):
        return varlen.run_segments(q, starts, lens, get_kv, attend, False)[0]

    got = one_graph(packed, q)
    for i in range(3):
        a, b = starts[i], starts[i + 1]
        want = reference(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v)))[0].transpose(0, 1)
        torch.testing.assert_close(got[a:b], want, atol=1e-5, rtol=1e-5)


def test_the_flash_arguments_read_per_call_take_no_lock():
    """transformers' flash registry calls read which arguments the twins compute at every call,
    under torch.compile too: a lock there is a graph break on torch 2.8."""
    from attnguard.integrations.transformers import arguments

    def fn(x):
        return x * (1 + len(arguments.computed_arguments()))

    x = torch.ones(3)
    torch.testing.assert_close(one_graph(fn, x), fn(x))


# --- torch's own flash kernel as a custom op ---------------------------------------------------

needs_op = pytest.mark.skipif(
    torch_flash._DETERMINISTIC is None, reason="this torch cannot register the custom op"
)


@needs_op
@pytest.mark.parametrize("packed", [False, True])
def test_flash_op_shapes_on_meta_tensors(packed):
    """A model built on the meta device (or any shape propagation) calling the deterministic
    flash op: shapes, no kernel. torch 2.4 has no Meta kernel for aten's op (NotImplementedError
    before attnguard computed them)."""
    h, d = 4, 16
    if packed:
        q = torch.empty(20, h, d, dtype=torch.float16, device="meta")
        cu = torch.empty(4, dtype=torch.int32, device="meta")
        args = (q, q, q, cu, cu, 9, 9)
    else:
        q = torch.empty(2, 8, h, d, dtype=torch.float16, device="meta")
        args = (q, q, q, None, None, 8, 8)
    out, lse, seed, offset = torch_flash._DETERMINISTIC(*args, 0.0, True, 0.25, None, None)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_meta
    assert lse.dtype == F32 and lse.is_meta
    # dense (B, H, Sq); packed: flash-attn's (H, total) or the padded (B, H, max_q) of torch
    # 2.4-2.6's kernel, which torch_flash.attention brings to (H, total)
    want = [(h, 20), (3, h, 9)] if packed else [(2, h, 8)]
    assert tuple(lse.shape) in want
    assert seed.is_meta and offset.is_meta and offset.dim() == 0


def test_padded_varlen_lse_becomes_packed():
    """torch 2.4-2.6's kernel returns a packed call's LSE padded per sequence (B, H, max_q);
    flash-attn's functions return (H, total): gathered on the device, no length read."""
    lens = [3, 0, 5, 2]
    cu = torch.tensor([0, 3, 3, 8, 10], dtype=torch.int32)
    padded = rand(4, 2, 5, seed=10)
    got = torch_flash.packed_lse(padded, cu, 10)
    want = torch.cat([padded[b, :, :n] for b, n in enumerate(lens)], dim=1)
    assert torch.equal(got, want)
    assert got.shape == (2, 10) and got.is_contiguous()
