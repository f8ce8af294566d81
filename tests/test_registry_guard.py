"""Call-time guard on transformers' attention registry (every entry, every version).

Real registry functions and real models (tiny random Llama saved and loaded offline). Flash
kernels cannot run on CPU: the flash entry is reached with CPU tensors (rerouted to SDPA before
the kernel) or with "meta" tensors, where the checks see a non-CPU device and the fake kernel
below records what it received.
"""

from __future__ import annotations

import functools
import inspect

import pytest
import torch
from helpers import tensors
from helpers.events import reasons
from helpers.models import save_tiny

import attnguard
from attnguard import callguard
from attnguard.integrations.transformers import attention as transformers_attention
from attnguard.integrations.transformers import interface
from attnguard.kernels import EntryKind
from attnguard.observability import events

transformers = pytest.importorskip("transformers")
from transformers import modeling_utils  # noqa: E402

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
reference = functools.partial(tensors.reference, heads_first=True)  # q, k, v: (B, H, S, D)


def registry() -> dict:
    return interface.registry_mapping(modeling_utils)


class Attn(torch.nn.Module):
    """The attributes registry functions read from a transformers attention module."""

    def __init__(self, dtype=FP32, groups=1, causal=True, impl="sdpa"):
        super().__init__()
        self.q_proj = torch.nn.Linear(8, 8, dtype=dtype)
        self.is_causal = causal
        self.num_key_value_groups = groups
        self.layer_idx = 0
        # transformers' flash path asks the module's config which flash implementation it runs
        self.config = type("Cfg", (), {"_attn_implementation": impl})()


# --- patching -----------------------------------------------------------------------------------


@pytest.mark.smoke
def test_every_entry_is_a_plain_closure_and_unpatch_restores_identity():
    attnguard.deactivate()
    before = dict(registry())
    assert before, "the registry has entries"
    attnguard.activate(log="none")
    try:
        after = registry()
        assert set(after) == set(before)
        for key, fn in after.items():
            assert inspect.isfunction(fn), key  # a plain closure, not a wrapt proxy
            assert fn.__attnguard_original__ is before[key]
            assert fn.__wrapped__ is before[key]  # inspect.signature sees the original's
    finally:
        attnguard.deactivate()
    assert all(registry()[k] is before[k] for k in before)


def test_entries_replaced_by_someone_else_are_left_alone_on_unpatch():
    attnguard.activate(log="none")
    mapping = registry()
    original = mapping["sdpa"].__attnguard_original__

    def theirs(*args, **kwargs):
        return original(*args, **kwargs)

    mapping["sdpa"] = theirs
    try:
        attnguard.deactivate()
        assert mapping["sdpa"] is theirs
    finally:
        mapping["sdpa"] = original


@pytest.mark.skipif(
    not hasattr(modeling_utils, "AttentionInterface"), reason="AttentionInterface is 4.51+"
)
def test_functions_registered_later_are_guarded_and_restored():
    attnguard.activate(log="none")
    interface = modeling_utils.AttentionInterface

    def custom_attention(module, query, key, value, attention_mask, **kwargs):
        return query.transpose(1, 2), None

    try:
        interface.register("attnguard_test_custom", custom_attention)
        guarded = interface._global_mapping["attnguard_test_custom"]
        assert (
            guarded is not custom_attention and guarded.__attnguard_original__ is custom_attention
        )
        assert modeling_utils.ALL_ATTENTION_FUNCTIONS["attnguard_test_custom"] is guarded
        attnguard.deactivate()
        assert interface._global_mapping["attnguard_test_custom"] is custom_attention
        assert "register" not in vars(interface)  # the inherited classmethod is back
    finally:
        attnguard.deactivate()
        interface._global_mapping.pop("attnguard_test_custom", None)


# --- mixed dtypes through each entry ------------------------------------------------------------


