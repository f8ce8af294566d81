"""A caller's mistake stays the caller's: dtypes no remedy computes and arguments the kernel
itself refuses run as the caller made them, so the kernel's own error comes out unchanged, with
no event and nothing counted; ``internal_error`` stays for attnguard's own failures.

flash_attn is the stand-in of tests/standins (flash-attn 2.8.3's contract and messages; CPU
tensors fail in the torch dispatcher as the real kernel's do); xformers is the real PyPI wheel,
whose ops do not load on a CPU machine; transformers' registry entries are the real ones. Where
the real flash kernel's own refusal is the point, a CPU "kernel" below enforces flash-attn's
checks with its messages (the stand-in's, minus the GPU), guarded as flash_attn_func is.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from attnguard import callguard, kernels, runtime
from attnguard.fallback import FLASH_FUNCTIONS
from attnguard.observability import events

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
REPO = Path(__file__).resolve().parents[1]
STANDINS = REPO / "tests" / "standins"


def _error_of(fn: Any, *args: Any, **kwargs: Any) -> tuple[type, str]:
    with pytest.raises(Exception) as info:  # noqa: PT011 - compared with the unguarded one
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


def _same_as_unguarded(guarded_fn: Any, *args: Any, **kwargs: Any) -> tuple[type, str]:
    """The error a guarded call raises, checked to be the unguarded call's own (type, message),
    with no event at all and no complex-to-real cast warned about."""
    original = guarded_fn.__attnguard_original__
    want = _error_of(original, *args, **kwargs)
    with events.capture() as seen, warnings.catch_warnings():
        warnings.simplefilter("error")  # "Casting complex values to real discards ..."
        got = _error_of(guarded_fn, *args, **kwargs)
    assert got == want
    assert [e["event"] for e in seen] == []
    totals = events.summary_fields()
    assert (totals["applied"], totals["internal_errors"]) == (0, 0)
    return got


def _rand(*shape: int, dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _complex(*shape: int) -> torch.Tensor:
    """A rotary embedding's query left in view_as_complex form."""
    return torch.view_as_complex(_rand(*shape, 2, dtype=FP32))


# --- a flash kernel that runs on CPU (its own checks, its own messages) --------------------------


