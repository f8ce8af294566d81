"""Shared fixtures. Every test starts and ends with attnguard deactivated and counts cleared.

``import attnguard`` activates from the environment; the test session imports it once with
ATTNGUARD_LOG=none so pytest's own output stays clean, then each test switches it on as needed.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for _var in [v for v in os.environ if v.startswith("ATTNGUARD")]:
    del os.environ[_var]  # a developer's shell settings must not leak into tests
os.environ["ATTNGUARD_LOG"] = "none"

import attnguard  # noqa: E402
from attnguard.observability import events, workload  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
STANDINS = REPO / "tests" / "standins"


def hub_standin() -> Any:
    """tests/standins/hub_kernel.py, the stand-in hub kernel's writer (loaded by path: that folder
    also holds the flash-attn stand-in, which must not become importable in this process)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hub_standin", STANDINS / "hub_kernel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


attnguard.deactivate()

# Test files whose subject does not depend on the transformers release (the job story across
# ranks and nodes, its delivery at exit to OpenTelemetry and a log shipper, the benchmarks' smoke
# runs, diffusers' hub-kernel backends; the releases after the newest, which only the newest
# predicts): marked `once`; CI runs them in its newest lane (its torch lanes the smoke ones among
# them) and deselects them in the pinned transformers lanes. The README's test commands run them.
ONCE = {
    "test_bench_smoke.py",
    "test_diffusers_hub.py",
    "test_exit_wait.py",
    "test_job_nodes.py",
    "test_job_scale.py",
    "test_log_shipper.py",
    "test_otel_exit.py",
    "test_readme_numbers.py",
    "test_unknown_release.py",
}


# Test files whose subject is what differs between torch releases (SDPA's arguments, torch's flash
# kernel, what torch.compile can trace): marked `torch`; CI's torch lanes (the newest torch, the
# floor, one between) run them with the smoke suite (`-m "smoke or torch"`).
TORCH = {
    "test_attention_sinks.py",
    "test_compile.py",
    "test_fallback.py",
    "test_kvcache_twin.py",
    "test_torch_releases.py",
    "test_twin_routes.py",
}


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._attnguard_started = time.monotonic()  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """The README's test commands record their counts and minutes (tests/run_record.py)."""
    import run_record

    kind = run_record.run_kind(config)
    started = getattr(config, "_attnguard_started", None)
    if kind is None or started is None or exitstatus not in (0, 1):
        return
    path = run_record.record(kind, terminalreporter.stats, time.monotonic() - started)
    terminalreporter.write_line(f"{kind} run recorded in {path} (README checks its numbers)")


# the seconds each test file took, where TEST_FILE_TIMES names a file for them: .ci/run splits its
# next run's full-suite parts by them (scripts/ci_parts.py)
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("TEST_FILE_TIMES"):
        path = report.nodeid.split("::")[0]
        _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    where = os.environ.get("TEST_FILE_TIMES")
    if where and _FILE_SECONDS:
        import json

        Path(where).write_text(json.dumps({k: round(v, 2) for k, v in _FILE_SECONDS.items()}))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in ONCE:
            item.add_marker(pytest.mark.once)
        if item.path.name in TORCH:
            item.add_marker(pytest.mark.torch)


@pytest.fixture(autouse=True)
def _clean_guard() -> Iterator[None]:
    attnguard.deactivate()
    events.reset_counts()
    workload.reset()  # what reached the twins: the summary's advice reads it
    yield
    attnguard.deactivate()
    events.reset_counts()
    workload.reset()


@pytest.fixture
def captured() -> Iterator[list[dict[str, Any]]]:
    """Every event emitted during the test (attnguard's own capture helper)."""
    with events.capture() as got:
        yield got


@pytest.fixture
def guard(captured: list[dict[str, Any]]) -> Iterator[Any]:
    """attnguard active in fix mode with no stream output; returns a re-activation function."""

    def _activate(**overrides: Any) -> attnguard.Settings:
        return attnguard.activate(**{"log": "none", **overrides})

    _activate()
    yield _activate


