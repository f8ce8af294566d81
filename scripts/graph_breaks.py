"""Graph breaks under torch.compile with attnguard, per call path, on the installed torch.

For each path: the breaks (``torch._dynamo.explain``: graphs - 1), those whose innermost frame is
attnguard's own code, and whether ``fullgraph=True`` compiles. A tiny Llama with grouped-query
attention (4 query heads, 2 key/value heads, bf16) through transformers' sdpa (unguarded and
guarded) and flash_attention_2 (guarded: the twins serve it here) paths; the registry's sdpa entry
remedying mixed q/k/v dtypes; the flash-attn and xformers twins called directly (xformers' bias
classes where xformers imports). The breaks outside attnguard are transformers' and torch's own.

    python scripts/graph_breaks.py   # in the environment to measure (CPU is enough)
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ["ATTNGUARD_LOG"] = "none"
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)

import torch  # noqa: E402
import transformers  # noqa: E402

import attnguard  # noqa: E402
from attnguard import fallback  # noqa: E402
from attnguard.integrations.transformers import interface  # noqa: E402

BF16 = torch.bfloat16


def count(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(fn)(*args, **kwargs)
        ours = []
        for reason in explained.break_reasons:
            frame = reason.user_stack[-1] if reason.user_stack else None
            if frame is not None and "/attnguard/" in frame.filename:
                ours.append(f"{frame.filename.split('/attnguard/')[-1]}:{frame.lineno}")
        found = f"breaks {explained.graph_break_count:3d}, attnguard's {len(ours):2d} {sorted(set(ours))}"
    except Exception as exc:
        found = f"error {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    torch._dynamo.reset()
    try:
        torch.compile(fn, backend="eager", fullgraph=True)(*args, **kwargs)
        whole = "fullgraph ok"
    except Exception as exc:
        whole = f"fullgraph fails ({type(exc).__name__})"
    print(f"{name:44s} {found} | {whole}", flush=True)


def main() -> None:
    attnguard.deactivate()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    path = tempfile.mkdtemp()
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, :3] = 0

    def model(impl: str) -> Any:
        m = transformers.LlamaForCausalLM.from_pretrained(
            path, attn_implementation=impl, torch_dtype=BF16
        )
        return m.eval()

    g = torch.Generator().manual_seed(3)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    with torch.no_grad():
        count("llama sdpa, unguarded", model("sdpa"), input_ids=ids)
        attnguard.activate(log="none")
        m = model("sdpa")
        m(input_ids=ids)
        count("llama sdpa, guarded", m, input_ids=ids)
        m = model("flash_attention_2")
        m(input_ids=ids)
        count("llama flash_attention_2 (twins), guarded", m, input_ids=ids)
        count("  ... left-padded", m, input_ids=ids, attention_mask=padded)
        from transformers import modeling_utils

        sdpa = interface.registry_mapping(modeling_utils)["sdpa"]
        module = torch.nn.Linear(4, 4, dtype=BF16)
        module.is_causal = True
        q, k, v = r(1, 2, 8, 16), r(1, 2, 8, 16), r(1, 2, 8, 16).to(BF16)
        count(
            "registry sdpa, mixed dtypes (unify)",
            lambda q, k, v: sdpa(module, q, k, v, None, dropout=0.0, scaling=None)[0],
            q,
            k,
            v,
        )
        attnguard.deactivate()
    q, k, v = r(2, 8, 4, 16), r(2, 8, 2, 16), r(2, 8, 2, 16)
    count(
        "twin flash_attn_func GQA causal",
        lambda q, k, v: fallback.flash_attn_func(q, k, v, causal=True),
        q,
        k,
        v,
    )
    count("twin flash_attn_func GQA", lambda q, k, v: fallback.flash_attn_func(q, k, v), q, k, v)
    cu = torch.tensor([0, 5, 12, 16], dtype=torch.int32)
    qp, kp, vp = r(16, 4, 8), r(16, 2, 8), r(16, 2, 8)
    count(
        "twin flash_attn_varlen_func GQA",
        lambda q, k, v, cu: fallback.flash_attn_varlen_func(q, k, v, cu, cu, 7, 7, causal=True),
        qp,
        kp,
        vp,
        cu,
    )
    kc, vc, lens = r(2, 12, 2, 16), r(2, 12, 2, 16), torch.tensor([5, 9], dtype=torch.int32)
    count(
        "twin flash_attn_with_kvcache GQA",
        lambda q, kc, vc, n: fallback.flash_attn_with_kvcache(q[:, :1], kc, vc, cache_seqlens=n),
        q,
        kc,
        vc,
        lens,
    )
    try:
        from xformers.ops.fmha import attn_bias
    except Exception as exc:
        print(f"xformers: does not import here ({type(exc).__name__})")
        return
    xq, xk, xv = r(2, 6, 4, 16), r(2, 6, 4, 16), r(2, 6, 4, 16)
    xformers = fallback.xformers_memory_efficient_attention
    count("twin xformers, no bias", lambda a, b, c: xformers(a, b, c), xq, xk, xv)
    causal = attn_bias.LowerTriangularMask()
    count(
        "twin xformers LowerTriangularMask",
        lambda a, b, c: xformers(a, b, c, attn_bias=causal),
        xq,
        xk,
        xv,
    )
    blocks = attn_bias.BlockDiagonalCausalMask.from_seqlens([2, 3, 1])
    pq, pk, pv = r(1, 6, 4, 16), r(1, 6, 4, 16), r(1, 6, 4, 16)
    count(
        "twin xformers BlockDiagonalCausalMask",
        lambda a, b, c: xformers(a, b, c, attn_bias=blocks),
        pq,
        pk,
        pv,
    )


if __name__ == "__main__":
    main()
