"""Family C on CPU: the per-rank device_map planner (injected facts) and rotary alignment hooks.

The real two-GPU behaviour (torchrun x2, Qwen2.5-VL, device_map="auto") is in
tests/gpu/test_multigpu_gpu.py. Here the second device is "meta": a model with layers on "cpu"
and "meta" spans two devices, and meta tensors propagate shapes, so the hook's moves are real.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
import transformers
from helpers.models import CLASS_DEFAULT, save_tiny
from packaging.version import Version

from attnguard.integrations.transformers.rotary import (
    install_rotary_alignment,
    model_devices,
    remove_rotary_alignment,
)
from attnguard.observability import events
from attnguard.plan.device_map import (
    SPREADING_DEVICE_MAPS,
    estimate_model_bytes,
    parse_bytes,
    plan_device_map,
    plan_from_environment,
)

GiB = 2**30
# 5.x rotaries move inv_freq to x.device themselves and can run on "meta"
TF5 = Version(transformers.__version__) >= Version("5.0")
DEVICE_MAPS: list[Any] = [*SPREADING_DEVICE_MAPS, "cuda", {"": 0}, None]

# --- planner: one replica per rank ---------------------------------------------------------------

# (world_size, n_gpus) -> the GPU of each local rank when the model fits one GPU (the placement rule)
FITS = {
    (2, 1): ["cuda:0", "cuda:0"],  # CUDA_VISIBLE_DEVICES per rank: each sees its GPU as cuda:0
    (2, 2): ["cuda:0", "cuda:1"],
    (2, 8): ["cuda:0", "cuda:1"],
    (8, 1): ["cuda:0"] * 8,
    (8, 2): ["cuda:0", "cuda:1"] * 4,  # more ranks than GPUs: round-robin, a replica each
    (8, 8): [f"cuda:{i}" for i in range(8)],
}


@pytest.mark.parametrize("n_gpus", [1, 2, 8])
@pytest.mark.parametrize("device_map", DEVICE_MAPS, ids=str)
@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_planner_rows_when_the_model_fits(world_size: int, device_map: Any, n_gpus: int) -> None:
    got = [
        plan_device_map(device_map, world_size=world_size, local_rank=r, n_gpus=n_gpus)
        for r in range(world_size)
    ]
    if world_size == 1 or device_map not in SPREADING_DEVICE_MAPS:
        # one process splitting on purpose, or a placement the user chose: left alone
        assert got == [None] * world_size
        return
    assert [d.device_map for d in got] == [{"": g} for g in FITS[(world_size, n_gpus)]]
    for r, d in enumerate(got):
        assert d.before["device_map"] == device_map and d.before["local_rank"] == r
        assert d.after["device_map"] == d.device_map
        assert d.max_memory is None
        assert d.reason_code in ("device_map_per_rank", "device_map_shared_gpus")
        assert device_map in d.reason and d.device_map[""] in d.reason


BIG = {"model_bytes": 100 * GiB, "gpu_bytes": 80 * GiB}  # 100 GiB of weights, 80 GiB GPUs


@pytest.mark.parametrize("device_map", SPREADING_DEVICE_MAPS)
def test_model_too_big_for_one_gpu_gets_a_disjoint_slice_per_rank(device_map: str) -> None:
    plans = [
        plan_device_map(device_map, world_size=2, local_rank=r, n_gpus=8, **BIG) for r in range(2)
    ]
    usable = int(80 * GiB * 0.9)
    for r, d in enumerate(plans):
        assert d is not None and d.reason_code == "device_map_gpu_slice"
        assert d.device_map == device_map  # accelerate still splits, inside the slice
        mine = {i for i, b in d.max_memory.items() if isinstance(i, int) and b}
        assert mine == set(range(4 * r, 4 * r + 4))
        assert all(d.max_memory[i] == usable for i in mine)
        assert sorted(k for k in d.max_memory if isinstance(k, int)) == list(range(8))
        assert d.after["max_memory"] == d.max_memory and d.before["max_memory"] is None
    slices = [{i for i, b in d.max_memory.items() if b} for d in plans]
    assert not slices[0] & slices[1]


@pytest.mark.parametrize(("world_size", "n_gpus"), [(2, 1), (2, 2), (8, 1), (8, 2), (8, 8)])
def test_model_too_big_and_no_slice_of_two_gpus_per_rank_is_left_alone(
    world_size: int, n_gpus: int
) -> None:
    for r in range(world_size):
        assert (
            plan_device_map("auto", world_size=world_size, local_rank=r, n_gpus=n_gpus, **BIG)
            is None
        )


def test_user_max_memory_caps_count_as_the_budget() -> None:
    caps = {i: "20GiB" for i in range(8)} | {"cpu": "100GiB"}
    # 30 GiB does not fit a 20 GiB cap: two ranks on two GPUs cannot each have their own slice
    assert (
        plan_device_map(
            "auto",
            world_size=2,
            local_rank=0,
            n_gpus=2,
            max_memory=caps,
            model_bytes=30 * GiB,
            gpu_bytes=80 * GiB,
        )
        is None
    )
    d = plan_device_map(
        "auto",
        world_size=2,
        local_rank=1,
        n_gpus=8,
        max_memory=caps,
        model_bytes=30 * GiB,
        gpu_bytes=80 * GiB,
    )
    assert d is not None and d.reason_code == "device_map_gpu_slice"
    assert {i: d.max_memory[i] for i in range(8)} == {
        **{i: 0 for i in range(4)},
        **{i: 20 * GiB for i in range(4, 8)},
    }
    assert d.max_memory["cpu"] == "100GiB"  # the user's host budget is kept as given
    # it fits: the per-rank map wins and the user's max_memory is passed through untouched
    d = plan_device_map(
        "auto",
        world_size=2,
        local_rank=1,
        n_gpus=2,
        max_memory=caps,
        model_bytes=10 * GiB,
        gpu_bytes=80 * GiB,
    )
    assert d.device_map == {"": "cuda:1"} and d.max_memory == caps


def test_unknown_gpu_memory_means_assume_it_fits() -> None:
    # a size but no GPU memory and no GPU cap (only a host cap): nothing to compare with
    d = plan_device_map(
        "auto",
        world_size=2,
        local_rank=1,
        n_gpus=2,
        max_memory={"cpu": "10GiB"},
        model_bytes=100 * GiB,
    )
    assert d.device_map == {"": "cuda:1"}


def test_slice_offers_host_memory_when_the_user_gave_none() -> None:
    d = plan_device_map("auto", world_size=2, local_rank=0, n_gpus=8, cpu_bytes=64 * GiB, **BIG)
    assert d.max_memory["cpu"] == 64 * GiB
    d = plan_device_map("auto", world_size=2, local_rank=0, n_gpus=8, **BIG)
    assert "cpu" not in d.max_memory


def test_multi_node_uses_the_ranks_of_this_node() -> None:
    # 2 nodes x 8 GPUs, 8 ranks each: world size 16, local ranks 0..7
    d = plan_device_map("auto", world_size=16, local_rank=7, n_gpus=8, local_world_size=8)
    assert d.device_map == {"": "cuda:7"} and d.reason_code == "device_map_per_rank"
    # 2 nodes x 8 GPUs, 2 ranks each, model too big: 4-GPU slices on each node
    d = plan_device_map("auto", world_size=4, local_rank=1, n_gpus=8, local_world_size=2, **BIG)
    assert {i for i, b in d.max_memory.items() if b} == {4, 5, 6, 7}


def test_more_ranks_than_gpus_only_when_the_replicas_fit() -> None:
    # 4 replicas of 30 GiB on one 80 GiB GPU do not fit: leave "auto" alone
    assert (
        plan_device_map(
            "auto", world_size=8, local_rank=3, n_gpus=2, model_bytes=30 * GiB, gpu_bytes=80 * GiB
        )
        is None
    )
    d = plan_device_map(
        "auto", world_size=8, local_rank=3, n_gpus=2, model_bytes=10 * GiB, gpu_bytes=80 * GiB
    )
    assert d.device_map == {"": "cuda:1"} and d.reason_code == "device_map_shared_gpus"


def test_no_gpu_and_non_string_maps_are_left_alone() -> None:
    assert plan_device_map("auto", world_size=2, local_rank=0, n_gpus=0) is None
    assert plan_device_map(torch.device("cuda", 0), world_size=2, local_rank=0, n_gpus=2) is None
    assert plan_device_map(0, world_size=2, local_rank=0, n_gpus=2) is None
    assert plan_device_map("AUTO", world_size=2, local_rank=1, n_gpus=2).device_map == {
        "": "cuda:1"
    }


def test_plan_from_environment_reads_the_launcher(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert plan_from_environment("auto") is None
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    expected = "cuda:1" if torch.cuda.device_count() >= 2 else None
    got = plan_from_environment("auto")
    assert (got.device_map[""] if got else None) == expected
    assert plan_from_environment({"": 0}) is None


@pytest.mark.parametrize(
    ("text", "value"),
    [("10GiB", 10 * GiB), ("500MB", 500 * 10**6), (123, 123), ("8Gbit", 10**9), ("lots", None)],
)
def test_parse_bytes_reads_accelerates_spellings(text: Any, value: int | None) -> None:
    assert parse_bytes(text) == value


def _params_on_meta(model_cls: Any, config: Any) -> int:
    with torch.device("meta"):
        model = model_cls(config)
    model.tie_weights()  # as from_pretrained does (5.0.0's constructor leaves them untied)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("shape", ["qwen2-0.5b", "llama-1b-untied"])
def test_estimate_model_bytes_is_close_to_the_real_parameter_count(shape: str) -> None:
    if shape == "qwen2-0.5b":
        config = transformers.Qwen2Config(
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            vocab_size=151936,
            tie_word_embeddings=True,
        )
        cls = transformers.Qwen2ForCausalLM
    else:
        config = transformers.LlamaConfig(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            tie_word_embeddings=False,
        )
        cls = transformers.LlamaForCausalLM
    real = _params_on_meta(cls, config)
    est = estimate_model_bytes(config, dtype=torch.bfloat16)
    assert abs(est / 2 - real) / real < 0.05
    assert estimate_model_bytes(config, dtype="float32") == 2 * est
    assert estimate_model_bytes(object()) is None


# --- rotary alignment ----------------------------------------------------------------------------


def _tiny_llama(tmp_path) -> Any:
    save_tiny(
        tmp_path / "llama",
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=CLASS_DEFAULT,
    )
    return transformers.LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()


def _tiny_qwen2_vl(tmp_path) -> Any:
    cfg = transformers.Qwen2VLConfig(
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "hidden_size": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_channels": 3,
        },
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=64,
        vocab_size=200,
        max_position_embeddings=512,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
        image_token_id=150,
        video_token_id=151,
        vision_start_token_id=152,
        vision_end_token_id=153,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    cls = transformers.Qwen2VLForConditionalGeneration
    cls(cfg).save_pretrained(tmp_path / "qwen2vl")
    return cls.from_pretrained(tmp_path / "qwen2vl").eval()


def _decoder(model: Any) -> Any:
    """The text decoder (its rotary lives there): model.model, or model.model.language_model."""
    inner = model.model
    return getattr(inner, "language_model", inner) if hasattr(inner, "language_model") else inner


def _hooked(model: Any) -> dict[str, str]:
    return {n: type(m).__name__ for n, m in model.named_modules() if m._forward_pre_hooks}


def _split_over_cpu_and_meta(model: Any) -> None:
    """A manual device map over two devices: the last decoder layer goes to "meta"."""
    _decoder(model).layers[-1].to("meta")


class _Stop(Exception):
    pass


def _inputs_reaching_forward(module: Any, *args: Any) -> tuple[Any, ...]:
    """What the module's forward receives after the pre-hooks (recorded, then stopped).

    transformers 4.x opens ``torch.autocast(device_type="meta")`` in the rotary forward, which
    torch refuses, so the forward itself cannot run with meta inputs there.
    """
    seen: list[tuple[Any, ...]] = []

    def record(_m: Any, a: tuple[Any, ...]) -> None:
        seen.append(a)
        raise _Stop

    handle = module.register_forward_pre_hook(record)
    try:
        with pytest.raises(_Stop):
            module(*args)
    finally:
        handle.remove()
    return seen[0]


def test_single_device_model_gets_no_hooks(tmp_path, guard) -> None:
    model = _tiny_llama(tmp_path)
    assert model_devices(model) == {"cpu"}
    assert install_rotary_alignment(model) == 0
    assert _hooked(model) == {}


def test_hooks_land_on_exactly_the_rotary_modules_and_come_off(tmp_path, guard) -> None:
    model = _tiny_llama(tmp_path)
    _split_over_cpu_and_meta(model)
    assert model_devices(model) == {"cpu", "meta"}
    assert install_rotary_alignment(model) == 1
    prefix = "model.language_model." if hasattr(model.model, "language_model") else "model."
    assert _hooked(model) == {f"{prefix}rotary_emb": "LlamaRotaryEmbedding"}
    assert install_rotary_alignment(model) == 1  # idempotent: still one hook
    assert len(_decoder(model).rotary_emb._forward_pre_hooks) == 1
    assert remove_rotary_alignment(model) == 1
    assert _hooked(model) == {}


def test_hook_moves_position_ids_to_the_input_device(tmp_path, guard, captured) -> None:
    model = _tiny_llama(tmp_path)
    _split_over_cpu_and_meta(model)
    rotary = _decoder(model).rotary_emb
    x = torch.zeros(1, 5, 32, device="meta")  # hidden states from the layer on "meta"
    position_ids = torch.arange(5)[None]  # built on "cpu" next to input_ids
    if TF5:
        with pytest.raises(RuntimeError, match="device"):  # what happens without the guard
            rotary(x, position_ids)
    install_rotary_alignment(model)
    for _ in range(3):
        got_x, got_pos = _inputs_reaching_forward(rotary, x, position_ids)
        assert got_x is x and got_pos.device.type == "meta"
        assert got_pos.shape == position_ids.shape
    # inv_freq never goes to "meta": its values would be lost (transformers >= 4.51 moves a copy)
    assert rotary.inv_freq.device.type == "cpu"
    if TF5:
        # the forward then runs as it does unguarded with both inputs on "meta" already
        ref = _decoder(_tiny_llama(tmp_path)).rotary_emb.to("meta")
        try:
            want = ref(x, position_ids.to("meta"))
        except RuntimeError as exc:  # 5.0.0's autocast check cannot take "meta", guard or not
            with pytest.raises(RuntimeError, match=re.escape(str(exc).splitlines()[0])):
                rotary(x, position_ids)
        else:
            cos, sin = rotary(x, position_ids)
            assert cos.device.type == "meta" and cos.shape == want[0].shape == (1, 5, 8)
    aligned = [e for e in captured if e["event"] == "tensors_aligned"]
    assert len(aligned) == 1
    ev = aligned[0]
    assert ev["site"] == "rotary:LlamaRotaryEmbedding" and ev["applied"] is True
    assert ev["moved"] == ["position_ids"] and ev["target"] == "meta"
    key = ("tensors_aligned", "rotary:LlamaRotaryEmbedding", "rotary_device_mismatch")
    assert events.counts()[key] == (4 if TF5 else 3)


def test_hook_moves_keyword_position_ids_too(tmp_path, guard) -> None:
    model = _tiny_llama(tmp_path)
    _split_over_cpu_and_meta(model)
    install_rotary_alignment(model)
    rotary = _decoder(model).rotary_emb
    seen: list[dict[str, Any]] = []

    def record(_m: Any, _a: Any, kw: dict[str, Any]) -> None:
        seen.append(kw)
        raise _Stop

    handle = rotary.register_forward_pre_hook(record, with_kwargs=True)
    with pytest.raises(_Stop):
        rotary(torch.zeros(1, 3, 32, device="meta"), position_ids=torch.arange(3)[None])
    handle.remove()
    assert seen[0]["position_ids"].device.type == "meta"


def test_warn_mode_reports_and_moves_nothing(tmp_path, guard, captured) -> None:
    guard(mode="warn")
    model = _tiny_llama(tmp_path)
    _split_over_cpu_and_meta(model)
    install_rotary_alignment(model)
    rotary = _decoder(model).rotary_emb
    _, got_pos = _inputs_reaching_forward(
        rotary, torch.zeros(1, 5, 32, device="meta"), torch.arange(5)[None]
    )
    assert got_pos.device.type == "cpu"
    (ev,) = [e for e in captured if e["event"] == "tensors_aligned"]
    assert ev["applied"] is False and "left as is" in ev["reason"]


def test_disabled_align_or_inactive_guard_does_nothing(tmp_path, guard, captured) -> None:
    model = _tiny_llama(tmp_path)
    _split_over_cpu_and_meta(model)
    install_rotary_alignment(model)
    rotary = _decoder(model).rotary_emb
    args = (torch.zeros(1, 5, 32, device="meta"), torch.arange(5)[None])
    guard(disable="align")
    assert _inputs_reaching_forward(rotary, *args)[1].device.type == "cpu"
    import attnguard

    attnguard.deactivate()
    assert _inputs_reaching_forward(rotary, *args)[1].device.type == "cpu"
    assert not [e for e in captured if e["event"] == "tensors_aligned"]


def test_aligned_inputs_pass_straight_through(tmp_path, guard, captured) -> None:
    model = _tiny_llama(tmp_path)
    _split_over_cpu_and_meta(model)
    install_rotary_alignment(model)
    rotary = _decoder(model).rotary_emb
    x, pos = torch.randn(1, 5, 32), torch.arange(5)[None]
    cos, sin = rotary(x, pos)  # all on cpu: the real forward runs, untouched
    remove_rotary_alignment(model)
    ref_cos, ref_sin = rotary(x, pos)
    assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    assert not [e for e in captured if e["event"] == "tensors_aligned"]


def test_qwen2_vl_rotary_with_3d_position_ids(tmp_path, guard, captured) -> None:
    model = _tiny_qwen2_vl(tmp_path)
    _split_over_cpu_and_meta(model)
    n = install_rotary_alignment(model)
    hooked = _hooked(model)
    assert n == len(hooked) >= 1
    assert all("Rotary" in cls for cls in hooked.values())
    assert "Qwen2VLRotaryEmbedding" in hooked.values()
    # 4.x vision rotary forward(seqlen) computes on its own buffer: nothing to align, no hook
    vision_rotary = model.visual.rotary_pos_emb if hasattr(model, "visual") else None
    vision_rotary = vision_rotary or model.model.visual.rotary_pos_emb
    forward_takes_seqlen = "seqlen" in type(vision_rotary).forward.__code__.co_varnames
    assert bool(vision_rotary._forward_pre_hooks) is not forward_takes_seqlen
    rotary = _decoder(model).rotary_emb
    position_ids = torch.arange(6).expand(3, 1, 6)  # (3, B, S): temporal, height, width
    _, got = _inputs_reaching_forward(rotary, torch.zeros(1, 6, 32, device="meta"), position_ids)
    assert got.device.type == "meta" and got.shape == (3, 1, 6)
    sites = {e["site"] for e in captured if e["event"] == "tensors_aligned"}
    assert sites == {"rotary:Qwen2VLRotaryEmbedding"}


def test_hook_error_fails_open(tmp_path, guard, captured, monkeypatch) -> None:
    from attnguard.integrations.transformers import rotary

    model = _tiny_llama(tmp_path)
    _split_over_cpu_and_meta(model)
    install_rotary_alignment(model)

    def broken(*_a: Any, **_k: Any) -> Any:
        raise KeyError("bug in attnguard")

    monkeypatch.setattr(rotary, "_target_device", broken)
    rotary = _decoder(model).rotary_emb
    x, pos = torch.randn(1, 4, 32), torch.arange(4)[None]
    cos, _ = rotary(x, pos)  # the original forward ran with its own inputs
    assert cos.shape == (1, 4, 8)
    (ev,) = [e for e in captured if e["event"] == "internal_error"]
    assert ev["site"] == "rotary:LlamaRotaryEmbedding" and ev["reason_code"] == "KeyError"
