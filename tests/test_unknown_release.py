"""Never silently different numbers, on transformers releases that do not exist yet.

Each case rewrites the installed transformers' flash module the way a future release might
(tests/workers/release_sim.py: a version number no table names, a private helper renamed, a
changed signature, a different order or a new element in what the kernel resolver returns, a
different sliding-window convention, packed rows no longer detected), then loads tiny Llama and
Mistral checkpoints with ``attn_implementation="flash_attention_2"`` where flash-attn is not
installed, once without attnguard and once with it. Guarded, every case ends one of two ways:

* **exact**: transformers' flash path kept on the twins, computing flash's numbers -- the packed
  row's second sequence equals that sequence run alone, the windowed model equals a float64 eager
  reference with the window this release gives flash-attn (and not the other convention's);
* **aside**: the load fails with exactly the error it fails with unguarded, and one ``observed``
  event (``flash_path_unrecognised``) says what was not recognised.

Never a third outcome (a load that runs with other numbers). Which outcome each case must have is
fixed below: a recognised change is exact, an unrecognised one aside.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from workers.release_sim import SIMULATIONS, make

WORKER = Path(__file__).parent / "workers" / "release_sim.py"
EXPECTED = {
    "version_5_99": "exact",
    "lazy_renamed": "aside",
    "forward_renamed": "exact",
    "forward_signature": "exact",
    "lazy_extra_param": "exact",
    "lazy_param_order": "aside",
    "return_order": "exact",
    "new_role": "aside",
    "window_convention": "exact",
    "kernel_renamed": "aside",
    "packing_changed": "aside",
}
assert set(EXPECTED) == set(SIMULATIONS)


def _run(args: tuple[str, str, Path]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNGUARD")}
    proc = subprocess.run(
        [sys.executable, str(WORKER), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    if proc.returncode == 3:
        return {"not_applicable": json.loads(proc.stdout.splitlines()[-1])["not_applicable"]}
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict[str, Any]]:
    root = tmp_path_factory.mktemp("release_sim")
    make(root)
    jobs = [(sim, mode, root) for sim in SIMULATIONS for mode in ("plain", "guard")]
    with ThreadPoolExecutor(max_workers=2) as pool:  # one interpreter per core
        results = list(pool.map(_run, jobs))
    return {(sim, mode): r for (sim, mode, _), r in zip(jobs, results, strict=True)}


@pytest.mark.parametrize("simulation", list(SIMULATIONS))
def test_a_future_release_is_exact_or_aside(runs: Any, simulation: str) -> None:
    plain, guard = runs[(simulation, "plain")], runs[(simulation, "guard")]
    if "not_applicable" in plain:
        pytest.skip(
            f"this transformers release has no such code to change: {plain['not_applicable']}"
        )
    assert "error" in plain, "unguarded, the flash request fails where flash-attn is missing"
    changes = [e for e in guard["events"] if e["event"] != "observed"]
    if EXPECTED[simulation] == "exact":
        assert "error" not in guard, guard.get("error")
        assert guard["attn"] == "flash_attention_2"
        assert [(e["event"], e["rule"]) for e in changes] == [("backend_fallback", "flash-on-sdpa")]
        assert guard["packed_err"] <= 1e-5, "the packed row's sequences stay apart"
        assert guard["window_err"] <= 1e-4, "the window is the one this release gives flash"
        assert guard["window_err_other"] > 1e-3, "the other window convention is told apart"
        assert guard["registry"] == {"shape": [1, 6, 4, 16]}, "a direct registry call runs too"
    else:
        assert guard.get("error") == plain["error"], "the error the user would have had"
        assert changes == [], "nothing changed"
        said = [e for e in guard["events"] if e["reason_code"] == "flash_path_unrecognised"]
        assert [e["event"] for e in said] == ["observed"], "one event says why, at the load"
        assert "does not recognise" in said[0]["reason"]
        # a direct call of the registry's flash entry: the same error, and said once
        assert guard["registry"] == plain["registry"] and "error" in plain["registry"]
        assert guard["registry_events"] == [["observed", "flash_path_unrecognised"]]


def test_the_probe_is_silent_and_leaves_the_program_alone() -> None:
    """The first-use check of the installed release's flash path (it ran for the loads above)
    passes here, emits nothing, draws nothing from the global RNG and leaves transformers'
    kernel cache empty: the next flash call resolves its kernels as if no probe had run."""
    import torch
    import transformers.modeling_utils  # noqa: F401

    import attnguard
    from attnguard.integrations.transformers import flash_path, flash_state
    from attnguard.integrations.transformers import probe as transformers_probe
    from attnguard.observability import events

    attnguard.activate(log="none")
    try:
        module, wiring = flash_state.state.module, flash_path.wiring()
        assert module is not None and wiring is not None, flash_path.unrecognised()
        before = torch.get_rng_state()
        with events.capture() as seen:
            result = transformers_probe.run(
                module,
                wiring,
                kernels=flash_path.kernels_by_role,
                swapped=flash_path.swapped_kernels,
            )
        assert result.ok, result.reason
        assert len(result.cases) == len(transformers_probe._CASES)
        assert result.window_offset in ((0, 0), (-1, -1))
        assert seen == []
        assert torch.equal(torch.get_rng_state(), before)
        assert all(getattr(module, n, None) is None for n in wiring.caches)
    finally:
        attnguard.deactivate()