def _mixed(heads=2, kv_heads=2, s=6, d=16, seed=0):
    """q, k in float32 (upcast by an fp32 norm/scale), v in bfloat16: the VAR pattern."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, s, d, generator=g)
    k = torch.randn(1, kv_heads, s, d, generator=g)
    v = torch.randn(1, kv_heads, s, d, generator=g).to(BF16)
    return q, k, v


def _check_unified(out, q, k, v, seen, keep):
    want = reference(q, k, v.float(), keep)
    assert out.dtype == BF16, "the dtype the module (bf16 weights) expects next"
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), want, atol=3e-2, rtol=3e-2)
    unified = [e for e in seen if e["event"] == "qkv_unified"]
    assert unified and unified[0]["to"] == "bfloat16" and unified[0]["applied"] is True
    assert unified[0]["from"] == {"query": "float32", "key": "float32", "value": "bfloat16"}


@pytest.mark.smoke
@pytest.mark.parametrize("key", ["sdpa", "flash_attention_2"])
def test_mixed_dtypes_unified_on_sdpa_and_flash(guard, key):
    q, k, v = _mixed(heads=4, kv_heads=2)
    module = Attn(BF16, groups=2, impl=key)
    # unguarded, the call fails (mixed dtypes; for flash, no flash kernel on CPU at all)
    original = registry()[key].__attnguard_original__
    attnguard.deactivate()
    with pytest.raises(Exception):  # noqa: B017
        original(module, q, k, v, None, scaling=None)
    attnguard.activate(log="none")
    with events.capture() as seen:
        out, _ = registry()[key](module, q, k, v, None, dropout=0.0, scaling=None)
    _check_unified(out, q, k, v, seen, torch.ones(6, 6, dtype=torch.bool).tril())


def test_mixed_dtypes_unified_on_flex_attention(guard):
    if "flex_attention" not in registry():
        pytest.skip("no flex_attention entry")
    q, k, v = _mixed(s=16)
    module = Attn(BF16)
    attnguard.deactivate()
    try:  # the entry unguarded, with inputs of one dtype
        registry()["flex_attention"](module, q.to(BF16), k.to(BF16), v, None, scaling=16**-0.5)
    except Exception as exc:
        # transformers <= 4.54 asks flex for return_lse, which torch's CPU inductor does not
        # support: the guarded call (dtypes unified) fails exactly as that, and is not ours
        attnguard.activate(log="none")
        with events.capture() as seen, pytest.raises(type(exc)) as got:
            registry()["flex_attention"](module, q, k, v, None, scaling=16**-0.5)
        assert str(got.value).splitlines()[0] == str(exc).splitlines()[0]
        assert [e["event"] for e in seen] == ["qkv_unified"]
        return
    attnguard.activate(log="none")
    with events.capture() as seen:
        out, _ = registry()["flex_attention"](module, q, k, v, None, scaling=16**-0.5)
    # transformers' flex entry with no block mask attends to every key
    _check_unified(out, q, k, v, seen, None)


class _DuckCache:
    """The part of a paged cache the paged entries touch: update() returns the keys/values it was
    given, in the layout this release's paged entry expects back (through 5.0 a paged cache
    returns [tokens, kv_heads, head_dim], which the entry transposes back)."""

    def __init__(self) -> None:
        import inspect

        from transformers.integrations import eager_paged

        self.flat = "transpose(0, 1).unsqueeze(0)" in inspect.getsource(eager_paged)

    def update(self, key_states=None, value_states=None, layer_idx=None, *args, **kwargs):
        if self.flat:
            return key_states[0].transpose(0, 1), value_states[0].transpose(0, 1)
        return key_states, value_states


@pytest.mark.parametrize("key", ["sdpa_paged", "eager_paged", "paged|eager"])
def test_mixed_dtypes_unified_on_paged_entries(guard, key):
    if key not in registry():
        pytest.skip(f"no {key} entry in this transformers")
    q, k, v = _mixed()
    module = Attn(BF16)
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, 6, 6).masked_fill(~keep, -1e9).to(BF16)  # additive, like eager's
    kwargs = {"scaling": 16**-0.5}
    if key == "paged|eager":
        # as continuous batching calls it (5.0 reads the cache indices from the call's kwargs)
        kwargs.update(cache=_DuckCache(), read_index=None, write_index=None)
    with events.capture() as seen:
        out, _ = registry()[key](module, q, k, v, mask, **kwargs)
    _check_unified(out, q, k, v, seen, keep)


def test_float_mask_of_another_half_dtype_is_cast(guard):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g).to(BF16) for _ in range(3))
    keep = torch.ones(5, 5, dtype=torch.bool).tril()
    mask = torch.zeros(1, 1, 5, 5, dtype=FP16).masked_fill(~keep, -1e4)
    with events.capture() as seen:
        out, _ = registry()["sdpa"](Attn(BF16), q, k, v, mask, scaling=None)
    torch.testing.assert_close(out.double(), reference(q, k, v, keep), atol=2e-2, rtol=2e-2)
    assert reasons(seen) == [("qkv_unified", "mask_dtype")]


# --- flash entry: what the kernel cannot take -> SDPA --------------------------------------------


def _flash_entry_with_fake_kernel():
    """The flash entry's guard around a fake kernel that records the dtype it was given (in place
    of transformers' flash code path: the entry is guarded as that path would be)."""
    got = []

    def kernel(module, query, key, value, attention_mask, **kwargs):
        got.append(query.dtype)
        return torch.zeros_like(query).transpose(1, 2), None

    flash = EntryKind.REGISTRY_FLASH
    return transformers_attention.wrap_registry_entry("flash_attention_2", kernel, flash), got


