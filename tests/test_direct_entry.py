"""Direct entry points: flash_attn's functions and xformers' memory_efficient_attention.

flash_attn here is the **stand-in** in tests/standins (the real CUDA kernels cannot run on CPU):
it enforces flash-attn 2.8.3's contract with the real errors (CPU inputs fail in the torch
dispatcher, fp16/bf16 only, one dtype, head_dim <= 256). xformers is the real PyPI wheel
(``pip install --no-deps xformers``): its ops do not run on CPU ("No operator found for
`memory_efficient_attention_forward`"), so the guard's SDPA twin must carry every call.
"""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.events import reasons
from helpers.modules import VARSelfAttention
from helpers.packages import STANDINS
from helpers.tensors import flash_keep, qkv, reference

import attnguard
from attnguard import callguard, kernels, runtime
from attnguard.observability import events

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_qkv = functools.partial(qkv, sq=6, hk=2, dtypes=(FP32, FP32, BF16))


@pytest.fixture
def xformers_ops() -> object:
    ops = pytest.importorskip("xformers.ops", reason="xformers from PyPI (pip install --no-deps)")
    attnguard.activate(log="none")
    return ops


# --- flash_attn (stand-in) ----------------------------------------------------------------------


def test_standin_enforces_the_real_contract(flash_standin):
    attnguard.deactivate()  # the stand-in itself, unguarded
    q, k, v = _qkv()
    with pytest.raises(
        NotImplementedError, match="Could not run 'flash_attn::_flash_attn_forward'"
    ):
        flash_standin.flash_attn_func(q, k, v)
    assert __import__("importlib").metadata.version("flash_attn") == "2.8.3"


@pytest.mark.smoke
def test_from_imports_bind_the_guarded_functions(flash_standin):
    from flash_attn import flash_attn_func, flash_attn_varlen_func
    from flash_attn.flash_attn_interface import flash_attn_func as from_interface

    assert flash_attn_func is from_interface
    assert flash_attn_func.__attnguard_original__.__module__ == "flash_attn.flash_attn_interface"
    assert flash_attn_varlen_func.__attnguard_original__ is not None
    original = flash_attn_func.__attnguard_original__
    attnguard.deactivate()
    assert flash_standin.flash_attn_func is original
    assert flash_standin.flash_attn_interface.flash_attn_func is original


def test_patched_at_import_in_a_fresh_process():
    code = (
        "import attnguard\n"
        "from flash_attn import flash_attn_func\n"
        "from flash_attn.flash_attn_interface import flash_attn_kvpacked_func as f\n"
        "print(hasattr(flash_attn_func, '__attnguard_original__'),"
        " hasattr(f, '__attnguard_original__'))\n"
    )
    repo = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(repo), str(STANDINS), os.environ.get("PYTHONPATH", "")]),
        ATTNGUARD="1",
        ATTNGUARD_LOG="none",
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.smoke
def test_flash_attn_func_mixed_dtypes_on_cpu(flash_standin):
    from flash_attn import flash_attn_func

    q, k, v = _qkv()
    with events.capture() as seen:
        out = flash_attn_func(q, k, v, causal=True, softmax_scale=0.3)
    assert out.dtype == BF16 and out.shape == (2, 6, 4, 16)
    want = reference(q, k, v.float(), flash_keep(6, 6, True), scale=0.3)
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    assert reasons(seen) == [("qkv_unified", "mixed_dtypes"), ("backend_rerouted", "cpu_tensors")]
    assert seen[0]["from"] == {"q": "float32", "k": "float32", "v": "bfloat16"}
    assert seen[0]["to"] == "bfloat16"


def test_flash_attn_func_returns_lse_when_asked(flash_standin):
    from flash_attn import flash_attn_func

    q, k, v = _qkv(dtypes=(FP32, FP32, FP32))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.dtype == FP32 and lse.shape == (2, 4, 6) and lse.dtype == FP32
    torch.testing.assert_close(
        out.double(), reference(q, k, v, flash_keep(6, 6, True)), atol=1e-5, rtol=1e-5
    )


