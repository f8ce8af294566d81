"""Call-time guard on a CUDA GPU (H100/H200; torch 2.11, transformers 5.x) with the REAL
flash-attn 2.8.3 kernel.

flash_attn is the real package with its CUDA extension, from $TEST_REAL_FLASH_ATTN_DIR (the
unpacked wheel; scripts/gpu_suite.sh sets it). It goes first on sys.path when
this module is imported, before transformers first asks whether flash-attn is available (it
caches the answer): run this file in its own pytest process, as the suite does. Without the
variable, or when ``import flash_attn_2_cuda`` fails there, the flash tests skip with the reason.
xformers is the PyPI wheel, imported with flash-attn hidden (the image as shipped has none): its
own CUDA ops do not load next to this torch, and the guard's SDPA twin must carry its calls.

Run: TEST_REAL_FLASH_ATTN_DIR=/tmp/flashsite PYTHONPATH=.[:<xformers target dir>] \
     pytest -m gpu tests/gpu/test_call_gpu.py
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

import gpuenv  # noqa: E402
from helpers.events import reasons  # noqa: E402
from helpers.models import save_tiny  # noqa: E402
from helpers.tensors import flash_keep, qkv, reference  # noqa: E402

import attnguard  # noqa: E402
from attnguard.observability import events  # noqa: E402

if torch.cuda.is_available():
    gpuenv.put_on_sys_path()  # before transformers caches flash-attn's availability (no import)

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
CUDA = "cuda"
FLASH_MSG = {
    "fp32": "FlashAttention only support fp16 and bf16 data type",
    "mixed": "query and value must have the same dtype",
    "head_dim": "FlashAttention forward only supports head dimension at most 256",
}
_qkv = functools.partial(qkv, sq=64, hk=2, d=64, dtypes=(FP32, FP32, BF16), device=CUDA)


@pytest.fixture(scope="module")
def real_flash():
    """The real flash_attn package (its CUDA extension imported), or skip with the reason."""
    package = gpuenv.import_in_process()
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        pytest.skip(
            "transformers decided flash-attn is unavailable before the real package was on "
            "sys.path: run this file in its own pytest process"
        )
    return package


# --- the real flash_attn called directly ---------------------------------------------------------


def test_real_kernel_refuses_what_the_guard_carries(real_flash):
    """Unguarded, the real kernel raises on the calls the tests below hand to the guard."""
    assert not getattr(real_flash, "IS_ATTNGUARD_STANDIN", False)
    attnguard.deactivate()
    q, k, v = _qkv(dtypes=(FP32, FP32, FP32))
    with pytest.raises(RuntimeError, match=FLASH_MSG["fp32"]):
        real_flash.flash_attn_func(q, k, v)
    q, k, v = _qkv(dtypes=(BF16, BF16, FP16))
    with pytest.raises(RuntimeError, match=FLASH_MSG["mixed"]):
        real_flash.flash_attn_func(q, k, v)
    q, k, v = _qkv(d=512, dtypes=(BF16, BF16, BF16))
    with pytest.raises(RuntimeError, match=FLASH_MSG["head_dim"]):
        real_flash.flash_attn_func(q, k, v)


def test_flash_fp32_cast_for_the_kernel_and_back(real_flash, guard):
    from flash_attn import flash_attn_func

    q, k, v = _qkv(dtypes=(FP32, FP32, FP32))
    with events.capture() as seen:
        out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == FP32
    torch.testing.assert_close(
        out.double(), reference(q, k, v, flash_keep(64, 64, True)), atol=2e-2, rtol=2e-2
    )
    assert reasons(seen) == [("qkv_unified", "fp32_into_flash")]
    assert seen[0]["to"] == "bfloat16"  # native bf16 on sm80+


def test_flash_mixed_dtypes_unified_and_run_by_the_kernel(real_flash, guard):
    from flash_attn import flash_attn_func

    q, k, v = _qkv()
    with events.capture() as seen:
        out = flash_attn_func(q, k, v, causal=True)
    assert out.dtype == BF16
    want = reference(q, k, v.float(), flash_keep(64, 64, True))
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    assert reasons(seen) == [("qkv_unified", "mixed_dtypes")]  # no reroute: the kernel ran


def test_flash_head_dim_512_rerouted(real_flash, guard):
    from flash_attn import flash_attn_func

    q, k, v = _qkv(d=512, dtypes=(BF16, BF16, BF16))
    with events.capture() as seen:
        out = flash_attn_func(q, k, v, causal=True)
    torch.testing.assert_close(
        out.double(), reference(q, k, v, flash_keep(64, 64, True)), atol=2e-2, rtol=2e-2
    )
    assert reasons(seen) == [("backend_rerouted", "head_dim_unsupported")]


def test_flash_varlen_on_gpu(real_flash, guard):
    from flash_attn import flash_attn_varlen_func

    g = torch.Generator(device=CUDA).manual_seed(1)
    q = torch.randn(40, 4, 64, device=CUDA, generator=g)  # float32: cast for the kernel
    k = torch.randn(40, 2, 64, device=CUDA, generator=g)
    v = torch.randn(40, 2, 64, device=CUDA, generator=g)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=CUDA)
    out = flash_attn_varlen_func(q, k, v, cu, cu, 25, 25, causal=True)
    assert out.dtype == FP32
    for a, b in ((0, 15), (15, 40)):
        want = reference(q[None, a:b], k[None, a:b], v[None, a:b], flash_keep(b - a, b - a, True))
        torch.testing.assert_close(out[None, a:b].double(), want, atol=2e-2, rtol=2e-2)


def test_devices_aligned_on_gpu(real_flash, guard):
    from flash_attn import flash_attn_func

    q, k, v = _qkv(dtypes=(BF16, BF16, BF16))
    with events.capture() as seen:
        out = flash_attn_func(q, k.cpu(), v, causal=True)
    torch.testing.assert_close(
        out.double(), reference(q, k, v, flash_keep(64, 64, True)), atol=2e-2, rtol=2e-2
    )
    assert reasons(seen) == [("tensors_aligned", "device_mismatch")]


@pytest.mark.multigpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_devices_aligned_across_gpus(real_flash, guard):
    from flash_attn import flash_attn_func

    q, k, v = _qkv(dtypes=(BF16, BF16, BF16))
    with events.capture() as seen:
        out = flash_attn_func(q, k.to("cuda:1"), v, causal=True)
    assert out.device == q.device
    assert reasons(seen) == [("tensors_aligned", "device_mismatch")]


# --- transformers registry with a real model ----------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_gpu")
    return save_tiny(path, hidden_size=128, intermediate_size=256, max_position_embeddings=256)


def _model(path, impl, dtype):
    """Built with sdpa, then switched (config._attn_implementation), so the load-time guard
    stays out of this test: what runs is the call-time guard alone."""
    from packaging.version import Version
    from transformers import LlamaForCausalLM
    from transformers import __version__ as tf_version

    key = "dtype" if Version(tf_version) >= Version("4.56") else "torch_dtype"
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa", **{key: dtype})
    model = model.to(CUDA).eval()
    model.config._attn_implementation = impl
    return model


def _padded_batch():
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 128, (3, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    mask[1, :2] = 0
    ids[mask == 0] = 0
    return ids.to(CUDA), mask.to(CUDA)


def test_flash_model_on_the_real_kernel_matches_sdpa(real_flash, guard, tiny_llama_dir):
    ids, mask = _padded_batch()
    plain = _model(tiny_llama_dir, "sdpa", BF16)
    flash = _model(tiny_llama_dir, "flash_attention_2", BF16)
    with torch.no_grad(), events.capture() as seen:
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = flash(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real].float(), want[real].float(), atol=5e-2, rtol=5e-2)
    assert seen == []  # nothing wrong: the fast path ran the real kernel


def test_flash_model_in_fp32_runs_through_cast(real_flash, guard, tiny_llama_dir):
    ids, mask = _padded_batch()
    plain = _model(tiny_llama_dir, "sdpa", FP32)
    flash = _model(tiny_llama_dir, "flash_attention_2", FP32)
    attnguard.deactivate()
    with torch.no_grad(), pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        flash(input_ids=ids, attention_mask=mask)  # the real kernel refuses float32
    attnguard.activate(log="none")
    with torch.no_grad(), events.capture() as seen:
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = flash(input_ids=ids, attention_mask=mask).logits
        gen_want = plain.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False
        )
        gen_got = flash.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False
        )
    assert got.dtype == FP32
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=5e-2, rtol=5e-2)
    assert gen_got.shape == gen_want.shape
    assert ("qkv_unified", "fp32_into_flash") in reasons(seen)


@pytest.mark.parametrize("impl", ["sdpa", "flash_attention_2"])
def test_mixed_dtypes_through_registry_entries(guard, tiny_llama_dir, impl, request):
    if impl == "flash_attention_2":
        request.getfixturevalue("real_flash")
    from transformers import modeling_utils

    from attnguard.integrations.transformers.interface import registry_mapping

    fn = registry_mapping(modeling_utils)[impl]
    layer = _model(tiny_llama_dir, impl, BF16).model.layers[0].self_attn
    g = torch.Generator(device=CUDA).manual_seed(4)
    q = torch.randn(2, 4, 32, 32, device=CUDA, generator=g)  # float32 (an fp32 norm upcast it)
    k = torch.randn(2, 2, 32, 32, device=CUDA, generator=g)
    v = torch.randn(2, 2, 32, 32, device=CUDA, generator=g).to(BF16)
    with events.capture() as seen:
        out, _ = fn(layer, q, k, v, None, scaling=None)
    assert out.dtype == BF16
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    want = reference(t(q), t(k), t(v).float(), flash_keep(32, 32, True))
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    assert reasons(seen) == [("qkv_unified", "mixed_dtypes")]  # the kernel itself ran


def test_flash_registry_output_attentions_rerouted(real_flash, guard, tiny_llama_dir):
    from transformers import modeling_utils

    from attnguard.integrations.transformers.interface import registry_mapping

    fn = registry_mapping(modeling_utils)["flash_attention_2"]
    model = _model(tiny_llama_dir, "flash_attention_2", BF16)
    layer = model.model.layers[0].self_attn
    g = torch.Generator(device=CUDA).manual_seed(2)
    q, k, v = (torch.randn(1, 4, 16, 32, device=CUDA, generator=g).to(BF16) for _ in range(3))
    with events.capture() as seen:
        out, weights = fn(layer, q, k[:, :2], v[:, :2], None, scaling=None, output_attentions=True)
    assert weights is not None and weights.shape == (1, 4, 16, 16)
    want = reference(
        q.transpose(1, 2),
        k[:, :2].transpose(1, 2),
        v[:, :2].transpose(1, 2),
        flash_keep(16, 16, True),
    )
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    assert reasons(seen) == [("backend_rerouted", "output_attentions")]


def test_sdpa_no_available_kernel_recovered(guard):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import modeling_utils

    from attnguard.integrations.transformers.interface import registry_mapping

    fn = registry_mapping(modeling_utils)["sdpa"]
    module = torch.nn.Linear(4, 4).to(CUDA)
    module.is_causal = True
    g = torch.Generator(device=CUDA).manual_seed(3)
    q, k, v = (torch.randn(1, 2, 32, 64, device=CUDA, generator=g) for _ in range(3))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), events.capture() as seen:  # no fp32 flash
        out, _ = fn(module, q, k, v, None, scaling=None)
    want = reference(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), flash_keep(32, 32, True)
    )
    torch.testing.assert_close(out.double(), want, atol=1e-4, rtol=1e-4)
    assert reasons(seen) == [("kernel_error_recovered", "no_sdpa_kernel")]


def test_compiled_flash_model_has_no_graph_breaks(real_flash, guard, tiny_llama_dir):
    model = _model(tiny_llama_dir, "flash_attention_2", BF16)
    ids = torch.randint(3, 128, (2, 32), device=CUDA)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    torch._dynamo.reset()


# --- xformers on the GPU image: its CUDA ops do not load next to this torch -----------------------


@pytest.fixture
def xformers_ops():
    """xformers imported as on the GPU image as shipped, with no flash-attn: the real package
    (if this file put it on sys.path) is hidden meanwhile, since xformers binds flash-attn's CUDA
    extension for its flash operator when it finds one. Its own CUDA ops do not load next to
    torch 2.11: the "xformers unusable" case."""
    hidden = [p for p in sys.path if gpuenv.holds_flash(p)]
    for p in hidden:
        sys.path.remove(p)
    saved = {m: sys.modules.pop(m) for m in list(sys.modules) if m.split(".")[0] == "flash_attn"}
    try:
        ops = pytest.importorskip("xformers.ops")
    finally:
        sys.path[:0] = hidden
        sys.modules.update(saved)
    attnguard.deactivate()  # re-activating patches xformers whatever its import order
    attnguard.activate(log="none")
    return ops


def test_xformers_broken_ops_carried_by_the_fallback(guard, xformers_ops):
    xops = xformers_ops
    from xformers.ops import fmha

    q, k, v = _qkv(b=1, sq=48, h=4, hk=4, d=64, dtypes=(FP32, FP32, FP16))
    bias = fmha.attn_bias.LowerTriangularMask()
    with events.capture() as seen:
        out = xops.memory_efficient_attention(q, k, v, attn_bias=bias)
        again = xops.memory_efficient_attention(q, k, v, attn_bias=bias)
    keep = flash_keep(48, 48, True)
    want = reference(q, k, v.float(), keep)
    assert out.dtype == FP16
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(again, out)
    got = reasons(seen)
    assert got[0] == ("qkv_unified", "mixed_dtypes")
    # Either the ops loaded and ran, or they did not and the twin carried the call: recovered
    # once, then the site's next call goes straight to the twin (counted per call)
    assert got[1:] in (
        [],
        [
            ("kernel_error_recovered", "xformers_no_operator"),
            ("backend_rerouted", "xformers_no_operator"),
        ],
    )


@pytest.mark.parametrize("backend", ["flash", "xformers"])
def test_var_attention_on_gpu(guard, backend, request):
    request.getfixturevalue("xformers_ops" if backend == "xformers" else "real_flash")
    from helpers.modules import VARSelfAttention

    torch.manual_seed(0)
    attn = VARSelfAttention(backend).to(CUDA).eval()
    g = torch.Generator(device=CUDA).manual_seed(11)
    x = torch.randn(2, 16, 32, device=CUDA, generator=g).to(BF16)
    with torch.no_grad(), events.capture() as seen:
        out = attn(x)
        want = attn.reference(x)
    assert out.dtype == BF16 and not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), want, atol=5e-2, rtol=5e-2)
    assert ("qkv_unified", "mixed_dtypes") in reasons(seen)