@pytest.mark.smoke
@pytest.mark.parametrize(
    ("reason", "shape", "mask", "kwargs"),
    [
        ("mask_4d", (1, 2, 4, 16), "4d", {}),
        ("output_attentions", (1, 2, 4, 16), None, {"output_attentions": True}),
    ],
)
def test_flash_cannot_take_is_rerouted_with_reason(guard, reason, shape, mask, kwargs):
    """What transformers' flash code path itself cannot take goes to the registry twin."""
    fn, got = _flash_entry_with_fake_kernel()
    q = torch.empty(shape, dtype=BF16, device="meta")
    m = torch.ones(1, 1, 4, 4, dtype=torch.bool, device="meta") if mask == "4d" else None
    with events.capture() as seen:
        out, _ = fn(Attn(BF16), q, q, q, m, scaling=None, **kwargs)
    assert got == []  # the flash path never ran
    assert out.shape == (shape[0], shape[2], shape[1], shape[3])
    assert [(e["event"], e["reason_code"], e["selected"]) for e in seen] == [
        ("backend_rerouted", reason, "sdpa_twin")
    ]


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_flash_entry_leaves_kernel_questions_to_the_kernel(guard, dtype):
    """CPU tensors, float32 or a head_dim above 256 are questions for the flash-attn kernel
    (its guarded functions, or the SDPA twins under transformers' flash path), not for the
    registry entry: the flash path runs as transformers wrote it."""
    fn, got = _flash_entry_with_fake_kernel()
    q = torch.randn(1, 2, 4, 320).to(dtype)
    with events.capture() as seen:
        fn(Attn(dtype), q, q, q, None, scaling=None)
    assert got == [dtype] and seen == []


def test_flash_entry_in_float32_on_the_twins_matches_the_reference(guard):
    """A float32 model on the flash path where flash-attn cannot run (here: no CUDA): the
    twins compute in float32, as the caller's dtype says, with flash's causal mask."""
    fn = registry()["flash_attention_2"]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 4, 5, 8, generator=g) for _ in range(3))
    with events.capture() as seen:
        out, _ = fn(Attn(FP32, impl="flash_attention_2"), q, k, v, None, scaling=None)
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    assert out.dtype == FP32
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), atol=1e-5, rtol=1e-5)
    assert [e["event"] for e in seen if e["event"] != "backend_fallback"] == []


def test_devices_aligned_to_the_query(guard):
    # The fast path compares get_device() (CPU and meta are both -1: CUDA vs CPU and cuda:0 vs
    # cuda:1 are told apart, see tests/gpu); the mixed dtype sends this call to the slow path.
    fn, got = _flash_entry_with_fake_kernel()
    q = torch.empty(1, 2, 4, 16, dtype=BF16, device="meta")
    k = torch.zeros(1, 2, 4, 16, dtype=FP32)  # on CPU, in float32
    with events.capture() as seen:
        fn(Attn(BF16), q, k, q, None, scaling=None)
    assert got == [BF16]
    assert [(e["event"], e.get("moved")) for e in seen] == [
        ("tensors_aligned", {"key": "cpu"}),
        ("qkv_unified", None),
    ]


