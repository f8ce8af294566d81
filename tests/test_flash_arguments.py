"""What reaches transformers' flash path is computed, or attnguard steps aside: never dropped.

flash_attention_2 is requested where flash-attn is missing (this CPU machine), so attnguard's
twins serve transformers' flash path. transformers hands a kernel only the arguments its
signature declares and drops the rest; an argument the twins do not compute would be dropped
silently. Recognised by shape (the flash path's own parameters and name maps, the twins'
signatures, the value a call carries), never by model name:

* at call time, a registry call from an attention class whose code passes such an argument
  fails with the requested kernel's own error, and one event names the argument; flags
  (``use_cache=False``), the arguments every model threads through, and tensors a model's
  forward only passes on in ``**kwargs`` run as before;
* at load time, a model whose flash request transformers itself routes to another kernel
  (``_compatible_flash_implementations``) and whose attention passes such an argument is left to
  transformers: its own error, plus one event naming the argument and the kernel;
* model modules that import the flash path only where flash-attn was installed when they were
  imported (Falcon, GPT-Neo) run on the twins instead of failing with a NameError at their first
  forward.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch
import transformers
from conftest import tiny_config

import attnguard
from attnguard import events

FLASH = "flash_attention_2"


@pytest.fixture
def guard() -> Any:
    attnguard.activate(log="none")
    events.reset_counts()
    yield
    attnguard.deactivate()


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(tiny_config("llama")).save_pretrained(path)
    return path


def _registry() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[FLASH]


def _kernel_error() -> BaseException:
    try:
        importlib.import_module("flash_attn")
    except Exception as exc:
        return exc
    pytest.skip("flash-attn imports here")


def test_an_argument_the_twins_do_not_compute_is_never_dropped(guard: Any, tmp_path: Any) -> None:
    """An attention class that hands the registry's flash entry an argument of its own
    (``block_scores``): the twins would never see it (transformers' flash path has no such
    parameter). Its forward fails with flash_attention_2's own error, and one event names the
    argument, not one per call."""
    torch.manual_seed(0)
    BiasedLlama(tiny_config("llama")).save_pretrained(tmp_path)
    model = BiasedLlama.from_pretrained(tmp_path, attn_implementation=FLASH)
    want = _kernel_error()
    ids = torch.tensor([[5, 6, 7, 8]])
    with events.capture() as seen:
        for _ in range(2):
            with pytest.raises(type(want)) as raised, torch.no_grad():
                model(input_ids=ids)
            assert str(raised.value) == str(want)
    said = [e for e in seen if e["event"] != "activated"]
    assert [(e["event"], e["reason_code"]) for e in said] == [
        ("observed", "flash_argument_uncomputed")
    ]
    assert said[0]["arguments"] == ["block_scores"] and "block_scores" in said[0]["reason"]


def test_arguments_threaded_through_to_attention_run_as_before(guard: Any, llama: Any) -> None:
    """A tensor the model's forward only threads through ``**kwargs`` (as vision towers pass
    ``grid_thw``) is dropped by every attention implementation alike: it runs, as without the
    extra argument, and flags (``use_cache=False``) too."""
    model = transformers.LlamaForCausalLM.from_pretrained(llama, attn_implementation=FLASH)
    ids = torch.tensor([[5, 6, 7, 8]])
    with events.capture() as seen, torch.no_grad():
        plain = model(input_ids=ids, use_cache=False).logits
        extra = model(input_ids=ids, use_cache=False, grid_thw=torch.tensor([[1, 2, 2]])).logits
    torch.testing.assert_close(extra, plain)
    assert [e for e in seen if e["reason_code"] == "flash_argument_uncomputed"] == []


def test_the_twins_sinks_are_arguments_they_compute(guard: Any, llama: Any) -> None:
    """``s_aux`` (attention sinks) reaches the twins and is computed: no step aside."""
    model = transformers.LlamaForCausalLM.from_pretrained(llama, attn_implementation=FLASH)
    attn = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 5, 16, generator=g), torch.randn(1, 2, 5, 16, generator=g)
    sinks = torch.randn(4, generator=g)
    plain, _ = _registry()(attn, q, k, k, None, dropout=0.0)
    with_sinks, _ = _registry()(attn, q, k, k, None, dropout=0.0, s_aux=sinks)
    assert (plain - with_sinks).abs().max() > 1e-3


# --- a model class transformers routes to another kernel ----------------------------------------


class _BiasedAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """Attention that hands the registry function an argument of its own (as a model written for
    a kernel that takes one would)."""

    def forward(self, hidden_states: Any, position_embeddings: Any, attention_mask: Any, **kw: Any):  # type: ignore[override]
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        interface = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS
        attention_interface = interface[self.config._attn_implementation]
        out, weights = attention_interface(
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling,
            block_scores=torch.zeros(q.shape[-2]),
        )  # fmt: skip
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


class BiasedLlama(transformers.LlamaForCausalLM):
    """A Llama whose attention passes an argument of its own (custom model code)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = _BiasedAttention(config, i)


class RoutedLlama(transformers.LlamaForCausalLM):
    """A Llama whose authors list the one flash kernel it works with."""

    _compatible_flash_implementations = ["kernels-community/block-sparse-attention"]

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = _BiasedAttention(config, i)


@pytest.mark.skipif(
    not hasattr(transformers.PreTrainedModel, "_compatible_flash_implementations"),
    reason="this transformers release routes no flash request by model class",
)
def test_a_model_routed_elsewhere_whose_arguments_the_twins_lack_is_left_alone(
    tmp_path: Any,
) -> None:
    torch.manual_seed(0)
    RoutedLlama(tiny_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(Exception) as unguarded:
        RoutedLlama.from_pretrained(tmp_path, attn_implementation=FLASH)
    attnguard.activate(log="none")
    events.reset_counts()
    with events.capture() as seen, pytest.raises(type(unguarded.value)) as guarded:
        RoutedLlama.from_pretrained(tmp_path, attn_implementation=FLASH)
    assert str(guarded.value) == str(unguarded.value), "transformers' own error"
    said = [e for e in seen if e["event"] != "activated"]
    assert [(e["event"], e["reason_code"]) for e in said] == [
        ("observed", "flash_argument_uncomputed")
    ]
    assert "block_scores" in said[0]["reason"]
    assert "kernels-community/block-sparse-attention" in said[0]["reason"]


# --- model modules that bind the flash path only where flash-attn was installed ------------------


@pytest.mark.parametrize("family", ["falcon", "gpt_neo"])
def test_models_calling_the_flash_path_directly_run_on_the_twins(
    guard: Any, tmp_path: Any, family: str
) -> None:
    """Falcon and GPT-Neo call ``_flash_attention_forward`` themselves, imported only when a
    flash-attn was there at their import: guarded they used to load and then fail with a
    NameError. Now they compute what eager computes (left padding included)."""
    if family == "falcon":
        cfg = transformers.FalconConfig(
            vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4
        )
        cls = transformers.FalconForCausalLM
    else:
        cfg = transformers.GPTNeoConfig(
            vocab_size=128,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            attention_types=[[["global"], 2]],  # (its flash path has no local window)
        )
        cls = transformers.GPTNeoForCausalLM
    torch.manual_seed(0)
    cls(cfg).save_pretrained(tmp_path)
    flash = cls.from_pretrained(tmp_path, attn_implementation=FLASH).eval()
    eager = cls.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        got = flash(input_ids=ids, attention_mask=mask).logits
        want = eager(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
