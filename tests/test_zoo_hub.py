"""The zoo's models whose flash request transformers routes to a hub kernel (their class lists
the flash kernels it works with, ``_compatible_flash_implementations``: GPT-OSS and its kin to
``kernels-community/vllm-flash-attn3``, MiniMax M3 to ``MiniMaxAI/msa``), enumerated at run time,
checked by tests/test_zoo.py in a fresh interpreter with the real ``kernels`` package installed
($TEST_KERNELS_DIR, from scripts/test.sh) on an air-gapped machine (``HF_HUB_OFFLINE=1``, an empty
cache): each must be exact (the twins compute the hub kernel's functions, sinks included) or
aside (exactly the unguarded error, one event), as the zoo defines them.
"""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import pytest
from helpers.processes import PY, REPO, subprocess_env
from workers import zoo

KERNELS = os.environ.get("TEST_KERNELS_DIR")


def _routed() -> list[str]:
    import importlib

    import transformers

    found = []
    for entry in zoo.entries():
        module = importlib.import_module(getattr(transformers, entry.cls_name).__module__)
        if any(
            getattr(v, "_compatible_flash_implementations", None)
            for v in vars(module).values()
            if isinstance(v, type)
        ):
            found.append(entry.model_type)
    return sorted(found)


def test_routed_models_with_kernels_installed_and_air_gapped(tmp_path: Any) -> None:
    if not KERNELS:
        pytest.skip(f"needs the kernels package: {os.environ.get('TEST_KERNELS_ABSENT', '')}")
    routed = _routed()
    if not routed:
        pytest.skip("this transformers release routes no model's flash request")
    env = subprocess_env(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf-home"),  # empty
        TEST_ZOO_SELECT=",".join(routed),
        TEST_ZOO="",
    )
    env["PYTHONPATH"] = os.pathsep.join([KERNELS, env["PYTHONPATH"]])
    probe = subprocess.run(
        [PY, "-c", "import kernels; print(kernels.__version__)"], env=env, capture_output=True
    )
    assert probe.returncode == 0, "kernels imports in the zoo's interpreter"
    res = subprocess.run(
        [
            PY,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rs",
            "tests/test_zoo.py",
            "-k",
            "test_zoo_model",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    tail = res.stdout[-6000:]
    assert res.returncode == 0, tail
    passed = re.search(r"(\d+) passed", tail)
    assert passed and int(passed.group(1)) >= 1, tail
