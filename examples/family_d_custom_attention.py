"""Family D: a custom attention module calling xformers / flash_attn directly (VAR).

Original: VAR's ``SelfAttention`` (models/basic_var.py) calls
``xformers.ops.memory_efficient_attention`` (training, with an additive block-causal
``attn_bias``) or ``flash_attn_func`` (inference: flash is never used while an attn_bias exists).
With ``attn_l2_norm`` q and k are normalised (float32 under autocast) and multiplied by a float32
scale, while v stays float16/bfloat16: "ValueError: Query/Key/Value should either all have the
same dtype" from xformers ("query and value must have the same dtype" from flash-attn). Users cast
q, k, v (and the bias) to one dtype by hand.

attnguard: unifies q/k/v (and the bias) to one dtype (``qkv_unified``). Here, on a CPU, neither
kernel can run at all (xformers' ops from PyPI do not load on a CPU, flash-attn is CUDA-only), so
the call is carried by attnguard's SDPA twin with the same call shape (``backend_rerouted``).
The result is compared with the module's own slow path computed in float64.

Run: ``python examples/family_d_custom_attention.py`` (needs ``pip install xformers``; the
flash_attn inference path runs where ``flash_attn`` imports). GPU: not needed.
"""

from __future__ import annotations

import copy
import math
import os

if os.environ.get("ATTNGUARD_LOG", "stderr") == "stderr":  # human-readable; log files stay JSON
    os.environ.setdefault("ATTNGUARD_LOG_FORMAT", "console")

import attnguard  # noqa: E402, F401  (importing activates the guard, before xformers is imported)
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _shared import cannot_show, finish, without_attnguard  # noqa: E402
from attnguard.observability import events  # noqa: E402
from torch import nn  # noqa: E402

try:  # exactly VAR's optional imports
    from xformers.ops import memory_efficient_attention
except ImportError:
    memory_efficient_attention = None
try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None


def slow_attn(query, key, value, scale, attn_mask=None):  # VAR's fallback, layout BHLc
    attn = query.mul(scale) @ key.transpose(-2, -1)
    if attn_mask is not None:
        attn.add_(attn_mask)
    return attn.softmax(dim=-1) @ value


def autocast_normalize(t: torch.Tensor) -> torch.Tensor:
    """F.normalize as CUDA autocast runs it: in float32, so half q/k come out float32."""
    return F.normalize(t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, dim=-1)


class SelfAttention(nn.Module):
    """VAR's self-attention with attn_l2_norm=True, abridged (no KV cache, no dropout)."""

    def __init__(self, embed_dim: int = 64, num_heads: int = 4) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, embed_dim // num_heads
        self.scale = 1.0
        self.scale_mul_1H11 = nn.Parameter(torch.full((1, num_heads, 1, 1), 4.0).log())
        self.max_scale_mul = math.log(100)
        self.mat_qkv = nn.Linear(embed_dim, embed_dim * 3, bias=False)
        self.q_bias = nn.Parameter(torch.zeros(embed_dim))
        self.v_bias = nn.Parameter(torch.zeros(embed_dim))
        self.register_buffer("zero_k_bias", torch.zeros(embed_dim))
        self.proj = nn.Linear(embed_dim, embed_dim)
        self.using_flash = flash_attn_func is not None
        self.using_xform = memory_efficient_attention is not None

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor | None) -> torch.Tensor:
        B, L, C = x.shape
        bias = torch.cat((self.q_bias, self.zero_k_bias, self.v_bias))
        qkv = F.linear(x, self.mat_qkv.weight, bias).view(B, L, 3, self.num_heads, self.head_dim)
        using_flash = self.using_flash and attn_bias is None and qkv.dtype != torch.float32
        if using_flash or self.using_xform:
            q, k, v = qkv.unbind(dim=2)  # BLHc
            scale_mul = self.scale_mul_1H11.clamp_max(self.max_scale_mul).exp().transpose(1, 2)
        else:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(dim=0)  # BHLc
            scale_mul = self.scale_mul_1H11.clamp_max(self.max_scale_mul).exp()
        q = autocast_normalize(q).mul(scale_mul)
        k = autocast_normalize(k)
        if using_flash:
            oup = flash_attn_func(q, k, v, softmax_scale=self.scale)
        elif self.using_xform:
            mask = None if attn_bias is None else attn_bias.expand(B, self.num_heads, -1, -1)
            oup = memory_efficient_attention(q, k, v, attn_bias=mask, p=0.0, scale=self.scale)
        else:
            oup = slow_attn(q, k, v, self.scale, attn_bias).transpose(1, 2)
        return self.proj(oup.reshape(B, L, C))


def block_causal_bias(patch_nums: tuple[int, ...]) -> torch.Tensor:
    """VAR's attn_bias_for_masking: each scale sees itself and every coarser scale."""
    d = torch.cat([torch.full((pn * pn,), i) for i, pn in enumerate(patch_nums)])
    return torch.where(d[:, None] >= d[None, :], 0.0, -torch.inf).reshape(1, 1, len(d), len(d))


def check(name: str, attn: SelfAttention, x: torch.Tensor, bias: torch.Tensor | None) -> None:
    def run() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):  # VAR trains with AMP
            return attn(x, bias)

    print(f"\n{name} without attnguard: {without_attnguard(run)}")
    out = run()
    reference = copy.deepcopy(attn).double()
    reference.using_flash = reference.using_xform = False  # VAR's slow path, in float64
    ref = reference(x.double(), None if bias is None else bias.double())
    err = (out.double() - ref).abs().max().item()
    print(f"{name} with attnguard: {tuple(out.shape)} {out.dtype}; max error vs float64 {err:.4f}")
    print(f"MAX_ERR {name}: {err:.6f} (scale {ref.abs().max().item():.3f})")


def main() -> None:
    if memory_efficient_attention is None and flash_attn_func is None:
        cannot_show("neither xformers nor flash-attn is installed (`pip install xformers`)")
    torch.manual_seed(0)
    attn = SelfAttention()
    bias = block_causal_bias((1, 2, 3))  # 14 tokens over 3 scales
    x = torch.randn(2, bias.shape[-1], 64)
    with events.capture() as captured:
        if memory_efficient_attention is not None:  # else VAR trains on its slow path
            check("training (xformers, attn_bias)", attn, x, bias)
        if flash_attn_func is not None:  # else VAR's inference uses xformers
            check("inference (flash_attn, no bias)", attn, x, None)
    finish(captured)


if __name__ == "__main__":
    main()