@pytest.mark.smoke
def test_flash_varlen_packed_sequences_stay_apart(flash_standin):
    from flash_attn import flash_attn_varlen_func

    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, 4, 8, generator=g)
    k = torch.randn(7, 2, 8, generator=g)
    v = torch.randn(7, 2, 8, generator=g).to(FP16)
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    with events.capture() as seen:
        out = flash_attn_varlen_func(q, k, v, cu, cu, 4, 4, causal=True)
    assert out.dtype == FP16 and out.shape == (7, 4, 8)
    for a, b in ((0, 3), (3, 7)):
        want = reference(
            q[None, a:b], k[None, a:b], v[None, a:b].float(), flash_keep(b - a, b - a, True)
        )
        torch.testing.assert_close(out[None, a:b].double(), want, atol=3e-3, rtol=3e-3)
    assert ("backend_rerouted", "cpu_tensors") in reasons(seen)


def test_flash_packed_functions(flash_standin):
    from flash_attn import flash_attn_kvpacked_func, flash_attn_qkvpacked_func

    q, k, v = _qkv(hk=4, dtypes=(FP32, BF16, BF16))
    out = flash_attn_kvpacked_func(q, torch.stack([k, v], dim=2), causal=True)
    want = reference(q, k.float(), v.float(), flash_keep(6, 6, True))
    assert out.dtype == BF16
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    qkv = torch.stack([q, k.float(), v.float()], dim=2)
    out = flash_attn_qkvpacked_func(qkv, causal=False)
    assert out.dtype == FP32
    torch.testing.assert_close(out.double(), reference(q, k, v), atol=1e-5, rtol=1e-5)


def test_flash_kernel_error_recovered_when_reroute_is_off(flash_standin):
    attnguard.configure(disable="reroute")
    from flash_attn import flash_attn_func

    q, k, v = _qkv(dtypes=(BF16, BF16, BF16))
    with events.capture() as seen:
        out = flash_attn_func(q, k, v, causal=True)
        again = flash_attn_func(q, k, v, causal=True)  # latched: straight to the twin
    want = reference(q, k, v, flash_keep(6, 6, True))
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(again, out)
    assert reasons(seen) == [("kernel_error_recovered", "cpu_backend")]
    assert seen[0]["error"].startswith(
        "Could not run 'flash_attn::_flash_attn_forward' with arguments from the 'CPU' backend"
    )


def test_unknown_error_from_a_direct_entry_propagates(guard_active):
    boom = RuntimeError("an error nobody knows")

    def kernel(q, k, v, *args, **kwargs):
        raise boom

    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        kernel,
        tensors=("q", "k", "v"),
        twin=kernel,
        site="test.kernel",
        head_axis=3,
        in_force=runtime.IN_FORCE,
    )
    fn = callguard.wrap_direct(entry)
    q = torch.empty(1, 4, 2, 8, dtype=BF16, device="meta")  # passes the fast checks
    with events.capture() as seen, pytest.raises(RuntimeError) as info:
        fn(q, q, q)
    assert info.value is boom and seen == []


@pytest.fixture
def guard_active():
    attnguard.activate(log="none")
    events.reset_counts()
    callguard.reset_latches()
    yield
    attnguard.deactivate()


# --- xformers (real PyPI wheel; its ops do not run on CPU) ----------------------------------------


def _xf_inputs(seed=2, dtypes=(FP32, FP32, BF16)):
    return _qkv(b=1, sq=7, h=2, hk=2, d=8, seed=seed, dtypes=dtypes)


def test_xformers_cannot_run_here_unguarded(xformers_ops):
    attnguard.deactivate()
    q, k, v = _xf_inputs(dtypes=(FP32, FP32, FP32))
    with pytest.raises(
        NotImplementedError, match="No operator found for `memory_efficient_attention"
    ):
        xformers_ops.memory_efficient_attention(q, k, v)


