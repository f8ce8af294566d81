"""bench/bench_twins.py's parts with a model: through transformers' flash path (``train``,
``generate``: a Qwen2-0.5B-shaped model, the real kernels vs the twins switched in this process)
and a custom decoder that calls ``flash_attn_with_kvcache`` itself (``decode_model``; also
bench/bench_kvcache.py's ``step``); ``packed_row`` is bench/bench_kernel.py's training row too.
bench_twins.py's docstring says what each part measures.

The settings main() and ``--dry-run`` set (``DEV``, the shapes) are read from bench_twins when a
part runs; bench_twins.py, run as a script, is that module.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
from collections.abc import Callable, Iterator
from typing import Any

import bench_twins as bt
from bench_fallback import qwen2_05b  # the Qwen2-0.5B shape every bench uses
from bench_twins import ab, host_us, lengths, real_flash, row, wall_ms

# --- through transformers' flash path --------------------------------------------------------


@contextlib.contextmanager
def kernels_switch() -> Iterator[Callable[[str], None]]:
    """Yields use(which): "real" -> flash-attn's kernels, "twins" -> attnguard's twins, both
    through transformers' own flash path; the twins reached exactly as attnguard reaches them
    when flash-attn's kernel cannot run (its lazy-import patch answering with the twins)."""
    import attnguard
    from attnguard import kernels
    from attnguard.integrations.transformers import flash_path as tk
    from attnguard.integrations.transformers import flash_state

    state = {"broken": False}
    saved = kernels.flash_kernel_unusable
    kernels.flash_kernel_unusable = lambda impl, settings=None: (
        "extension_broken" if state["broken"] else None
    )
    attnguard.activate(log="none")
    importlib.import_module("transformers.modeling_utils")  # patched on import, as a model load
    module = importlib.import_module(flash_state.MODULE)

    def use(which: str) -> None:
        broken = which == "twins"
        if broken != state["broken"]:  # switch: transformers resolves its kernels again
            state["broken"] = broken
            flash_state.clear_lazy_cache(module, tk.wiring())

    try:
        yield use
    finally:
        kernels.flash_kernel_unusable = saved
        attnguard.deactivate()


def flash_model(layers: int = 24) -> Any:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = qwen2_05b(layers)
    cfg._attn_implementation = "flash_attention_2"
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    return model


def packed_row(lens: list[int]) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=bt.DEV).manual_seed(len(lens))
    total = sum(lens)
    ids = torch.randint(3, 150000, (1, total), device=bt.DEV, generator=g)
    pos = torch.cat([torch.arange(n, device=bt.DEV) for n in lens]).unsqueeze(0)
    return {"input_ids": ids, "position_ids": pos, "labels": ids}


