"""Attention modules of real models, written out where a test needs the module itself (not a
transformers model): how they call the kernels, and their float64 reference."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from helpers.tensors import reference


class VARSelfAttention(torch.nn.Module):
    """VAR's SelfAttention pattern (family D), without its hand-written casts.

    q and k are L2-normalised and multiplied by a float32 learnable scale, so they come out
    float32 while v stays in the model's half dtype; an additive attn_bias in training, none at
    inference; the kernel is called directly.
    """

    def __init__(self, backend: str, dim=32, heads=4, dtype=torch.bfloat16):
        super().__init__()
        self.backend, self.heads, self.head_dim = backend, heads, dim // heads
        self.mat_qkv = torch.nn.Linear(dim, 3 * dim, bias=False, dtype=dtype)
        self.scale_mul_1H11 = torch.nn.Parameter(torch.full((1, heads, 1, 1), 4.0).log())
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype)
        self.scale = 1.0

    def qkv(self, x):
        b, n, c = x.shape
        q, k, v = self.mat_qkv(x).view(b, n, 3, self.heads, self.head_dim).unbind(dim=2)
        scale_mul = self.scale_mul_1H11.clamp_max(math.log(100)).exp().transpose(1, 2)
        q = F.normalize(q, dim=-1).mul(scale_mul)  # float32 now
        k = F.normalize(k, dim=-1).mul(scale_mul)
        return q, k, v

    def forward(self, x, attn_bias=None):
        b, n, c = x.shape
        q, k, v = self.qkv(x)
        if self.backend == "flash":
            from flash_attn import flash_attn_func

            out = flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=self.scale)
        else:
            from xformers.ops import memory_efficient_attention

            bias = None if attn_bias is None else attn_bias.expand(b, self.heads, -1, -1)
            out = memory_efficient_attention(q, k, v, attn_bias=bias, p=0.0, scale=self.scale)
        return self.proj(out.reshape(b, n, c))

    def reference(self, x, attn_bias=None):
        q, k, v = self.qkv(x)
        bias = None if attn_bias is None else attn_bias.expand(x.shape[0], self.heads, -1, -1)
        out = reference(q, k, v, bias=bias, scale=self.scale)
        w, bb = self.proj.weight.double(), self.proj.bias.double()
        return out.reshape(x.shape) @ w.T + bb
