"""What computes a diffusers backend's calls where its kernel cannot: attnguard's twins.

* ``flash_attn_func`` / ``flash_attn_varlen_func``: attnguard's flash-attn twins
  (:mod:`attnguard.fallback`), taking the calls diffusers' flash backends make (windows, dropout,
  ``return_attn_probs`` for the LSE);
* ``xops``: a stand-in for the ``xformers.ops`` module diffusers' xformers backend calls:
  ``memory_efficient_attention`` is attnguard's xformers twin, ``LowerTriangularMask`` the causal
  bias it builds for ``is_causal`` (top-left aligned, as xformers' own);
* :func:`hub_kernel_twin`: for a ``*_hub`` backend whose hub kernel cannot load, the twin of the
  flash-attn 2, 3 or 4 function it calls, under that family's rules
  (:mod:`attnguard.fallback.families`);
* :func:`sdpa_unforced`: what a torch backend forced to one SDPA kernel computes, with SDPA free
  to pick any kernel that can take the call (the call the forced backend makes, less the
  ``sdpa_kernel`` context).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ...fallback.families import Family

Tensor = torch.Tensor


class LowerTriangularMask:
    """Stand-in for ``xformers.ops.LowerTriangularMask``: query ``i`` sees keys ``j <= i``
    (attnguard's xformers twin recognises it by name and computes it as causal attention)."""

    def materialize(
        self,
        shape: tuple[int, ...],
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> Tensor:
        mq, mk = shape[-2], shape[-1]
        full = torch.full((mq, mk), -math.inf, dtype=dtype, device=device)
        return torch.triu(full, diagonal=1).expand(shape)


def kernel_twins() -> dict[str, Any]:
    """module global -> what serves it when the package behind it cannot be used."""
    from ...fallback import (
        flash_attn_func,
        flash_attn_varlen_func,
        xformers_memory_efficient_attention,
    )

    xops = SimpleNamespace(
        memory_efficient_attention=xformers_memory_efficient_attention,
        LowerTriangularMask=LowerTriangularMask,
        __name__="attnguard's stand-in for xformers.ops",
    )
    return {
        "flash_attn_func": flash_attn_func,
        "flash_attn_varlen_func": flash_attn_varlen_func,
        "xops": xops,
    }


def hub_kernel_twin(family: Family, function: str) -> Callable[..., Any] | None:
    """attnguard's twin of ``function`` of flash-attn ``family`` (what a ``*_hub`` backend calls
    of a hub kernel whose functions are that family's), or None: no twin of it."""
    from ...fallback import families

    return families.twins_for(family).get(function)


def sdpa_unforced(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **_unused: Any,
) -> Tensor:
    """The call a forced torch backend makes (``(B, S, H, D)`` in and out), SDPA choosing."""
    q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
    extra = {"enable_gqa": True} if enable_gqa else {}
    out = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **extra
    )
    return out.permute(0, 2, 1, 3)


def every_sdpa_kernel(original: Callable[..., Any]) -> Callable[..., Any]:
    """``native``'s own function with every SDPA kernel allowed again (after "No available kernel"
    under a caller's narrower ``sdpa_kernel`` context): the dispatcher still picks the fastest."""
    from ...fallback.registry import all_sdpa_backends

    def twin(*args: Any, **kwargs: Any) -> Any:
        with all_sdpa_backends():
            return original(*args, **kwargs)

    return twin
