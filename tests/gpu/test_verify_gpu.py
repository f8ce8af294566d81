"""The opt-in numbers check (``ATTNGUARD_VERIFY``) on a CUDA GPU with the REAL flash-attn 2.8.3.

* The real kernel over a training run (forward, backward, AdamW; plain and left-padded batches,
  a sliding window model) and over ``generate``, every call checked: 0 mismatches.
* The real ``flash_attn_func`` / ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache`` over a
  few hundred random calls (bf16 and fp16, GQA, causal, windows, softcap, ALiBi, packed rows,
  caches), every call checked against its twin in float32: 0 mismatches.
* attnguard's twins computing (the kernel latched after a known error), checked against the
  explicit float64 reference: 0 mismatches.
* A wrapper that gives the kernel a window one key wider: caught on every call it moves.
* A call during CUDA graph capture: skipped and counted, the graph replays the kernel's numbers.

flash_attn is the real package from $TEST_REAL_FLASH_ATTN_DIR (scripts/gpu_suite.sh sets it);
without it the tests skip with the reason. Run this file in its own pytest process:

    TEST_REAL_FLASH_ATTN_DIR=/tmp/flashsite pytest -m gpu tests/gpu/test_verify_gpu.py
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

import gpuenv  # noqa: E402

import attnguard  # noqa: E402
from attnguard import callguard, kernels, runtime, verify  # noqa: E402
from attnguard.fallback import FLASH_FUNCTIONS  # noqa: E402
from attnguard.kernel_identity import Family  # noqa: E402
from attnguard.observability import events, numerics  # noqa: E402

if torch.cuda.is_available():
    gpuenv.put_on_sys_path()  # before transformers caches flash-attn's availability

CUDA = "cuda"
HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def real_flash() -> Any:
    package = gpuenv.import_in_process()
    from transformers.utils import is_flash_attn_2_available

    if not is_flash_attn_2_available():
        pytest.skip("transformers decided flash-attn is unavailable: run this file alone")
    return package


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    verify.reset()
    callguard.reset_latches()
    events.reset_counts()
    yield
    attnguard.deactivate()
    verify.reset()
    callguard.reset_latches()


def _mismatches(captured: list[dict[str, Any]]) -> list[str]:
    return [e["reason"] for e in captured if e["event"] in ("numerics_mismatch", "internal_error")]


def _model(window: int | None = None) -> Any:
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        use_sliding_window=window is not None,
        sliding_window=window or 4096,
        max_window_layers=0,
        attn_implementation="flash_attention_2",
    )
    torch.manual_seed(0)
    with torch.device(CUDA):
        return transformers.Qwen2ForCausalLM(config).to(torch.bfloat16)


@pytest.mark.parametrize("window", [None, 64], ids=["full", "sliding-window"])
def test_training_and_generate_on_the_real_kernel_match_their_reference(
    real_flash: Any, window: int | None, captured: list[dict[str, Any]]
) -> None:
    attnguard.activate(log="none", verify="all")
    model = _model(window).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator(device=CUDA).manual_seed(0)
    ids = torch.randint(3, 1024, (4, 512), device=CUDA, generator=g)
    mask = torch.ones_like(ids)
    mask[0, :100] = 0  # left padding: the flash path's varlen calls
    for step in range(3):
        kw = {"attention_mask": mask} if step % 2 else {}
        loss = model(input_ids=ids, labels=ids, **kw).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        out = model.generate(ids[:1, :256], max_new_tokens=32, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 256 + 32
    counts = numerics.snapshot()
    assert counts["checked"] >= 4 * (3 + 32) and counts["mismatched"] == 0, counts
    assert set(counts["skipped"]) <= {"dropout"}, counts
    assert _mismatches(captured) == []


def _rand(rng: random.Random, *shape: int, dtype: torch.dtype, mult: float = 1.0) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(rng.randrange(1 << 30))
    return (torch.randn(*shape, device=CUDA, generator=g) * mult).to(dtype)


def _random_calls(rng: random.Random, fi: Any, n: int) -> None:
    for _ in range(n):
        dtype = rng.choice(HALF)
        d, hk = rng.choice([64, 128, 256]), rng.choice([1, 2, 8])
        h, b = hk * rng.choice([1, 2, 4]), rng.choice([1, 2, 4])
        sq = rng.choice([1, 7, 128, 1000])
        sk = rng.choice([64, 333, 2048]) if rng.random() < 0.4 else sq
        mult = rng.choice([1.0, 4.0])
        kw: dict[str, Any] = {
            "causal": rng.random() < 0.5,
            "window_size": rng.choice([(-1, -1), (-1, -1), (128, -1), (32, 0), (16, 16)]),
            "softcap": rng.choice([0.0, 0.0, 30.0]),
        }
        if rng.random() < 0.15:
            kw["alibi_slopes"] = torch.rand(h, device=CUDA) * 0.2
        q = _rand(rng, b, sq, h, d, dtype=dtype, mult=mult)
        k = _rand(rng, b, sk, hk, d, dtype=dtype, mult=mult)
        v = _rand(rng, b, sk, hk, d, dtype=dtype)
        kind = rng.choice(["func", "varlen", "kvcache"])
        if kind == "func":
            fi.flash_attn_func(q, k, v, **kw)
        elif kind == "varlen":
            lens = [rng.randint(1, sq) for _ in range(b)]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
            cu = cu.to(CUDA)
            qp = q.reshape(-1, h, d)[: sum(lens)]
            kp, vp = (x.reshape(-1, hk, d)[: sum(lens)] for x in (k, v))
            if sk == sq:
                fi.flash_attn_varlen_func(qp, kp, vp, cu, cu, max(lens), max(lens), **kw)
        else:
            cache_k = torch.zeros(b, sk + 16, hk, d, device=CUDA, dtype=dtype)
            cache_v = torch.zeros_like(cache_k)
            cache_k[:, :sk], cache_v[:, :sk] = k, v
            lens = torch.tensor([rng.randint(0, sk) for _ in range(b)], dtype=torch.int32)
            kn, vn = (_rand(rng, b, 1, hk, d, dtype=dtype) for _ in range(2))
            fi.flash_attn_with_kvcache(
                q[:, :1], cache_k, cache_v, kn, vn, cache_seqlens=lens.to(CUDA), **kw
            )


def test_the_real_kernels_random_calls_match_their_twins(
    real_flash: Any, captured: list[dict[str, Any]]
) -> None:
    attnguard.activate(log="none", verify="all")
    import flash_attn.flash_attn_interface as fi

    _random_calls(random.Random(0), fi, 300)
    counts = numerics.snapshot()
    assert counts["checked"] >= 250 and counts["mismatched"] == 0, counts
    assert _mismatches(captured) == []


def test_the_twins_computing_match_the_explicit_reference(captured: list[dict[str, Any]]) -> None:
    """The kernel fails with a known error at its first call: the twin computes that call and,
    the site latched, every later one; each is checked against the explicit float64 attention."""
    attnguard.activate(log="none", verify="all")
    twin = FLASH_FUNCTIONS["flash_attn_func"]

    def old_gpu(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("FlashAttention only supports Ampere GPUs or newer.")

    old_gpu.__signature__ = __import__("inspect").signature(twin)  # type: ignore[attr-defined]
    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        old_gpu,
        tensors=("q", "k", "v"),
        twin=twin,
        site="flash_attn.flash_attn_func",
        aux=("alibi_slopes",),
        head_axis=3,
        in_force=runtime.IN_FORCE,
        family=Family.FA2,
    )
    guarded = callguard.wrap_direct(entry)

    class Twins:
        flash_attn_func = staticmethod(guarded)
        flash_attn_varlen_func = staticmethod(FLASH_FUNCTIONS["flash_attn_varlen_func"])
        flash_attn_with_kvcache = staticmethod(FLASH_FUNCTIONS["flash_attn_with_kvcache"])

    rng = random.Random(1)
    for _ in range(40):
        _random_calls(rng, Twins, 1)
    counts = numerics.snapshot()
    assert counts["checked"] >= 5 and counts["mismatched"] == 0, counts
    assert _mismatches(captured) == []


def test_a_window_one_key_wider_is_caught(real_flash: Any, captured: list[dict[str, Any]]) -> None:
    import flash_attn.flash_attn_interface as fi

    original = getattr(fi.flash_attn_func, "__attnguard_original__", fi.flash_attn_func)

    def wider(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
              softcap=0.0, alibi_slopes=None, deterministic=False,
              return_attn_probs=False):  # fmt: skip
        left, right = window_size
        return original(q, k, v, dropout_p, softmax_scale, causal, (left + 1, right), softcap)

    attnguard.activate(log="none", verify="all")
    entry = callguard.Entry(
        "flash_attn_func",
        kernels.EntryKind.FLASH_KERNEL,
        wider,
        tensors=("q", "k", "v"),
        twin=FLASH_FUNCTIONS["flash_attn_func"],
        site="flash_attn.flash_attn_func",
        head_axis=3,
        in_force=runtime.IN_FORCE,
        family=Family.FA2,
    )
    guarded = callguard.wrap_direct(entry)
    rng = random.Random(2)
    for _ in range(10):
        q, k, v = (_rand(rng, 2, 512, 8, 128, dtype=torch.bfloat16) for _ in range(3))
        guarded(q, k, v, causal=True, window_size=(8, 0))
    assert numerics.snapshot()["mismatched"] == 10
    (said,) = [e for e in captured if e["event"] == "numerics_mismatch"]
    assert said["reason_code"] == "kernel_numbers_differ"


def test_cuda_graph_capture_is_skipped_and_replays_the_kernels_numbers(real_flash: Any) -> None:
    import flash_attn

    attnguard.activate(log="none", verify="all")
    q, k, v = (torch.randn(1, 128, 8, 64, device=CUDA, dtype=torch.bfloat16) for _ in range(3))
    want = flash_attn.flash_attn_func(q, k, v, causal=True)  # checked, eagerly
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        flash_attn.flash_attn_func(q, k, v, causal=True)  # warm-up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flash_attn.flash_attn_func(q, k, v, causal=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert numerics.snapshot()["skipped"] == {"cuda_graph_capture": 1}
    assert numerics.snapshot()["mismatched"] == 0
