"""Facts: backend judgement (pure), probes on this machine, launch and deliberate-init context."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from attnguard import facts as F

H100 = F.GPU(0, "H100", (9, 0))
A100 = F.GPU(0, "A100", (8, 0))
V100 = F.GPU(0, "V100", (7, 0))
T4 = F.GPU(0, "T4", (7, 5))


def judge(name: str, state: F.PackageState, gpu: F.GPU | None, tf: str = "4.57.6") -> F.Backend:
    return F.assess_backend(
        name, state, cuda=gpu is not None, gpu=gpu, torch_version="2.5.0", transformers_version=tf
    )


@pytest.mark.parametrize(
    ("gpu", "native"), [(H100, True), (A100, True), (V100, False), (T4, False)]
)
def test_native_bf16_is_capability_8_or_more(gpu: F.GPU, native: bool) -> None:
    # torch.cuda.is_bf16_supported() says True on V100/T4 (emulation): never used for this
    assert gpu.native_bf16 is native


@pytest.mark.parametrize(
    ("state", "gpu", "tf", "code"),
    [
        (F.PackageState(False), H100, "4.57.6", F.PACKAGE_MISSING),
        (F.PackageState(True, "2.0.9"), H100, "4.57.6", F.VERSION_TOO_OLD),
        (F.PackageState(True, "2.3.0"), H100, "4.57.6", F.OK),  # 4.x accepts >= 2.1.0
        (F.PackageState(True, "2.3.0"), H100, "5.23.0", F.VERSION_TOO_OLD),  # 5.x: >= 2.3.3
        (
            F.PackageState(True, "2.8.3", import_error="ImportError: x"),
            H100,
            "5.23.0",
            F.EXTENSION_BROKEN,
        ),
        (
            F.PackageState(True, "2.8.3", import_error="ImportError: x"),
            None,
            "5.23.0",
            F.EXTENSION_BROKEN,
        ),
        (F.PackageState(True, "2.8.3"), None, "4.49.0", F.NO_CUDA),
        (F.PackageState(True, "2.8.3"), V100, "4.49.0", F.CAPABILITY_TOO_LOW),
        (F.PackageState(True, "2.8.3"), T4, "4.49.0", F.CAPABILITY_TOO_LOW),
        (F.PackageState(True, "2.8.3"), A100, "4.49.0", F.OK),
        (
            F.PackageState(True, "2.8.3", probe_error="RuntimeError: y"),
            A100,
            "4.49.0",
            F.PROBE_FAILED,
        ),
    ],
)
def test_flash_attention_2_judgement(
    state: F.PackageState, gpu: F.GPU | None, tf: str, code: str
) -> None:
    b = judge("flash_attention_2", state, gpu, tf)
    assert b.reason_code == code
    assert b.usable is (code == F.OK)
    assert b.reason


def test_a_broken_import_is_named_before_the_missing_gpu() -> None:
    """On a CPU box with a broken install the import error is the thing to fix first."""
    state = F.PackageState(True, "2.8.3", import_error="ModuleNotFoundError: No module named 'x'")
    b = judge("flash_attention_2", state, None)
    assert "No module named 'x'" in b.reason and "no CUDA device" in b.reason


def test_capability_floors_per_kernel() -> None:
    ok = F.PackageState(True, "1.0")
    assert judge("flash_attention_3", ok, A100).usable
    assert judge("flash_attention_4", ok, A100).reason_code == F.CAPABILITY_TOO_LOW
    assert judge("flash_attention_4", ok, H100).usable
    assert judge("xformers", ok, V100).usable
    assert judge("xformers", ok, None).reason_code == F.NO_CUDA
    assert judge("sdpa", F.PackageState(True), None).usable
    assert judge("flex_attention", F.PackageState(True), None).usable
    broken = F.PackageState(True, import_error="ImportError: z")
    assert judge("flex_attention", broken, None).reason_code == F.EXTENSION_BROKEN


def test_facts_of_this_machine_are_cached_and_true() -> None:
    F.reset()
    first = F.current()
    second = F.current()
    assert first.backends is second.backends  # probes ran once
    assert first.cuda == torch.cuda.is_available()
    assert len(first.gpus) == (torch.cuda.device_count() if first.cuda else 0)
    assert first.backend("sdpa").usable
    assert first.backend("eager").usable  # never judged, always there
    fa2 = first.backend("flash_attention_2")
    if importlib.util.find_spec("flash_attn") is None:
        assert fa2.reason_code == F.PACKAGE_MISSING
    if not first.cuda:
        assert not fa2.usable
    F.reset()
    assert F.current().backends is not first.backends


def test_an_absent_package_is_not_imported(monkeypatch: Any) -> None:
    imported: list[str] = []
    real = importlib.import_module

    def spy(name: str, *a: Any, **k: Any) -> Any:
        imported.append(name)
        return real(name, *a, **k)

    monkeypatch.setattr(importlib, "import_module", spy)
    state = F.probe_package("xformers", gpu_device=None)
    if importlib.util.find_spec("xformers") is None:
        assert state == F.PackageState(False) and imported == []


def test_a_broken_extension_is_imported_for_real(tmp_path: Path) -> None:
    """Stand-in of flash-attn whose CUDA extension fails to load the way a torch upgrade breaks
    it (the real broken build is tested in test_load_errors.py)."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "raise ImportError('/x/flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice"
        "Ei\\nsecond line')\n"
    )
    dist = tmp_path / "flash_attn-2.8.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flash_attn\nVersion: 2.8.3\n")
    sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    try:
        state = F.probe_package("flash_attention_2", gpu_device=None)
        backend = judge("flash_attention_2", state, None)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("flash_attn", None)
        importlib.invalidate_caches()
    assert state.installed and state.version == "2.8.3"
    assert state.import_error is not None and "undefined symbol" in state.import_error
    assert "second line" not in state.import_error
    assert backend.reason_code == F.EXTENSION_BROKEN and "undefined symbol" in backend.reason