@pytest.mark.smoke
@pytest.mark.parametrize("bias_kind", ["none", "tensor", "lower_triangular", "block_diagonal"])
def test_xformers_fallback_with_each_bias_type(xformers_ops, bias_kind):
    from xformers.ops import fmha, memory_efficient_attention

    q, k, v = _xf_inputs()
    keep, bias, attn_bias = None, None, None
    if bias_kind == "tensor":
        g = torch.Generator().manual_seed(7)
        bias = torch.randn(1, 2, 7, 7, generator=g)  # fp32 bias with a bf16 computation
        attn_bias = bias
    elif bias_kind == "lower_triangular":
        attn_bias = fmha.attn_bias.LowerTriangularMask()
        keep = flash_keep(7, 7, True)
    elif bias_kind == "block_diagonal":
        attn_bias = fmha.attn_bias.BlockDiagonalMask.from_seqlens([3, 4])
        seg = torch.tensor([0, 0, 0, 1, 1, 1, 1])
        keep = seg[:, None] == seg[None, :]
    with events.capture() as seen:
        out = memory_efficient_attention(q, k, v, attn_bias=attn_bias, scale=0.4)
    assert out.dtype == BF16 and out.shape == q.shape and not torch.isnan(out).any()
    want = reference(q, k, v.float(), keep=keep, bias=bias, scale=0.4)
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    got = reasons(seen)
    assert got[0] == ("qkv_unified", "mixed_dtypes") and got[-1] == (
        "backend_rerouted",
        "cpu_tensors",
    )


def test_xformers_fmha_module_is_guarded_too(xformers_ops):
    from xformers.ops import fmha

    assert fmha.memory_efficient_attention is xformers_ops.memory_efficient_attention
    assert fmha.memory_efficient_attention.__attnguard_original__ is not None


def test_xformers_no_operator_error_recovered_when_reroute_is_off(xformers_ops):
    attnguard.configure(disable="reroute")
    q, k, v = _xf_inputs(dtypes=(FP32, FP32, FP32))
    with events.capture() as seen:
        out = xformers_ops.memory_efficient_attention(q, k, v)
    torch.testing.assert_close(out.double(), reference(q, k, v), atol=1e-5, rtol=1e-5)
    assert reasons(seen) == [("kernel_error_recovered", "xformers_no_operator")]
    assert seen[0]["error"].startswith("No operator found for `memory_efficient_attention_forward`")


# --- a custom attention module written the way VAR writes it ------------------------------------


def _var_inputs(training: bool):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(2, 6, 32, generator=g).to(BF16)
    if not training:
        return x, None
    # VAR's training bias: additive, -inf above the block-causal staircase, float32
    level = torch.tensor([0, 1, 1, 2, 2, 2])
    return x, torch.where(level[:, None] >= level[None, :], 0.0, -math.inf)[None, None]


@pytest.mark.parametrize("training", [True, False])
def test_var_attention_through_xformers(xformers_ops, training):
    torch.manual_seed(0)
    attn = VARSelfAttention("xformers").train(training)
    x, bias = _var_inputs(training)
    attnguard.deactivate()
    with pytest.raises((ValueError, NotImplementedError)):  # unguarded: it fails
        attn(x, bias)
    attnguard.activate(log="none")
    with torch.no_grad(), events.capture() as seen:
        out = attn(x, bias)
        want = attn.reference(x, bias)
    assert out.dtype == BF16 and not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), want, atol=5e-2, rtol=5e-2)
    assert ("qkv_unified", "mixed_dtypes") in reasons(seen)


def test_var_attention_through_flash_attn(flash_standin):
    torch.manual_seed(0)
    attn = VARSelfAttention("flash").eval()
    x, _ = _var_inputs(training=False)
    with torch.no_grad(), events.capture() as seen:
        out = attn(x)
        want = attn.reference(x)
    assert out.dtype == BF16
    torch.testing.assert_close(out.double(), want, atol=5e-2, rtol=5e-2)
    assert reasons(seen) == [("qkv_unified", "mixed_dtypes"), ("backend_rerouted", "cpu_tensors")]


# --- flash-attn / xformers releases past the newest tested one ---------------------------------

