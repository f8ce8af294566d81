"""Kernel selection (ATTNGUARD_KERNEL=fastest) stood in on a CPU: tensors' metadata as the
buckets read it, a calls' bucket, the fingerprint and the guarded entry the decisions are made
for, the events the tests read. The fixtures built on them (``disk``, ``stand_in``) are in
tests/conftest.py."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

from attnguard.selection import buckets, decisions


class FakeCuda(SimpleNamespace):
    """A tensor's metadata as describe() reads it (it never reads values)."""

    def __init__(self, *shape, dtype=torch.bfloat16, requires_grad=False):
        super().__init__(
            shape=shape,
            dtype=dtype,
            is_cuda=True,
            requires_grad=requires_grad,
            device=torch.device("cuda", 0),
        )


def dense(**kw):
    call = {"q": FakeCuda(4, 4096, 32, 128), "k": FakeCuda(4, 4096, 8, 128), "v": None}
    call.update(kw)
    return buckets.describe("flash_attn_func", call)


FP = ("f" * 16, {"gpu": "Test GPU", "torch": "2.x", "flash_attn": "2.8.3", "attnguard": "0"})


def ignored(events):
    return [e for e in events if e["reason_code"] == "kernel_cache_ignored"]


def write_file(path, data):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write(data if isinstance(data, str) else json.dumps(data))


FLASH_PARAMS = (
    "q",
    "k",
    "v",
    "dropout_p",
    "softmax_scale",
    "causal",
    "window_size",
    "softcap",
    "alibi_slopes",
    "deterministic",
    "return_attn_probs",
)


def requested_kernel(*args, **kwargs):
    raise AssertionError("a stand-in: the test looks at the decision, the kernel is not called")


ENTRY = SimpleNamespace(
    name="flash_attn_func",
    params=FLASH_PARAMS,
    original=requested_kernel,
    site="flash_attn.flash_attn_func",
)


def served_name(impl):
    """Which candidate an implementation returned by serve() is (by identity, from the cache of
    implementations serve() keeps)."""
    names = [n for (entry, n), made in decisions._state.impls.items() if made is impl]
    assert len(names) == 1, names
    return names[0]


def said(events):
    return [e for e in events if e["event"] == "kernel_selected"]