def test_flash_reroute_numerics_4d_mask_weights_and_window(guard):
    fn = registry()["flash_attention_2"]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    module = Attn()
    keep = torch.rand(2, 1, 6, 6, generator=g) > 0.3
    keep[..., 0] = True
    out, _ = fn(module, q, k, v, keep, scaling=None)  # a 4D mask is used as it is
    torch.testing.assert_close(out.double(), reference(q, k, v, keep), atol=1e-5, rtol=1e-5)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    out, weights = fn(module, q, k, v, None, scaling=None, output_attentions=True)
    torch.testing.assert_close(out.double(), reference(q, k, v, causal), atol=1e-5, rtol=1e-5)
    assert weights is not None and weights.shape == (2, 2, 6, 6)
    assert bool((weights.masked_select(~causal) == 0).all())


def test_flash_path_sliding_window_is_the_one_flash_gets_on_this_release(guard):
    """transformers turns ``sliding_window=w`` into flash's window_size (w, w) on 4.49-4.5x
    and (w - 1, w - 1) later: the twins under its flash path compute exactly what flash would."""
    from workers.semantics_worker import flash_window_left

    fn = registry()["flash_attention_2"]
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    left = flash_window_left(3)
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    window = (j <= i) & (i - j <= left)
    out, _ = fn(Attn(impl="flash_attention_2"), q, k, v, None, scaling=None, sliding_window=3)
    torch.testing.assert_close(out.double(), reference(q, k, v, window), atol=1e-5, rtol=1e-5)


def test_reroutes_are_counted_per_call_and_said_once(guard):
    fn = registry()["flash_attention_2"]
    q = torch.randn(1, 2, 4, 8)
    with events.capture() as seen:
        for _ in range(3):
            fn(Attn(), q, q, q, None, scaling=None, output_attentions=True)
    assert [e["event"] for e in seen] == ["backend_rerouted"]
    site = "transformers.flash_attention_2:Attn"
    assert events.counts()[("backend_rerouted", site, "output_attentions")] == 3
    assert not callguard.latched  # a per-call reason: the next call may take the kernel again


# --- a real model: flash -> SDPA reroute with a padded batch -----------------------------------


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    return save_tiny(
        path, vocab_size=64, hidden_size=32, intermediate_size=64, max_position_embeddings=64
    )


def _load(path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def _as_flash(model):
    """A model that builds flash-format masks and calls the flash registry entry.

    transformers refuses attn_implementation="flash_attention_2" on a machine without CUDA, at
    every entry point (from_pretrained, from_config, set_attn_implementation). The property
    setter ``config._attn_implementation`` (4.49 to 5.x) is read at every forward, both by the
    mask builder (2D padding mask for flash) and by the attention layers (registry lookup).
    """
    model.config._attn_implementation = "flash_attention_2"
    return model


@pytest.mark.smoke
def test_padded_batch_on_the_flash_path_matches_sdpa(guard, tiny_llama_dir):
    plain = _load(tiny_llama_dir)
    flash = _as_flash(_load(tiny_llama_dir))
    ids = torch.randint(3, 64, (3, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding
    mask[1, :1] = 0
    ids[mask == 0] = 0
    with torch.no_grad(), events.capture() as seen:
        want = plain(input_ids=ids, attention_mask=mask).logits
        got = flash(input_ids=ids, attention_mask=mask).logits
        gen_want = plain.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0
        )
        gen_got = flash.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0
        )
    real = mask.bool()
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(gen_got, gen_want)
    # no load-time decision covered this model (its config was switched by hand): the flash
    # path's kernels say once that the SDPA twins compute them
    said = [(e["event"], e["site"]) for e in seen]
    assert said == [("backend_fallback", "transformers.flash_kernels")], seen
    attnguard.deactivate()
    with torch.no_grad(), pytest.raises(Exception):  # noqa: B017 - the unguarded flash call fails
        flash(input_ids=ids, attention_mask=mask)
