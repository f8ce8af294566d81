"""The exit summary's advice in the words of the library that made the request, for the machine
it ran on: diffusers' words (``set_attention_backend("native")``) for diffusers' requests, never
transformers' ``attn_implementation``; the device recorded for every process that had an event
(diffusers' and xformers' too), so one branch is said, the machine's; the ``kernels`` versions a
library accepts named where the installed one is refused. And ``attnguard doctor``'s hub lines:
a package that is absent is not "refused"; a ``*_hub`` backend is "usable" only where its hub
kernel loads or a build of it is on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import tiny_config
from helpers.packages import diffusers_dispatch
from helpers.processes import PY, subprocess_env

from attnguard.observability import advice, events, summary, workload
from attnguard.observability.advice import Facts
from attnguard.observability.reasons import REASONS
from attnguard.observability.report import hint_for

SDPA = 'attn_implementation="sdpa"'
NATIVE = 'set_attention_backend("native")'
HUB = ("hub_package_missing", "hub_package_refused", "hub_kernel_unavailable")
CPU = Facts(device="cpu", twin_calls=True)
H100 = Facts(device="cuda", capability=(9, 0), twin_calls=True)
WINDOW = (("transformers", ">=0.18.2,<0.19.0"),)


def _hint(facts: Facts, code: str, *sites: str) -> str:
    return hint_for("backend_fallback", code, facts.for_sites(sites))


# --- the library of a request ------------------------------------------------------------------


@pytest.mark.parametrize("code", HUB)
@pytest.mark.parametrize("facts", [CPU, H100, Facts()], ids=["cpu", "h100", "unknown"])
def test_a_diffusers_hub_request_gets_diffusers_words(code: str, facts: Facts) -> None:
    hint = _hint(facts, code, "diffusers.hub_kernel:kernels-community/flash-attn2")
    assert "attn_implementation" not in hint and NATIVE in hint, hint
    transformers = _hint(facts, code, "transformers.hub_kernel:kernels-community/flash-attn2")
    assert SDPA in transformers and NATIVE not in transformers


def test_a_row_of_both_libraries_speaks_to_each() -> None:
    hint = _hint(
        H100,
        "hub_package_missing",
        "transformers.hub_kernel:kernels-community/flash-attn2",
        "diffusers.hub_kernel:kernels-community/flash-attn2",
    )
    assert SDPA in hint and "; for diffusers: set the model's attention backend" in hint, hint


def test_a_diffusers_backend_on_a_cpu_is_not_told_to_install_for_a_gpu() -> None:
    hint = _hint(Facts(device="cpu"), "backend_package_unusable", "diffusers.flash")
    assert "nothing to install on this machine" in hint and NATIVE in hint
    assert "for this torch and GPU" not in hint
    assert "for this torch and GPU" in _hint(H100, "backend_package_unusable", "diffusers.flash")


@pytest.mark.parametrize("code", ["head_dim_unsupported", "mask_4d", "gpu_too_old"])
def test_a_programs_own_flash_calls_are_not_told_to_request_a_backend(code: str) -> None:
    hint = hint_for("backend_rerouted", code, H100.for_sites(["flash_attn.flash_attn_func"]))
    assert "attn_implementation" not in hint and "attnguard's twin computes these calls" in hint


# --- the kernels window --------------------------------------------------------------------------


def test_a_refused_kernels_release_is_told_the_window_and_what_works_instead() -> None:
    facts = Facts(
        device="cuda",
        capability=(9, 0),
        twin_calls=True,
        kernels_seen=True,
        kernels_installed="0.17.2",
        kernels_accepted=WINDOW,
    )
    hint = _hint(facts, "hub_package_refused", "transformers.hub_kernel:kernels-community/x")
    assert hint.startswith(
        "`kernels` 0.17.2 is installed and transformers accepts only kernels>=0.18.2,<0.19.0: "
        "install kernels>=0.18.2,<0.19.0 if your package index has such a release; otherwise "
        "use a transformers release that accepts a `kernels` your index has, or install "
        "flash-attn for this torch and GPU"
    ), hint
    assert SDPA in hint  # and what computes the same numbers meanwhile
    missing = _hint(
        Facts(device="cuda", capability=(9, 0), kernels_seen=True, kernels_accepted=WINDOW),
        "hub_package_missing",
        "transformers.hub_kernel:kernels-community/x",
    )
    assert missing.startswith("install kernels>=0.18.2,<0.19.0 (transformers accepts only these)")


def test_the_window_travels_with_the_summary_and_is_checked() -> None:
    workload.note_kernels("0.17.2", "transformers", ">=0.18.2,<0.19.0")
    facts = summary.local_fields()["facts"]
    assert facts["kernels"] == {
        "installed": "0.17.2",
        "accepted": {"transformers": ">=0.18.2,<0.19.0"},
    }
    odd = {"kernels": {"installed": "0.17.2; rm -rf /", "accepted": {"transformers": "x"}}}
    assert workload.clean(odd) == {}
    bad_spec = {"kernels": {"installed": None, "accepted": {"transformers": "$(id)"}}}
    assert workload.clean(bad_spec) == {"kernels": {"installed": None, "accepted": {}}}


# --- the device of every process that had an event --------------------------------------------


def test_an_event_records_this_machines_device(guard: Any) -> None:
    """No decision read the GPUs (an xformers or diffusers call, a hub kernel): the process's
    first event records whether CUDA is there, without touching a GPU."""
    events.emit(
        "backend_rerouted",
        site="xformers.memory_efficient_attention",
        reason_code="cpu_tensors",
        reason="x",
        applied=True,
    )
    device = summary.local_fields()["facts"].get("device")
    assert device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_packed_rows_are_recorded_under_autocast(guard: Any, tmp_path: Path) -> None:
    """Mixed-precision training (q, k float32 from the rotary embedding, v bf16): the registry
    call is remedied (its dtypes unified) and what reached the twins is recorded all the same."""
    import transformers

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(tiny_config("llama")).save_pretrained(tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="flash_attention_2"
    )
    lengths = (5, 7, 4)
    row = torch.randint(3, 128, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(row, position_ids=positions, labels=row, use_cache=False).loss.backward()
    assert workload.seen(workload.PACKED_ROWS_APART) or workload.seen(workload.PACKED_ROWS)


# --- a CPU diffusers program, end to end ---------------------------------------------------------

PROGRAM = textwrap.dedent(
    """
    import logging, sys
    import attnguard
    import torch
    from diffusers import FluxTransformer2DModel
    logging.getLogger("diffusers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    model = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1,
        num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    inputs = {"hidden_states": torch.randn(2, 16, 8), "encoder_hidden_states": torch.randn(2, 8, 32),
        "pooled_projections": torch.randn(2, 32), "timestep": torch.ones(2),
        "img_ids": torch.zeros(16, 3), "txt_ids": torch.zeros(8, 3), "return_dict": False}
    with torch.no_grad():
        native = model(**inputs)[0]
    model.set_attention_backend(sys.argv[1])
    with torch.no_grad():
        out = model(**inputs)[0]
    print("MAX_DIFF", (out - native).abs().max().item())
    """
)


@pytest.mark.parametrize("backend", ["flash", "flash_hub"])
def test_a_cpu_diffusers_program_is_advised_in_diffusers_words(
    tmp_path: Path, backend: str
) -> None:
    diffusers_dispatch()  # or skip, saying why diffusers is not here
    env = subprocess_env(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path),
        ATTNGUARD_LOG="stderr",
        ATTNGUARD_LOG_FORMAT="json",
    )
    env.pop("LOCAL_KERNELS", None)
    res = subprocess.run(
        [PY, "-c", PROGRAM, backend], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "MAX_DIFF 0.0" in res.stdout
    logged = [json.loads(x) for x in res.stderr.splitlines() if x.startswith('{"schema"')]
    (summary_event,) = [e for e in logged if e["event"] == "summary"]
    (row,) = summary_event["advice"]
    assert "attn_implementation" not in row["hint"] and NATIVE in row["hint"], row["hint"]
    if not torch.cuda.is_available():
        assert summary_event["facts"]["device"] == "cpu"
        assert "nothing to install on this machine" in row["hint"]
        assert "GPU (sm80" not in row["hint"] and "for this torch and GPU" not in row["hint"]


# --- every reason, every library, every machine ----------------------------------------------------

GRID = [
    Facts(device=d, capability=c, twin_calls=True, packed_rows=p, sdpa_refused=r)
    for d, c in ((None, None), ("cpu", None), ("cuda", (9, 0)), ("cuda", (7, 0)))
    for p in (False, True)
    for r in ((), ("PegasusXForConditionalGeneration",))
]
SITES = (
    ("diffusers.flash",),
    ("diffusers.hub_kernel:kernels-community/flash-attn2",),
    ("xformers.memory_efficient_attention",),
)


@pytest.mark.parametrize("code", sorted(REASONS))
def test_no_reason_tells_a_diffusers_or_xformers_request_to_set_attn_implementation(
    code: str,
) -> None:
    for facts in GRID:
        for sites in SITES:
            hint = advice.render(REASONS[code].hint, facts.for_sites(sites))
            assert SDPA not in hint, (code, sites, facts, hint)
            if facts.device in ("cpu", "cuda") and sites[0].startswith("xformers"):
                assert "on a machine without a GPU:" not in hint, (code, hint)  # one branch


# --- attnguard doctor ---------------------------------------------------------------------------


def _doctor(tmp_path: Path, *path: str, offline: bool = True) -> str:
    env = subprocess_env(HF_HUB_OFFLINE="1" if offline else "0", HF_HOME=str(tmp_path / "hf"))
    env.pop("LOCAL_KERNELS", None)
    env["PYTHONPATH"] = os.pathsep.join([*path, env["PYTHONPATH"]])
    res = subprocess.run(
        [PY, "-m", "attnguard", "doctor"], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_doctor_says_an_absent_kernels_package_is_absent_not_refused(tmp_path: Path) -> None:
    from attnguard.integrations.transformers import hub

    data = {
        "kernels": None,
        "accepted": ">=0.18.2,<0.19.0",
        "refused": "the `kernels` package is not installed",
        "offline": True,
        "flash_requests": {},
        "here": [],
        "tried": [],
    }
    head = hub.report_lines(data)[0]
    assert head.startswith("  kernels: not installed (this transformers accepts kernels>=0.18.2")
    assert "refused" not in head
    refused = hub.report_lines({**data, "kernels": "0.17.2", "refused": "..."})[0]
    assert refused.startswith("  kernels 0.17.2: refused (this transformers accepts only kernels>=")
    accepted = hub.report_lines({**data, "kernels": "0.18.2", "refused": None})[0]
    assert accepted.startswith("  kernels 0.18.2: accepted")
    from attnguard.facts import hub as hub_facts

    (line,) = [x for x in _doctor(tmp_path).splitlines() if x.startswith("  kernels")]
    if hub_facts.kernels_version() is None:  # as on this test run's own path
        assert "refused" not in line and "not installed" in line, line


def test_doctor_calls_a_hub_backend_usable_only_where_its_kernel_can_load(tmp_path: Path) -> None:
    """Offline with an empty cache, diffusers' requirements check passes (``kernels`` at a
    version it accepts) and still its hub kernels cannot load: "usable no", and what then."""
    diffusers_dispatch()
    kernels = os.environ.get("TEST_KERNELS_DIR")
    if not kernels:
        pytest.skip(f"no kernels package here: {os.environ.get('TEST_KERNELS_ABSENT', '')}")
    rows = {
        line.split()[0]: line
        for line in _doctor(tmp_path, kernels).splitlines()
        if "_hub " in line and "usable" in line
    }
    assert "usable no" in rows["flash_hub"] and "it cannot load here" in rows["flash_hub"]
    assert "attnguard's twin of flash-attn 2's flash_attn_func" in rows["flash_hub"]
    online = {
        line.split()[0]: line
        for line in _doctor(tmp_path, kernels, offline=False).splitlines()
        if "_hub " in line and "usable" in line
    }
    assert "usable fetch" in online["flash_hub"]  # downloaded when chosen: not known to load