def _cpu_flash_kernel(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash-attn 2.8.3's mha_fwd checks (tests/standins, its messages) on any device, then
    attention through SDPA: the real kernel's answers to a caller's arguments."""
    if q.dtype not in (FP16, BF16):
        raise RuntimeError("FlashAttention only support fp16 and bf16 data type")
    if k.dtype != q.dtype:
        raise RuntimeError("query and key must have the same dtype")
    if v.dtype != q.dtype:
        raise RuntimeError("query and value must have the same dtype")
    if q.shape[-2] % k.shape[-2] != 0:
        raise RuntimeError("Number of heads in key/value must divide number of heads in query")
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(
        qt, kt, vt, is_causal=causal, scale=softmax_scale, enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.fixture
def cpu_flash(guard: Any) -> Any:
    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        _cpu_flash_kernel,
        tensors=("q", "k", "v"),
        twin=FLASH_FUNCTIONS["flash_attn_func"],
        site="flash_attn.flash_attn_func",
        aux=("alibi_slopes",),
        head_axis=3,
        in_force=runtime.IN_FORCE,
    )
    return callguard.wrap_direct(entry)


# --- 1. dtypes no remedy computes ----------------------------------------------------------------


@pytest.mark.parametrize("what", ["complex", "int32"])
def test_a_complex_or_integer_query_meets_flash_attns_own_dtype_error(cpu_flash, what):
    q = _complex(1, 4, 2, 8) if what == "complex" else torch.randint(-4, 4, (1, 4, 2, 8))
    q = q.to(torch.int32) if what == "int32" else q
    k, v = _rand(1, 4, 2, 8), _rand(1, 4, 2, 8, seed=1)
    kind, message = _same_as_unguarded(cpu_flash, q, k, v)
    assert (kind, message) == (RuntimeError, "FlashAttention only support fp16 and bf16 data type")


@pytest.mark.parametrize("what", ["complex", "int32"])
def test_stand_in_flash_attn_func_keeps_its_error_for_a_complex_or_integer_query(
    flash_standin, what
):
    from flash_attn import flash_attn_func

    q = _complex(1, 4, 2, 8) if what == "complex" else torch.randint(-4, 4, (1, 4, 2, 8))
    k, v = _rand(1, 4, 2, 8), _rand(1, 4, 2, 8, seed=1)
    kind, _ = _same_as_unguarded(flash_attn_func, q.to(torch.int32) if what == "int32" else q, k, v)
    assert kind is NotImplementedError  # the CPU tensors' error, as without attnguard


def test_an_int8_kv_cache_is_not_made_into_numbers(flash_standin):
    from flash_attn import flash_attn_with_kvcache

    q = _rand(1, 1, 2, 8)
    cache = torch.randint(-3, 3, (1, 8, 2, 8), dtype=torch.int8)
    seqlens = torch.tensor([3], dtype=torch.int32)
    _same_as_unguarded(flash_attn_with_kvcache, q, cache, cache.clone(), cache_seqlens=seqlens)


def test_the_twins_refuse_what_they_cannot_compute_with_flash_attns_messages():
    """Where a twin stands in for a missing kernel, it answers a complex or integer call as the
    kernel would, instead of casting it into numbers."""
    q, k = _complex(1, 4, 2, 8), _rand(1, 4, 2, 8, dtype=FP32)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="^FlashAttention only support fp16 and bf16"):
        FLASH_FUNCTIONS["flash_attn_func"](q, k, k)
    with pytest.raises(RuntimeError, match="^FlashAttention only support fp16 and bf16"):
        FLASH_FUNCTIONS["flash_attn_varlen_func"](q[0], k[0], k[0], cu, cu, 4, 4)
    cache = torch.randint(-3, 3, (1, 8, 2, 8), dtype=torch.int8)
    with pytest.raises(RuntimeError, match="^query and key must have the same dtype"):
        FLASH_FUNCTIONS["flash_attn_with_kvcache"](k[:, :1], cache, cache, cache_seqlens=3)


def test_xformers_keeps_its_own_dtype_error_and_its_quantized_convention(guard):
    xops = pytest.importorskip("xformers.ops", reason="xformers from PyPI (scripts/test.sh)")
    q, k = _rand(1, 4, 2, 8, dtype=FP16), _rand(1, 4, 2, 8, dtype=FP16, seed=1)
    kind, message = _same_as_unguarded(xops.memory_efficient_attention, _complex(1, 4, 2, 8), k, k)
    assert kind is ValueError and "should either all have the same dtype" in message
    # quantized key/value (int32: packed int4 with scales) are xformers' own: no twin, no cast
    packed = torch.randint(-100, 100, (1, 4, 2, 8), dtype=torch.int32)
    kind, message = _same_as_unguarded(xops.memory_efficient_attention, q, packed, packed)
    assert kind is NotImplementedError and "No operator found" in message


def test_registry_sdpa_keeps_its_error_for_a_complex_query(guard):
    from transformers import modeling_utils

    from attnguard.integrations.transformers.interface import registry_mapping

    sdpa = registry_mapping(modeling_utils)["sdpa"]
    module = torch.nn.Linear(8, 8, dtype=BF16)
    module.is_causal, module.num_key_value_groups = True, 1
    k = _rand(1, 2, 4, 8)
    _same_as_unguarded(sdpa, module, _complex(1, 2, 4, 8), k, k, None, scaling=None)


# --- 2. arguments the kernel itself refuses ------------------------------------------------------


def test_kv_heads_that_do_not_divide_meet_flash_attns_own_error(cpu_flash):
    q, kv = _rand(1, 4, 4, 8), _rand(1, 4, 3, 8)
    kind, message = _same_as_unguarded(cpu_flash, q, kv, kv)
    assert kind is RuntimeError
    assert message == "Number of heads in key/value must divide number of heads in query"
    # the same mistake in float32 (which the guard would otherwise carry) and mixed dtypes
    _same_as_unguarded(cpu_flash, q.float(), kv, kv.float())
    # no tensor where one belongs: the kernel's own AttributeError, not attnguard's
    assert _same_as_unguarded(cpu_flash, q, None, kv)[0] is AttributeError


@pytest.mark.parametrize(
    "name,args",
    [
        ("flash_attn_func", lambda: (_rand(1, 4, 4, 8), _rand(1, 4, 3, 8), _rand(1, 4, 3, 8))),
        ("flash_attn_func", lambda: (_rand(1, 4, 4, 8), _rand(2, 4, 2, 8), _rand(2, 4, 2, 8))),
        ("flash_attn_func", lambda: (_rand(4, 4, 8), _rand(4, 4, 8), _rand(4, 4, 8))),
        ("flash_attn_kvpacked_func", lambda: (_rand(1, 4, 4, 8), _rand(1, 4, 2, 3, 16))),
        (
            "flash_attn_varlen_func",
            lambda: (
                _rand(6, 4, 8),
                _rand(6, 3, 8),
                _rand(6, 3, 8),
                torch.tensor([0, 6], dtype=torch.int32),
                torch.tensor([0, 6], dtype=torch.int32),
                6,
                6,
            ),
        ),
    ],
    ids=["heads", "batch", "rank", "kvpacked-head-dim", "varlen-heads"],
)
def test_stand_in_functions_keep_their_error_for_a_callers_invalid_call(flash_standin, name, args):
    fn = getattr(__import__("flash_attn"), name)
    _same_as_unguarded(fn, *args())


def test_xformers_keeps_its_own_shape_error(guard):
    xops = pytest.importorskip("xformers.ops", reason="xformers from PyPI (scripts/test.sh)")
    q, kv = _rand(1, 4, 4, 8, dtype=FP16), _rand(1, 4, 2, 8, dtype=FP16)
    kind, message = _same_as_unguarded(xops.memory_efficient_attention, q, kv, kv)
    assert kind is ValueError and "Incompatible shapes" in message


def test_registry_entry_keeps_its_error_and_counts_no_change(guard):
    from transformers import modeling_utils

    from attnguard.integrations.transformers.interface import registry_mapping

    sdpa = registry_mapping(modeling_utils)["sdpa"]
    module = torch.nn.Linear(8, 8, dtype=BF16)
    module.is_causal, module.num_key_value_groups = True, 1
    # mixed dtypes send the call to the slow path; the heads do not fit (4 vs 3)
    q, k, v = _rand(1, 4, 4, 8, dtype=FP32), _rand(1, 3, 4, 8, dtype=FP32), _rand(1, 3, 4, 8)
    _same_as_unguarded(sdpa, module, q, k, v, None, scaling=None)


def test_attnguards_own_failure_is_one_internal_error_and_no_change_counted(cpu_flash, monkeypatch):
    """A twin that fails on a call the kernel accepts is attnguard's bug: one internal_error,
    the original call runs, and the reroute that never happened is not counted."""

    def broken_twin(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug in attnguard's twin")

    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        _cpu_flash_kernel,
        tensors=("q", "k", "v"),
        twin=broken_twin,
        site="flash_attn.flash_attn_func",
        head_axis=3,
        in_force=runtime.IN_FORCE,
    )
    fn = callguard.wrap_direct(entry)
    q, kv = _rand(1, 4, 4, 8), _rand(1, 4, 2, 8)
    with events.capture() as seen:
        out = fn(q, kv, kv)
    torch.testing.assert_close(out, _cpu_flash_kernel(q, kv, kv))
    assert [e["event"] for e in seen] == ["internal_error"]
    totals = events.summary_fields()
    assert (totals["applied"], totals["internal_errors"]) == (0, 1)


def test_exit_summary_of_a_callers_mistake_says_nothing_changed(tmp_path):
    """The issue's run: a program calls flash_attn_func with k/v heads that do not divide the
    query heads, catches the error and ends. The summary counts no change and no internal
    error (before: "1 internal error(s)" and "1 change(s) applied")."""
    code = (
        "import torch, attnguard\n"
        "from flash_attn import flash_attn_func\n"
        "q = torch.randn(1, 4, 4, 8, dtype=torch.bfloat16)\n"
        "kv = torch.randn(1, 4, 3, 8, dtype=torch.bfloat16)\n"
        "try:\n"
        "    flash_attn_func(q, kv, kv)\n"
        "except NotImplementedError as exc:\n"
        "    print('caller error:', type(exc).__name__)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), str(STANDINS), env.get("PYTHONPATH", "")]),
        ATTNGUARD="1",
        ATTNGUARD_LOG="stderr",
    )
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr
    assert "caller error: NotImplementedError" in run.stdout
    assert "internal_error" not in run.stderr
    assert "internal error" not in run.stderr and "change(s) applied" not in run.stderr
