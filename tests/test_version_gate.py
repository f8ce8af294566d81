"""Each integration declares the versions it supports once (its entry in attnguard.integrations.REGISTRY); outside
them it does not patch, and one ``observed`` event (``version_unsupported``) says why.

The out-of-range runs are a user's program in a fresh interpreter whose installed library reports
a version outside the window (transformers 4.45 or a future 6.0: the gate reads the version the
imported package reports, so the test sets that before attnguard sees the package). CI's smoke
lane also runs the gate against a real out-of-range transformers install (tests/smoke).
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers.processes import PY, subprocess_env

from attnguard.integrations import REGISTRY, by_name
from attnguard.integrations.protocol import Integration, release


def unsupported(name: str, version: str | None) -> str | None:
    return by_name(name).supports(version)


# CI's smoke lanes run the marked ones on every transformers release it covers; the simulated
# out-of-window releases (a fresh interpreter each, the same for any installed release) run in the
# full lanes.


@pytest.mark.smoke
def test_every_integration_declares_its_versions() -> None:
    assert all(isinstance(i, Integration) for i in REGISTRY)
    assert len({i.name for i in REGISTRY}) == len(REGISTRY)
    assert all(i.parts and i.distribution and i.package for i in REGISTRY)


@pytest.mark.parametrize(
    ("name", "version", "ok"),
    [
        ("transformers", "4.45.2", False),
        ("transformers", "4.48.3", False),
        ("transformers", "4.49.0", True),
        ("transformers", "4.57.6", True),
        ("transformers", "5.23.0", True),
        ("transformers", "5.99.0.dev0", True),
        ("transformers", "6.0.0", False),
        ("transformers", "6.0.0rc1", False),
        ("flash_attn", "2.5.9.post1", False),
        ("flash_attn", "2.8.3.post2", True),
        ("flash_attn", "3.0.0b1", False),
        ("xformers", "0.0.26.post1", False),
        ("xformers", "0.0.35", True),
        ("xformers", "0.1.0", False),
        ("transformers", "", False),
        ("transformers", None, False),
    ],
)
@pytest.mark.smoke
def test_the_declared_window(name: str, version: str | None, ok: bool) -> None:
    why = unsupported(name, version)
    assert (why is None) == ok, why
    if not ok:
        dist = by_name(name).distribution
        assert dist in why and ">=" in why and "<" in why  # names the library and the window


@pytest.mark.smoke
def test_release_numbers() -> None:
    assert release("2.8.3.post2") == (2, 8, 3)
    assert release("5.0.0.dev0") == (5, 0, 0)
    assert release("garbage") == ()


PROGRAM = """
import json, sys
import torch, transformers
transformers.__version__ = sys.argv[1]  # what the installed package would report
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel
before = dict(vars(PreTrainedModel))
import attnguard  # activates: patches the already imported transformers at once, or does not
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=2)
AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(sys.argv[2], attn_implementation="sdpa")
out = model(torch.tensor([[1, 2, 3]])).logits
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[2], attn_implementation="flash_attention_2")
    flash = "loaded"
except Exception as exc:
    flash = type(exc).__name__
print(json.dumps({
    "guarded": attnguard.is_active(),
    "patched": sorted(attnguard.runtime.patched_integrations()),
    "loading_untouched": all(vars(PreTrainedModel).get(k) is v for k, v in before.items()),
    "finite": bool(torch.isfinite(out).all()),
    "flash": flash,
}))
"""


def run_program(version: str, tmp_path: Path, guarded: bool) -> tuple[dict, list[dict]]:
    log = tmp_path / f"events-{version}-{guarded}.jsonl"
    env = subprocess_env(HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    # activated by the program's `import attnguard`, unless switched off
    if guarded:
        env["ATTNGUARD_LOG"] = str(log)
    else:
        env["ATTNGUARD"] = "0"
    proc = subprocess.run(
        [PY, "-c", textwrap.dedent(PROGRAM), version, str(tmp_path / f"ckpt-{version}")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    evts = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return json.loads(proc.stdout.strip().splitlines()[-1]), evts


@pytest.mark.parametrize("version", ["4.45.2", "6.0.0"])
def test_outside_the_window_nothing_is_patched_and_one_event_says_why(
    version: str, tmp_path: Path
) -> None:
    plain, _ = run_program(version, tmp_path, guarded=False)
    got, evts = run_program(version, tmp_path, guarded=True)
    assert got["guarded"] and not plain["guarded"]
    assert "transformers" not in got["patched"]
    assert got["loading_untouched"]
    # the program behaves exactly as unguarded: the flash load fails the way it fails there
    assert (got["finite"], got["flash"]) == (plain["finite"], plain["flash"])
    gate = [e for e in evts if e["reason_code"] == "version_unsupported"]
    assert len(gate) == 1
    assert gate[0]["event"] == "observed" and gate[0]["version"] == version
    assert f"transformers {version}" in gate[0]["reason"] and ">=4.49,<6" in gate[0]["reason"]
    acted = [e for e in evts if e["event"] not in ("activated", "summary", "observed")]
    assert acted == []  # no remedy on internals never tested


@pytest.mark.smoke
def test_the_installed_transformers_is_patched_exactly_when_supported(tmp_path: Path) -> None:
    """The real install: CI's matrix runs this on every supported minor release and on one
    below the window (4.45), where the guard must stand aside."""
    import transformers

    version = transformers.__version__
    got, evts = run_program(version, tmp_path, guarded=True)
    gate = [e for e in evts if e["reason_code"] == "version_unsupported"]
    if unsupported("transformers", version) is None:
        assert "transformers" in got["patched"] and not got["loading_untouched"]
        assert got["flash"] == "loaded"  # flash requested, unusable here: the guard's fallback
        assert gate == []
    else:
        plain, _ = run_program(version, tmp_path, guarded=False)
        assert "transformers" not in got["patched"] and got["loading_untouched"]
        assert got["flash"] == plain["flash"]
        assert [e["version"] for e in gate] == [version]