def diffusers_dispatch() -> Any:
    """diffusers' attention dispatcher module, or skip the calling test module with the reason.
    scripts/test.sh provides diffusers where pip can install it beside this environment's
    transformers and otherwise says why not in TEST_DIFFUSERS_ABSENT; where it provided it
    (TEST_DIFFUSERS_EXPECTED=1), diffusers failing to import is a failure, not a skip."""
    absent = os.environ.get("TEST_DIFFUSERS_ABSENT")
    if absent:
        pytest.skip(absent, allow_module_level=True)
    try:
        import diffusers.models.attention_dispatch as ad
    except Exception as exc:
        if os.environ.get("TEST_DIFFUSERS_EXPECTED") == "1":
            raise
        pytest.skip(f"diffusers does not import here: {exc!r}", allow_module_level=True)
    return ad


def names(evts: list[dict[str, Any]], *, skip: tuple[str, ...] = ("activated",)) -> list[str]:
    """Event names in order, without bookkeeping events."""
    return [e["event"] for e in evts if e["event"] not in skip]


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python that imports this checkout of attnguard."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


PY = sys.executable

# Every event's fixed fields, in order: the schema as users read it (spelled out, not imported
# from attnguard, so a change there has to change this too).
FIXED = [
    "schema",
    "event",
    "level",
    "ts",
    "pid",
    "proc",
    "host",
    "rank",
    "local_rank",
    "world_size",
    "mode",
    "site",
    "reason_code",
    "reason",
    "count",
]


# --- tiny real transformers models (load-time guard tests) ---------------------------------------

TINY_FAMILIES = ("llama", "qwen2", "qwen2_5_vl")
# Qwen2.5-VL special tokens of the tiny recipe (ids of its tiny vocabulary)
VL_IMAGE, VL_START, VL_END, VL_VIDEO = 122, 120, 121, 123


def tiny_config(family: str, **overrides: Any) -> Any:
    """A tiny random config of a real architecture (flat text kwargs work on 4.49, 4.57, 5.x)."""
    import transformers

    text = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        return transformers.LlamaConfig(**text, **overrides)
    if family == "qwen2":
        return transformers.Qwen2Config(**text, **overrides)
    if family == "qwen2_5_vl":
        return transformers.Qwen2_5_VLConfig(
            **text,
            rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]},
            image_token_id=VL_IMAGE,
            video_token_id=VL_VIDEO,
            vision_start_token_id=VL_START,
            vision_end_token_id=VL_END,
            vision_config=dict(
                depth=2,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                patch_size=4,
                spatial_merge_size=2,
                temporal_patch_size=2,
                in_channels=3,
                window_size=16,
                fullatt_block_indexes=[1],
                tokens_per_second=2,
            ),
            **overrides,
        )
    raise ValueError(family)


def tiny_model_class(family: str) -> Any:
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
    }[family]


def tiny_inputs(family: str) -> dict[str, Any]:
    """A batch of two with left padding (and an image for the VLM)."""
    import torch

    if family != "qwen2_5_vl":
        ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
        mask = (ids != 0).long()
        return {"input_ids": ids, "attention_mask": mask}
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, 3 * 2 * 4 * 4, generator=gen)
    row = [5, 6, VL_START] + [VL_IMAGE] * 4 + [VL_END, 7, 8]
    ids = torch.tensor([[0, 0, *row[:-2]], row])
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "pixel_values": torch.cat([pixels, pixels]),
        "image_grid_thw": torch.cat([grid, grid]),
    }


def logits_of(model: Any, family: str) -> Any:
    import torch

    with torch.no_grad():
        return model.eval()(**tiny_inputs(family)).logits


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """tiny_checkpoint(family, dtype="float32") -> a saved random checkpoint (cached per session)."""
    cache: dict[tuple[str, str], Path] = {}

    def make(family: str, dtype: str = "float32") -> Path:
        key = (family, dtype)
        if key not in cache:
            import torch

            # default attention: nothing for attnguard to decide, even when it is active
            torch.manual_seed(0)
            model = tiny_model_class(family)(tiny_config(family))
            model.to(getattr(torch, dtype))
            path = tmp_path_factory.mktemp(f"{family}-{dtype}")
            model.save_pretrained(path)
            cache[key] = path
        return cache[key]

    return make
