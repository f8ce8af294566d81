"""What a twin does with an argument it does not compute: it refuses the call, naming it.

The caller (an integration serving a kernel that cannot run here) then steps aside and the
kernel's own error stands; a twin never computes something other than what was asked.
"""

from __future__ import annotations

import math

import torch


class Uncomputed(TypeError):
    """A call passed arguments the twin does not compute (named in the message)."""


def refuse(names: list[str]) -> None:
    """Raise :class:`Uncomputed` naming ``names``, if any."""
    if names:
        raise Uncomputed(", ".join(names))


def empty_rows_neg_inf(lse: torch.Tensor) -> torch.Tensor:
    """An lse with flash-attn 3's and 4's value for a row that sees no key, -inf (its sum is
    empty: hopper/softmax.h ``finalize`` and epilogue_fwd.hpp ``store_zero``;
    flash_attn/cute/softmax.py ``finalize``), where the twins' core gives flash-attn 2's +inf."""
    return lse.masked_fill(torch.isposinf(lse), -math.inf)