def test_launch_context_from_the_environment(monkeypatch: Any) -> None:
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert F.launch_now(env) == F.Launch(5, 1, 8, 4)
    assert F.launch_now({}) == F.Launch(0, 0, 1, None)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert F.current().launch.local_rank == 3  # re-read on every call, not cached


def test_fsdp_is_read_from_accelerate_variables() -> None:
    assert F.fsdp_enabled({"ACCELERATE_USE_FSDP": "true"})
    assert F.fsdp_enabled({"FSDP_SHARDING_STRATEGY": "FULL_SHARD"})
    assert not F.fsdp_enabled({"ACCELERATE_USE_FSDP": "false"})
    assert not F.fsdp_enabled({})
    assert F.init_context_now({"ACCELERATE_USE_FSDP": "1"}).deliberate[0] == "fsdp_init"


def test_meta_device_and_init_empty_weights_are_deliberate_init() -> None:
    assert F.init_context_now({}).deliberate is None
    with torch.device("meta"):
        ctx = F.init_context_now({})
    assert ctx.meta and ctx.deliberate[0] == "meta_init"
    accelerate = pytest.importorskip("accelerate")
    with accelerate.init_empty_weights():
        assert F.init_context_now({}).meta
    assert not F.init_context_now({}).meta


def test_a_training_script_is_one_that_imported_the_trainer() -> None:
    """In a fresh interpreter: a program that loads a model is not a training script; one that
    imported transformers' TrainingArguments (or Trainer) before the load is. The answer comes
    from what is imported; attnguard imports neither."""
    import subprocess

    code = (
        "import sys, transformers\n"
        "from attnguard import facts\n"
        "before = facts.init_context_now({}).training_script\n"
        "imported_by_us = 'transformers.training_args' in sys.modules\n"
        "from transformers import {name}\n"
        "print(before, imported_by_us, facts.init_context_now({{}}).training_script)\n"
    )
    for name in ("TrainingArguments", "Trainer"):
        res = subprocess.run(
            [sys.executable, "-c", code.replace("{name}", name).replace("{{}}", "{}")],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.split() == ["False", "False", "True"], (name, res.stdout, res.stderr)


def test_zero3_is_transformers_own_answer(monkeypatch: Any) -> None:
    """DeepSpeed cannot be installed here: transformers' is_deepspeed_zero3_enabled is replaced
    by a stand-in answering True, as it does once a ZeRO-3 HfDeepSpeedConfig exists."""
    ds = importlib.import_module("transformers.integrations.deepspeed")
    assert F.zero3_enabled() is False
    monkeypatch.setattr(ds, "is_deepspeed_zero3_enabled", lambda: True)
    assert F.zero3_enabled() is True
    assert F.current().init.deliberate[0] == "zero3_init"


def test_quantized_loads() -> None:
    assert F.is_quantized_load({"load_in_4bit": True})
    assert F.is_quantized_load({"quantization_config": object()})
    assert F.is_quantized_load({}, {"quantization_config": {"quant_method": "gptq"}})
    assert not F.is_quantized_load({"load_in_8bit": False}, {"torch_dtype": "float32"})


def test_facts_as_dict_is_json_ready() -> None:
    import json

    f = F.synthetic(((8, 0), (7, 0)), installed={"flash_attention_2": "2.8.3"})
    d = json.loads(json.dumps(f.as_dict()))
    assert [g["native_bf16"] for g in d["gpus"]] == [True, False]
    assert d["backends"]["flash_attention_2"]["usable"] is True
    assert d["native_bf16"] is True