_NEWER_CHECK = (
    "import json, attnguard\n"
    "from attnguard.observability import events\n"
    "with events.capture() as seen:\n"
    "    import flash_attn\n"
    "print(json.dumps({\n"
    "    'version': __import__('importlib').metadata.version('flash_attn'),\n"
    "    'guarded': {n: hasattr(getattr(flash_attn, n), '__attnguard_original__')\n"
    "                for n in ('flash_attn_func', 'flash_attn_varlen_func')},\n"
    "    'events': [[e['event'], e['reason_code'], e['site']] for e in seen]}))\n"
)


def _newer_standin(tmp_path: Path, version: str, edit: tuple[str, str] | None) -> Path:
    """The stand-in as a flash-attn release ``version``, its source changed by ``edit``."""
    import shutil

    root = tmp_path / version
    shutil.copytree(STANDINS / "flash_attn", root / "flash_attn")
    shutil.copy(STANDINS / "_flash_attn_standin_ops.py", root)
    dist = root / f"flash_attn-{version}.dist-info"
    shutil.copytree(STANDINS / "flash_attn-2.8.3.dist-info", dist)
    meta = dist / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 2.8.3", f"Version: {version}"))
    if edit is not None:
        interface = root / "flash_attn" / "flash_attn_interface.py"
        text = interface.read_text()
        assert edit[0] in text
        interface.write_text(text.replace(edit[0], edit[1], 1))
    return root


@pytest.mark.parametrize(
    ("version", "edit", "func_guarded"),
    [
        ("2.99.0", None, True),  # a number nobody tested, the same functions: guarded
        # a release whose flash_attn_func takes a new parameter: that one is left alone
        (
            "2.9.1",
            (
                "    return_attn_probs=False,\n):",
                "    return_attn_probs=False,\n    sink=None,\n):",
            ),
            False,
        ),
    ],
)
def test_a_newer_flash_attn_is_guarded_by_its_shape(tmp_path, version, edit, func_guarded):
    root = _newer_standin(tmp_path, version, edit)
    repo = Path(__file__).resolve().parents[1]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(repo), str(root), os.environ.get("PYTHONPATH", "")]),
        ATTNGUARD_LOG="none",
    )
    out = subprocess.run(
        [sys.executable, "-c", _NEWER_CHECK], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    got = __import__("json").loads(out.stdout.splitlines()[-1])
    assert got["version"] == version
    assert got["guarded"] == {"flash_attn_func": func_guarded, "flash_attn_varlen_func": True}
    said = [e for e in got["events"] if e[1] == "signature_unrecognised"]
    if func_guarded:
        assert said == []
    else:
        assert said == [["observed", "signature_unrecognised", "flash_attn.flash_attn_func"]]


def test_a_newer_xformers_signature_is_left_alone(xformers_ops):
    """xformers 0.0.35's memory_efficient_attention is the twin's shape (guarded); the same
    function with a parameter the twin does not take, as a newer release might add, is not:
    re-patching leaves it as it is and says so once."""
    import functools

    from attnguard.integrations.xformers import entries as patch_xformers

    fmha = xformers_ops.fmha
    assert hasattr(xformers_ops.memory_efficient_attention, "__attnguard_original__")
    original = xformers_ops.memory_efficient_attention.__attnguard_original__

    @functools.wraps(original)
    def newer(
        query,
        key,
        value,
        attn_bias=None,
        p=0.0,
        scale=None,
        *,
        op=None,
        output_dtype=None,
        window=None,
    ):
        return original(query, key, value, attn_bias, p, scale, op=op, output_dtype=output_dtype)

    del newer.__wrapped__  # its own signature, not the wrapped one's
    patch_xformers.unpatch()
    saved = xformers_ops.memory_efficient_attention, fmha.memory_efficient_attention
    xformers_ops.memory_efficient_attention = fmha.memory_efficient_attention = newer
    try:
        with events.capture() as seen:
            patch_xformers.patch(xformers_ops)
        assert xformers_ops.memory_efficient_attention is newer
        assert fmha.memory_efficient_attention is newer
        said = [(e["event"], e["reason_code"]) for e in seen]
        assert said == [("observed", "signature_unrecognised")]
        assert "window" in seen[0]["reason"]
    finally:
        patch_xformers.unpatch()
        xformers_ops.memory_efficient_attention, fmha.memory_efficient_attention = saved
        patch_xformers.patch(xformers_ops)
