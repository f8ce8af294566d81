"""attnguard's import finder beside other finders on ``sys.meta_path``, in fresh interpreters.

A finder put in front of attnguard's (typeguard's import hook, a plugin's loader) used to take a
watched module past it: the guard was active, yet ``transformers.modeling_utils`` was never
patched (no event, the flash load failed as unguarded). attnguard's finder moves back to the
front, asking the finders behind it in their order, so theirs still loads (and transforms) the
module. A finder that raises makes the import fail as it does without attnguard.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from helpers.processes import PY, subprocess_env

HANG_S = 200

LOAD = """
import json, sys, torch, transformers
from attnguard import runtime
def flash_load():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    try:
        transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="flash_attention_2")
        return "ok"
    except Exception as exc:
        return type(exc).__name__
def report(**extra):
    import transformers.modeling_utils as mu
    print("RESULT " + json.dumps({"load": flash_load(), "active": runtime.is_active(),
        "patched": sorted(p.rsplit(".", 1)[-1] for _, p in runtime.patched_parts()),
        "loader": type(mu.__loader__).__name__, **extra}))
"""

FRONT_FINDER = """
import importlib.machinery, sys
class Front:  # what typeguard's finder does: PathFinder's spec, with a loader of its own
    def find_spec(self, name, path=None, target=None):
        if name != "transformers.modeling_utils":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        spec.loader = Loader(spec.loader.name, spec.loader.path)
        return spec
class Loader(importlib.machinery.SourceFileLoader):
    def exec_module(self, module):
        super().exec_module(module)
        module.LOADED_BY_FRONT = True
"""


def program(entry: str, finder: str) -> str:
    lines = [f"import faulthandler; faulthandler.dump_traceback_later({HANG_S}, exit=True)"]
    if entry == "import":
        lines.append("import attnguard")
    if finder == "typeguard":
        lines.append("from typeguard import install_import_hook")
        lines.append("install_import_hook(['transformers.modeling_utils'])")
    else:
        lines += [FRONT_FINDER, "sys.meta_path.insert(0, Front())"]
    lines += [LOAD, "import transformers.modeling_utils as mu"]
    lines.append("report(front=getattr(mu, 'LOADED_BY_FRONT', False))")
    return "\n".join(lines)


def run(code: str, guarded: bool) -> dict:
    env = subprocess_env(
        HF_HUB_OFFLINE="1", ATTNGUARD="1" if guarded else "0", ATTNGUARD_LOG="none"
    )
    res = subprocess.run(
        [PY, "-c", code], env=env, capture_output=True, text=True, timeout=HANG_S + 60
    )
    assert "Timeout (" not in res.stderr, res.stderr[-4000:]
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))[7:])


@pytest.mark.parametrize("entry", ["hook", "import"])
@pytest.mark.parametrize("finder", ["front", "typeguard"])
def test_a_finder_put_in_front_of_attnguards_still_gets_the_module_patched(
    entry: str, finder: str
) -> None:
    """``hook``: ATTNGUARD=1, the finder inserted before attnguard activates (at the first
    transformers import); ``import``: ``import attnguard`` first, the finder inserted after."""
    if finder == "typeguard":
        pytest.importorskip("typeguard")
    got = run(program(entry, finder), guarded=True)
    assert got["active"] is True
    assert got["patched"] == ["availability", "modeling"], got
    assert got["load"] == "ok", got
    if finder == "typeguard":
        assert got["loader"] == "TypeguardLoader"  # its instrumentation stands
    else:
        assert got["front"] is True and got["loader"] == "Loader"


RAISING = """
import sys
class Raising:
    def find_spec(self, name, path=None, target=None):
        if name == "transformers.modeling_utils":
            raise RuntimeError("this finder refuses " + name)
        return None
sys.meta_path.insert({at}, Raising())
try:
    import transformers.modeling_utils
    print("RESULT imported")
except RuntimeError as exc:
    print("RESULT " + str(exc))
"""


@pytest.mark.parametrize("at", [0, 1])
def test_a_finder_that_raises_fails_the_import_as_unguarded(at: int) -> None:
    code = "import attnguard\n" + RAISING.format(at=at) if at else RAISING.format(at=at)
    results = []
    for guarded in (False, True):
        env = subprocess_env(HF_HUB_OFFLINE="1", ATTNGUARD="1" if guarded else "0")
        res = subprocess.run([PY, "-c", code], env=env, capture_output=True, text=True, timeout=200)
        results.append((res.returncode, res.stdout))
    assert (
        results[0] == results[1] == (0, "RESULT this finder refuses transformers.modeling_utils\n")
    )
