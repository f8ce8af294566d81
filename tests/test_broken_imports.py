"""flash-attn installed but its CUDA extension broken: what ``from flash_attn import ...`` and
``import xformers.ops`` do under the guard.

attnguard's choice: both imports keep failing exactly as they do without it, with the same
ImportError, so code that checks for them (``try: from flash_attn import flash_attn_func`` /
``except ImportError:``) takes the path its author wrote for "no flash-attn". Handing that code
the SDPA twins instead would make it believe flash-attn is there and go on to the parts of
flash-attn attnguard does not provide (its rotary, layer-norm and cross-entropy kernels,
``flash_attn.ops``...). Models that ask transformers for flash attention get the twins through
transformers' flash path (tests/test_load_guard.py); that is where attnguard steps in.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers.processes import PY, subprocess_env

BROKEN = os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR")
pytestmark = pytest.mark.skipif(
    BROKEN is None, reason="needs the broken flash-attn build of scripts/test.sh"
)

USER_PROGRAM = """
import json
out = {}
try:
    from flash_attn import flash_attn_func
    out["flash_attn"] = "imported"
except ImportError as exc:
    out["flash_attn"] = "ImportError: " + str(exc).splitlines()[0]
try:
    import xformers.ops
    out["xformers"] = "imported"
except ImportError as exc:
    out["xformers"] = "ImportError: " + str(exc).splitlines()[0]
out["attnguard_active"] = __import__("sys").modules.get("attnguard") is not None
print("RESULT" + json.dumps(out))
"""


def run(guarded: bool) -> tuple[dict, subprocess.CompletedProcess]:
    env = subprocess_env(ATTNGUARD_LOG="none")
    env["PYTHONPATH"] = os.pathsep.join([BROKEN or "", env["PYTHONPATH"]])
    if guarded:
        env["ATTNGUARD"] = "1"
    res = subprocess.run([PY, "-c", USER_PROGRAM], env=env, capture_output=True, text=True)
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    assert res.returncode == 0 and line, res.stderr[-3000:]
    return json.loads(line[0][len("RESULT") :]), res


def test_both_imports_fail_as_without_the_guard() -> None:
    plain, _ = run(guarded=False)
    guarded, res = run(guarded=True)
    assert guarded.pop("attnguard_active") is True and plain.pop("attnguard_active") is False
    assert guarded == plain
    assert plain["flash_attn"] == "ImportError: No module named 'flash_attn_2_cuda'"
    # xformers imports flash_attn itself when it finds it: the same error reaches its importer
    assert plain["xformers"] == "ImportError: No module named 'flash_attn_2_cuda'"