def train_step(model: Any, opt: Any, batch: dict, use: Any, which: str, losses: dict) -> Callable:
    def run() -> Any:
        use(which)
        out = model(**batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[which] = out.loss.item()

    return run


def part_train(args: argparse.Namespace) -> list[str]:
    import torch

    model = flash_model()
    model.train()
    # lr 0: AdamW does all its work and the weights stay put, so both kernels see the same
    # model in every step and their losses compare
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    lines = []
    with kernels_switch() as use:
        for name, (n, lo, hi) in bt.PACKS.items():
            lens = lengths(n, lo, hi, seed=100 + n)
            batch = packed_row(lens)
            losses: dict[str, float] = {}
            res = ab(
                train_step(model, opt, batch, use, "real", losses),
                train_step(model, opt, batch, use, "twins", losses),
                args.rounds,
                max(3, args.iters // 4),
            )
            lines.append(row(f"training step, packed row {name} ({sum(lens)} tokens)", res))
            lines.append(f"<!-- loss: real {losses.get('real')}, twins {losses.get('twins')} -->")
    return lines


def part_generate(args: argparse.Namespace) -> list[str]:
    import torch
    from transformers import DynamicCache

    model = flash_model().eval()
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(3, 150000, (4, 2048), device="cuda", generator=g)
    lines = []
    with kernels_switch() as use, torch.no_grad():
        use("real")
        cache = DynamicCache()
        model(input_ids=ids, past_key_values=cache, use_cache=True)
        step_ids = ids[:, -1:]

        def prefill(which: str) -> Callable[[], Any]:
            def run() -> Any:
                use(which)
                return model(input_ids=ids, use_cache=False)

            return run

        def decode(which: str) -> Callable[[], Any]:
            def run() -> Any:
                use(which)
                model(input_ids=step_ids, past_key_values=cache, use_cache=True)
                cache.crop(-1)  # back to context 2048 (a negative count: every release)

            return run

        lines.append(
            row("prefill 4 x 2048", ab(prefill("real"), prefill("twins"), args.rounds, args.iters))
        )
        lines.append(
            row(
                "decode step, batch 4, context 2048",
                ab(decode("real"), decode("twins"), args.rounds, args.iters),
            )
        )
    return lines


def decoder(layers: int, hidden: int, h: int, hk: int, d: int) -> Any:
    """A decoder of ``layers`` layers (bf16, on DEV) whose attention is a
    ``flash_attn_with_kvcache``-shaped function passed at each call (custom models' way)."""
    import torch
    import torch.nn as nn

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = nn.Linear(hidden, (h + 2 * hk) * d)
            self.o = nn.Linear(h * d, hidden, bias=False)
            self.up = nn.Linear(hidden, 4864, bias=False)
            self.down = nn.Linear(4864, hidden, bias=False)
            self.norm = nn.RMSNorm(hidden)

        def forward(self, x: Any, kc: Any, vc: Any, seqlens: Any, attend: Any) -> Any:
            b = x.shape[0]
            q, k, v = self.qkv(self.norm(x)).split([h * d, hk * d, hk * d], dim=-1)
            out = attend(
                q.view(b, 1, h, d),
                kc,
                vc,
                k.view(b, 1, hk, d),
                v.view(b, 1, hk, d),
                cache_seqlens=seqlens,
                causal=True,
            )
            x = x + self.o(out.reshape(b, 1, h * d))
            return x + self.down(torch.nn.functional.silu(self.up(x)))

    torch.manual_seed(0)
    with torch.device(bt.DEV):
        return nn.ModuleList(Layer() for _ in range(layers)).to(torch.bfloat16)


def part_decode_model(args: argparse.Namespace) -> list[str]:
    from attnguard import fallback

    fi = real_flash()
    layers, hidden, h, hk, d = bt.DECODER
    model = decoder(layers, hidden, h, hk, d)
    lines = []
    for b, ctx in bt.DECODE_SHAPES:
        real = decode_step(model, fi.flash_attn_with_kvcache, b, ctx, hk, d, hidden)
        twin = decode_step(model, fallback.flash_attn_with_kvcache, b, ctx, hk, d, hidden)
        label = f"decode step, {layers}-layer custom model, B{b} ctx {ctx}"
        lines.append(row(f"{label} (wall ms)", ab(real, twin, args.rounds, args.iters, wall_ms)))
        host = ab(real, twin, args.rounds, args.iters, host_us)
        lines.append(row(f"{label} (host µs per step, steps queued)", host))
    return lines


def decode_step(
    model: Any, attend: Any, b: int, ctx: int, hk: int, d: int, hidden: int
) -> Callable[[], Any]:
    """One token through every layer, each with its own (b, ctx + 64) KV cache at length ctx."""
    import torch

    kw = {"device": bt.DEV, "dtype": torch.bfloat16}
    caches = [
        (torch.randn(b, ctx + 64, hk, d, **kw), torch.randn(b, ctx + 64, hk, d, **kw))
        for _ in model
    ]
    seqlens = torch.full((b,), ctx, dtype=torch.int32, device=bt.DEV)
    x0 = torch.randn(b, 1, hidden, **kw)

    def run() -> Any:
        x = x0
        with torch.no_grad():
            for layer, (kc, vc) in zip(model, caches, strict=True):
                x = layer(x, kc, vc, seqlens, attend)
        return x

    return run
