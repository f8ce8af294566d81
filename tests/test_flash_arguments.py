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
from helpers.events import reasons
from helpers.models import tiny_config

import attnguard
from attnguard.observability import events

FLASH = "flash_attention_2"


@pytest.fixture(scope="module")
def llama(tiny_checkpoint: Any) -> Any:
    return tiny_checkpoint("llama")


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
    assert reasons(said) == [("observed", "flash_argument_uncomputed")]
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


class _SinkAttention(transformers.models.llama.modeling_llama.LlamaAttention):
    """Attention with sinks of its own, handed to the attention function as ``s_aux`` (as
    GPT-OSS does)."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.sinks = torch.nn.Parameter(torch.zeros(config.num_attention_heads))

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
            self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, s_aux=self.sinks
        )
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights


class SinkLlama(transformers.LlamaForCausalLM):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        for i, layer in enumerate(self.model.layers):
            layer.self_attn = _SinkAttention(config, i)


def test_sinks_a_model_passes_are_computed_or_stepped_aside_for(guard: Any, tmp_path: Any) -> None:
    """A model whose attention passes sinks (``s_aux``): computed where the release's flash path
    hands them to the twins (they move the logits); where it does not (4.49), the forward fails
    with the kernel's own error and one event names ``s_aux``."""
    from attnguard.integrations.transformers import arguments as transformers_arguments

    torch.manual_seed(0)
    SinkLlama(tiny_config("llama")).save_pretrained(tmp_path)
    model = SinkLlama.from_pretrained(tmp_path, attn_implementation=FLASH)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    computed = "s_aux" in transformers_arguments.computed_arguments()
    with events.capture() as seen, torch.no_grad():
        if not computed:
            with pytest.raises(type(_kernel_error())):
                model(input_ids=ids)
        else:
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-100.0)  # a sink that takes no mass: no sinks
            without = model(input_ids=ids).logits
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 1.0)
            assert (model(input_ids=ids).logits - without).abs().max() > 1e-3
    said = [e for e in seen if e["reason_code"] == "flash_argument_uncomputed"]
    assert [e["arguments"] for e in said] == ([] if computed else [["s_aux"]])


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
    # a hub kernel attnguard does not know, which cannot load here: its error stands, and the
    # event says why it did not load and names the arguments the twins would not compute
    assert [(e["event"], e["rule"]) for e in said] == [("observed", "hub-aside")]
    assert said[0]["reason_code"].startswith("hub_")
    assert "block_scores" in said[0]["reason"]
    assert "kernels-community/block-sparse-attention" in said[0]["reason"]


# --- model modules that bind the flash path only where flash-attn was installed ------------------


@pytest.mark.parametrize("family", ["falcon", "gpt_neo"])
def test_models_calling_the_flash_path_directly_run_on_the_twins(
    guard: Any, tmp_path: Any, family: str
) -> None:
    """Falcon and GPT-Neo call ``_flash_attention_forward`` themselves, imported only when a
    flash-attn was there at their import: guarded they used to load and then fail with a
    NameError. Now they compute what eager computes."""
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
    # (unpadded: GPT-Neo's own flash class cannot take a padding mask on some releases, with
    # any kernel; tests/test_zoo.py compares padded batches with the flash path's own outcome)
    with torch.no_grad():
        got = flash(input_ids=ids).logits
        want = eager(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_threaded_through_arguments_keep_the_graph_whole(guard: Any, llama: Any) -> None:
    """Judged at load, not per call: a model compiled with ``fullgraph=True`` before any eager
    call, with a tensor its forward threads through, traces whole on the twins."""
    import inspect

    from transformers import modeling_flash_attention_utils as fa_utils

    if "query_length != 1 and not (torch.diff(position_ids" in inspect.getsource(fa_utils):
        pytest.skip("this release's flash path itself branches on data (a graph break of its own)")
    torch._dynamo.reset()
    model = transformers.LlamaForCausalLM.from_pretrained(
        llama, attn_implementation=FLASH, **{_dtype_key(): torch.bfloat16}
    ).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])  # (one row: transformers'
    grid = torch.tensor([[1, 2, 2]])  # flash path reads position_ids to find packed rows)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        got = compiled(input_ids=ids, grid_thw=grid).logits
        want = model(input_ids=ids).logits
    torch.testing.assert_close(got, want)
    torch._dynamo.reset()


def _dtype_key() -> str:
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


class _NeedsFlashAttnParts(transformers.LlamaForCausalLM):
    """A model whose own flash code builds a part of flash-attn itself (as ModernBERT's rotary
    embedding does on transformers 4.55-5.0: a class that is ``object`` where flash-attn is
    missing, so building it fails)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        if "flash" in str(config._attn_implementation):
            object.__init__(self.model, config)  # TypeError, as in ModernBERT


def test_a_model_that_cannot_load_on_the_twins_fails_as_unguarded(tmp_path: Any) -> None:
    """Never a third outcome: the load fails with transformers' own error, as without attnguard,
    and one event says why (no internal error, no other error)."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(Exception) as unguarded:
        _NeedsFlashAttnParts.from_pretrained(tmp_path, attn_implementation=FLASH)
    attnguard.activate(log="none")
    events.reset_counts()
    with events.capture() as seen, pytest.raises(type(unguarded.value)) as guarded:
        _NeedsFlashAttnParts.from_pretrained(tmp_path, attn_implementation=FLASH)
    assert str(guarded.value) == str(unguarded.value)
    said = reasons(seen, skip=("backend_fallback",))
    assert said == [("observed", "flash_model_unrunnable")]


class _VisionTowerWithoutEager(transformers.LlamaForCausalLM):
    """A model whose class supports a backend that one of its parts does not (as Idefics2's
    vision tower refuses sdpa on transformers 4.49): building it with that backend raises
    transformers' ValueError."""

    def __init__(self, config: Any) -> None:
        if config._attn_implementation == "eager":
            raise ValueError(
                "VisionTower does not support an attention implementation through eager yet."
            )
        super().__init__(config)


def test_a_model_that_cannot_load_with_the_fallback_backend_fails_as_unguarded(
    tmp_path: Any,
) -> None:
    """The fallback backend attnguard chose does not load (a part of the model refuses it): the
    load fails with the error it has without attnguard, one event says why, no internal error."""
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path)
    with pytest.raises(Exception) as unguarded:
        _VisionTowerWithoutEager.from_pretrained(tmp_path, attn_implementation=FLASH)
    attnguard.activate(log="none", fallback=("eager",))
    events.reset_counts()
    with events.capture() as seen, pytest.raises(type(unguarded.value)) as guarded:
        _VisionTowerWithoutEager.from_pretrained(tmp_path, attn_implementation=FLASH)
    assert str(guarded.value) == str(unguarded.value)
    said = reasons(seen)
    assert ("backend_fallback", "package_missing") in said  # eager was tried
    assert [x for x in said if x[0] != "backend_fallback"] == [
        ("observed", "fallback_model_unrunnable")
    ]
