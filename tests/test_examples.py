"""Every example in examples/ runs, in a fresh Python, as a user would run it.

Each child gets this checkout on PYTHONPATH, HF_HUB_OFFLINE=1 and attnguard's JSON lines on
stderr. An example ends with ``EVENTS: [...]`` (the events it caused, in order) and, where it
shows a decision for a machine we are not on, ``PLANNED: [...]`` (from the real planner with
injected facts). The tests check both, check that the stderr JSON stream carries exactly the
events the example reported, and check the numbers the attention examples compare with a float64
reference. GPU runs of families A, C and E live in tests/gpu/test_examples_gpu.py.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess

import pytest
import torch
import transformers
from helpers.examples import (
    CANNOT_SHOW,
    DOCS_EXAMPLES,
    EXAMPLES,
    README,
    RECORDED_WITH,
    close_to_reference,
    how_it_works_says,
    run_example,
)
from helpers.packages import STANDINS, diffusers_dispatch
from helpers.processes import PY, REPO, subprocess_env

from attnguard import facts, support
from attnguard.observability.advice import Facts
from attnguard.observability.report import hint_for

BROKEN_DIR = os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR")
HAS_XFORMERS = importlib.util.find_spec("xformers") is not None


def test_every_example_has_a_test() -> None:
    tested = {
        "quickstart.py",
        "family_a_flash_not_on_gpu.py",
        "family_b_old_gpu.py",
        "family_c_torchrun_device_map.py",
        "family_d_custom_attention.py",
        "family_e_fp32_flash.py",
        "broken_flash_install.py",
        "xformers_unusable.py",
        "diffusers_flash_backend.py",
        "hub_kernel_air_gapped.py",
    }
    present = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert present == tested


def _flash_status() -> facts.Backend:
    return facts.current().backend("flash_attention_2")


def test_quickstart_falls_back_and_generates() -> None:
    run = run_example("quickstart.py")
    caused = run.caused()
    assert [e["event"] for e in caused] == ["backend_fallback"]
    assert caused[0]["selected"] == "sdpa_twin" and caused[0]["rule"] == "flash-on-sdpa"
    # what happens without attnguard, then which kernel computes the flash path's calls
    assert "without attnguard: ImportError: " in run.stdout
    assert "attention backend" not in run.stdout
    said = "attention 'flash_attention_2': transformers' flash code path, its kernel calls "
    assert said + "computed by attnguard's SDPA twins" in run.stdout
    assert "Generated tokens: " in run.stdout


def test_family_a_runs_on_sdpa_here_and_plans_the_placement_on_a_gpu() -> None:
    run = run_example("family_a_flash_not_on_gpu.py")
    assert run.events == ["backend_fallback"]
    (fallback,) = run.caused()
    assert fallback["reason_code"] == _flash_status().reason_code
    assert fallback["model"] == "Qwen2_5_VLForConditionalGeneration"
    assert fallback["requested"] == "flash_attention_2"
    # attnguard's twins keep the flash path (flash-on-sdpa), or the model loads with sdpa
    assert fallback["selected"] == ("sdpa_twin" if fallback["rule"] == "flash-on-sdpa" else "sdpa")
    assert "without attnguard: " in run.stdout and "Error" in run.stdout.split("without")[1]
    # transformers' flash path on the SDPA twins where attnguard can provide them for this model
    # class (not Qwen2.5-VL's fixed flash classes on 4.49-4.52): else transformers' sdpa path
    attention = "flash_attention_2" if fallback["rule"] == "flash-on-sdpa" else "sdpa"
    assert f"on cpu, torch.bfloat16, attention '{attention}'" in run.stdout
    assert run.planned == ["model_placed"]
    assert "straight onto cuda:3" in run.stdout  # rank 3 of 8
    assert "observed (zero3_init)" in run.stdout  # ZeRO-3: left alone


def test_family_b_falls_back_here_and_plans_the_gpu_and_fp16_on_a_v100() -> None:
    run = run_example("family_b_old_gpu.py")
    assert run.events == ["backend_fallback"]
    assert run.caused()[0]["reason_code"] == _flash_status().reason_code
    assert "torch.bfloat16, attention 'flash_attention_2'; one training step" in run.stdout
    # on a V100: flash's path on the SDPA twins (as kept here), on the GPU, in fp16 (the run
    # flash would have had); the placement follows a flash path kept, never a switch to sdpa
    planned = run.stdout.split("[planned, not run] on a V100:", 1)[1].splitlines()
    fallback = next(line for line in planned if "backend_fallback (capability_too_low)" in line)
    if run.caused()[0]["rule"] == "flash-on-sdpa":
        assert run.planned == ["backend_fallback", "model_placed", "model_cast"]
        assert "keep transformers' flash code path" in fallback
        assert "model_placed (flash_needs_gpu)" in run.stdout
        assert "model_cast (no_native_bf16)" in run.stdout and "load in float16" in run.stdout
    else:  # loaded with sdpa: it stays where its caller puts it
        assert run.planned == ["backend_fallback"] and "load with sdpa" in fallback


def test_family_c_plans_one_replica_or_one_gpu_slice_per_rank() -> None:
    run = run_example("family_c_torchrun_device_map.py")
    assert run.events == ["backend_fallback"]  # flash-attn cannot run here; the map is kept
    assert "rank 0 of 1: model on ['cpu']" in run.stdout
    assert run.planned == ["device_map_rewritten"] * 4
    assert "device_map_per_rank" in run.stdout and "device_map_gpu_slice" in run.stdout
    assert "device_map={'': 'cuda:0'}" in run.stdout
    assert "device_map={'': 'cuda:1'}" in run.stdout
    # the big model: rank 0 gets GPUs 0-1, rank 1 GPUs 2-3, every other GPU capped at 0
    slices = [line for line in run.stdout.splitlines() if "device_map='auto', max_memory=" in line]
    assert len(slices) == 2
    assert "2: 0, 3: 0}" in slices[0] and "{0: 0, 1: 0, " in slices[1]
    # one process without GPUs: the command that shows the real failure, where it can
    assert "needs 2 GPUs: on a machine with 2, torchrun --nproc-per-node=2" in run.stdout


def test_family_c_under_torchrun_without_gpus_names_what_is_missing() -> None:
    """Started as its docstring says (torchrun, two ranks) on a machine without 2 GPUs, it does
    not tell the user to run the command they just ran: the machine is what is missing."""
    env = subprocess_env(HF_HUB_OFFLINE="1", ATTNGUARD_LOG="none", OMP_NUM_THREADS="1")
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = subprocess.run(
        [*cmd, str(EXAMPLES / "family_c_torchrun_device_map.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    assert "rank 0 of 2: model on ['cpu']" in res.stdout
    assert "rank 1 of 2: model on ['cpu']" in res.stdout
    if torch.cuda.device_count() < 2:
        said = f"needs 2 GPUs; this machine has {torch.cuda.device_count()}: the same command"
        assert res.stdout.count(said) == 2
    assert "torchrun --nproc-per-node=2" not in res.stdout


@pytest.mark.skipif(not HAS_XFORMERS, reason="xformers is not installed (scripts/test.sh does)")
def test_family_d_unifies_dtypes_and_carries_xformers_on_sdpa() -> None:
    run = run_example("family_d_custom_attention.py")
    assert run.events == ["qkv_unified", "backend_rerouted"]
    unified, rerouted = run.caused()
    site = "xformers.memory_efficient_attention"
    assert unified["site"] == rerouted["site"] == site
    assert unified["from"] == {"query": "float32", "key": "float32", "value": "bfloat16"}
    assert unified["to"] == "bfloat16"
    assert rerouted["reason_code"] == "cpu_tensors" and rerouted["selected"] == "sdpa_twin"
    assert "Query/Key/Value should either all have the same dtype" in run.stdout
    close_to_reference(run, 0.02)  # bf16 inputs; a lost block-causal mask costs ~1.0


def _standin_coexists_with_xformers() -> bool:
    # xformers' import of flash_attn reads flash_attn_interface.flash_attn_gpu
    text = (STANDINS / "flash_attn" / "flash_attn_interface.py").read_text()
    return "flash_attn_gpu" in text


@pytest.mark.skipif(
    HAS_XFORMERS and not _standin_coexists_with_xformers(),
    reason="xformers cannot import next to the flash-attn stand-in (no flash_attn_gpu attribute)",
)
def test_family_d_flash_path_with_the_flash_attn_standin() -> None:
    # stand-in: the real flash-attn cannot be installed on a CPU machine
    run = run_example("family_d_custom_attention.py", STANDINS, quotes=False)  # quotes: xformers
    flash = [e for e in run.caused() if e["site"] == "flash_attn.flash_attn_func"]
    assert [e["event"] for e in flash] == ["qkv_unified", "backend_rerouted"]
    assert flash[0]["from"] == {"q": "float32", "k": "float32", "v": "bfloat16"}
    assert "with arguments from the 'CPU' backend" in run.stdout  # the stand-in's own refusal
    assert any(label.startswith("inference (flash_attn") for label in run.errors)
    close_to_reference(run, 0.02)


def test_family_e_falls_back_here_and_plans_bf16_on_the_gpu_for_an_h100() -> None:
    run = run_example("family_e_fp32_flash.py")
    assert run.events == ["backend_fallback"]
    assert run.caused()[0]["reason_code"] == _flash_status().reason_code
    assert "on cpu, torch.float32, attention 'flash_attention_2'; first forward ran" in run.stdout
    assert run.planned == ["model_placed", "model_cast"]
    assert "load in bfloat16" in run.stdout and "onto cuda:0" in run.stdout
    assert run.stdout.count("observed (fsdp_init)") == 2  # verl's FSDP actor: left alone


def test_broken_flash_install_example_without_one_says_how_to_make_one() -> None:
    if _flash_status().reason_code == facts.EXTENSION_BROKEN:
        pytest.skip("this environment itself has a broken flash-attn install")
    run = run_example("broken_flash_install.py", quotes=False, status=CANNOT_SHOW)
    assert run.events == []
    assert "FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE" in run.stdout
    assert "could not show what it is for here: no broken flash-attn install" in run.stdout


@pytest.mark.skipif(
    BROKEN_DIR is None, reason="TEST_BROKEN_FLASH_ATTN_DIR not set (test.sh sets it)"
)
def test_broken_flash_install_falls_back_naming_the_import_error() -> None:
    assert BROKEN_DIR is not None
    run = run_example("broken_flash_install.py", BROKEN_DIR)
    assert run.events == ["backend_fallback"]
    (fallback,) = run.caused()
    assert fallback["reason_code"] == facts.EXTENSION_BROKEN
    assert "No module named 'flash_attn_2_cuda'" in fallback["reason"]
    how_it_works_says("broken_flash_install.py", run)
    assert "with 'flash_attention_2'" in run.stdout and "one training step ran" in run.stdout


def _loads_attention_from_the_hub() -> bool:
    """Whether this transformers has a loader of attention hub kernels (the one attnguard
    guards), by its shape."""
    from attnguard.integrations.transformers import hub

    try:
        module = importlib.import_module(hub.MODULE)
    except ImportError:
        return False
    return any(callable(getattr(module, name, None)) for name in hub.LOADERS)


@pytest.mark.parametrize("kernels", ["absent", "installed"])
def test_hub_kernel_air_gapped_computes_the_kernel_on_the_twins(kernels: str) -> None:
    """With the `kernels` package absent, or installed (scripts/test.sh's, at the newest version
    this transformers accepts where one exists) on a machine without network and an empty cache:
    the hub kernel cannot load, the twins compute its flash-attn 2 functions."""
    if not _loads_attention_from_the_hub():
        run = run_example("hub_kernel_air_gapped.py", quotes=False, status=CANNOT_SHOW)
        said = f"could not show what it is for here: transformers {transformers.__version__}"
        assert said in run.stdout and run.events == []
        return
    path: list[str] = []
    if kernels == "installed":
        where = os.environ.get("TEST_KERNELS_DIR")
        if not where:
            pytest.skip(f"no kernels package here: {os.environ.get('TEST_KERNELS_ABSENT', '')}")
        path = [where]
    run = run_example("hub_kernel_air_gapped.py", *path, quotes=kernels == "absent")
    assert "without attnguard: " in run.stdout and "Error" in run.stdout.split("without")[1]
    assert run.events == ["backend_fallback"]
    (fallback,) = run.caused()
    assert fallback["rule"] == "hub-on-sdpa" and fallback["selected"] == "sdpa_twin"
    assert fallback["reason_code"].startswith("hub_")
    assert fallback["hub_kernel"] == "kernels-community/flash-attn2"
    assert "its kernel calls computed by attnguard's SDPA twins of the flash-attn 2" in run.stdout
    how_it_works_says("hub_kernel_air_gapped.py", run)
    assert "Generated tokens: " in run.stdout
    # what to change: this machine's words (no other model told it the device), and the versions
    # transformers accepts, which travel with the summary (a GPU's words name them)
    (summary,) = [e for e in run.logged if e["event"] == "summary"]
    (row,) = summary["advice"]
    facts = summary["facts"]
    if not torch.cuda.is_available():
        assert facts["device"] == "cpu"
        cpu = "flash-attn runs on CUDA GPUs only, so there is nothing to install on this machine"
        assert row["hint"].startswith(cpu) and "GPU (sm80" not in row["hint"], row["hint"]
    accepted = facts["kernels"]["accepted"].get("transformers")
    gpu = Facts.of({**facts, "device": "cuda", "capability": "9.0"}).for_sites([fallback["site"]])
    hint = hint_for("backend_fallback", row["reason_code"], gpu)
    if row["reason_code"] == "hub_package_refused":
        installed = facts["kernels"]["installed"]
        assert f"`kernels` {installed} is installed and transformers accepts only" in hint
        assert f"install kernels{accepted} if your package index has such a release" in hint
    elif row["reason_code"] == "hub_package_missing" and accepted:
        assert f"install kernels{accepted} (transformers accepts only these)" in hint


@pytest.mark.skipif(not HAS_XFORMERS, reason="xformers is not installed (scripts/test.sh does)")
def test_xformers_unusable_carries_every_bias_type_on_sdpa() -> None:
    run = run_example("xformers_unusable.py")
    assert "No operator found for `memory_efficient_attention_forward`" in run.stdout
    assert run.events == ["backend_rerouted"]  # once per call site, then latched
    assert run.caused()[0]["reason_code"] == "cpu_tensors"
    how_it_works_says("xformers_unusable.py", run)  # it said kernel_error_recovered
    # what to change, for an xformers call: nothing about flash kernels
    (summary,) = [e for e in run.logged if e["event"] == "summary"]
    assert summary["advice"] and all("flash" not in a["hint"] for a in summary["advice"])
    assert "flash" not in summary["reason"]
    if not torch.cuda.is_available():  # one branch: this machine's
        (row,) = summary["advice"]
        assert row["hint"].startswith("this kernel runs on CUDA only and this machine has no GPU")
        assert "pass it tensors on the GPU" not in row["hint"]
    assert set(run.errors) == {"tensor bias", "LowerTriangularMask", "BlockDiagonalMask"}
    close_to_reference(run, 0.005)  # fp16 rounding; a wrong mask costs ~2.7


def test_diffusers_flash_backend_runs_on_the_twin_with_natives_numbers() -> None:
    diffusers_dispatch()  # or skip, saying why diffusers is not here
    run = run_example("diffusers_flash_backend.py")
    if "without attnguard: RuntimeError: Flash Attention backend 'flash' is not usable" not in (
        run.stdout
    ):
        pytest.skip("flash-attn can be used here: nothing for the guard to carry")
    assert run.events == ["qkv_unified", "backend_fallback"]
    assert [(e["site"], e["reason_code"]) for e in run.caused()] == [
        ("diffusers.native", "mixed_dtypes"),
        ("diffusers.flash", "backend_package_unusable"),
    ]
    assert "Expected query, key, and value to have the same dtype" in run.stdout
    how_it_works_says("diffusers_flash_backend.py", run)
    # what to change, for a diffusers backend: diffusers' words, not transformers'
    (summary,) = [e for e in run.logged if e["event"] == "summary"]
    assert summary["advice"] and all(
        "attn_implementation" not in a["hint"] for a in summary["advice"]
    )
    fallback = next(a for a in summary["advice"] if a["event"] == "backend_fallback")
    assert 'set_attention_backend("native")' in fallback["hint"]
    if not torch.cuda.is_available():  # this machine's words, its device recorded
        assert summary["facts"]["device"] == "cpu"
        assert "nothing to install on this machine" in fallback["hint"]
        assert "for this torch and GPU" not in fallback["hint"]
    assert set(run.errors) == {"flash vs native", "mixed dtypes"}
    close_to_reference(run, 1e-6)  # the same numbers as diffusers' native backend


def test_the_recorded_lines_name_the_release_they_were_recorded_with() -> None:
    """README's "What you see" lines name the transformers and torch they were recorded with:
    the newest transformers the test runs use and CI's torch (attnguard/support.py), so a new
    release in that table fails here until the lines are recorded again with it (where it is
    installed, every line is checked against the examples' output: check_quotes)."""
    assert RECORDED_WITH == support.TRANSFORMERS_NEWEST
    assert f"lines recorded with transformers {RECORDED_WITH}, torch {support.TORCH_CI};" in README


# an example that cannot show what it is for here: what it lacks, made absent
CANNOT = [
    ("xformers_unusable.py", ("xformers",), "xformers is not installed"),
    ("family_d_custom_attention.py", ("xformers", "flash_attn"), "neither xformers nor flash"),
    ("diffusers_flash_backend.py", ("diffusers",), "diffusers is not installed"),
    ("family_c_torchrun_device_map.py", ("accelerate",), "accelerate is not installed"),
]


@pytest.mark.parametrize(("name", "missing", "said"), CANNOT, ids=[c[0] for c in CANNOT])
def test_an_example_that_cannot_show_what_it_is_for_exits_3(
    name: str, missing: tuple[str, ...], said: str
) -> None:
    """A script or CI that runs an example reads "not shown" from its exit status, never
    success; the one line says what is missing (docs/examples.md)."""
    run = run_example(name, quotes=False, status=CANNOT_SHOW, missing=missing)
    assert f"could not show what it is for here: {said}" in run.stdout
    assert run.events == []
    assert CANNOT_SHOW == 3 and "exits with status 3" in DOCS_EXAMPLES


def test_the_family_c_example_gets_accelerate_from_an_extra() -> None:
    """Family C needs accelerate (``device_map``): the ``examples`` extra installs it, and
    README's Install says so."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    assert any(r.startswith("accelerate") for r in extras["examples"])
    said = "`examples` (accelerate, which `examples/family_c_torchrun_device_map.py` needs"
    assert said in " ".join(README.split())
