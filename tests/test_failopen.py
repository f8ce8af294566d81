"""Fail-open corners: whatever attnguard does, the user's program keeps its results, output and
exit code. Each test is a user's program, run guarded and unguarded in fresh interpreters where
start-up, exit, pickling or ``-m`` matter, with real transformers models and the flash-attn
stand-in of tests/standins."""

from __future__ import annotations

import json
import pickle
import subprocess
import types
from pathlib import Path
from typing import Any

import pytest
from helpers.hook import env_for
from helpers.packages import STANDINS
from helpers.processes import PY, run_code

import attnguard

# --- 1. pickling ---------------------------------------------------------------------------------

POOL = """
import sys
if sys.argv[2] == "guarded":
    import attnguard
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import torch
from transformers import LlamaForCausalLM

if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        model = pool.submit(LlamaForCausalLM.from_pretrained, sys.argv[1]).result()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9, 2]])).logits
    print(type(model).__name__, logits.flatten()[:8].tolist())
"""


def test_from_pretrained_submitted_to_a_spawn_process_pool(tmp_path, tiny_checkpoint) -> None:
    """``pool.submit(Model.from_pretrained, path)`` pickles the bound classmethod."""
    script = tmp_path / "pool.py"
    script.write_text(POOL)
    path = str(tiny_checkpoint("llama"))
    outs = {}
    for mode in ("guarded", "unguarded"):
        res = subprocess.run(
            [PY, str(script), path, mode],
            env=env_for(ATTNGUARD_LOG="none"),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stderr[-3000:]
        outs[mode] = res.stdout
    assert outs["guarded"].startswith("LlamaForCausalLM [")
    assert outs["guarded"] == outs["unguarded"]


ATTENTION_INPUTS = """
import torch, transformers
torch.manual_seed(0)
cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
module = transformers.LlamaForCausalLM(cfg).model.layers[0].self_attn
# what the flash entry's real callers have: a model configured for flash attention (transformers'
# flash path asks the config which implementation it runs; the sdpa entry does not look)
module.config._attn_implementation = "flash_attention_2"
q = torch.randn(2, 4, 6, 16)
k, v = torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)

def run(fn):
    out = fn(module, q, k, v, None, dropout=0.0, scaling=0.25, is_causal=True)[0]
    return [round(x, 5) for x in out.flatten()[:16].tolist()]
"""

PICKLE_REGISTRY = (
    ATTENTION_INPUTS
    + """
import pickle, sys, json
import attnguard
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
blobs, outs = {}, {}
for key in ("sdpa", "flash_attention_2"):
    fn = ALL_ATTENTION_FUNCTIONS[key]
    blobs[key] = pickle.dumps(fn).hex()
    assert pickle.loads(bytes.fromhex(blobs[key])) is fn  # by reference, the very wrapper
    outs[key] = run(fn)
print(json.dumps({"blobs": blobs, "outs": outs}))
"""
)

UNPICKLE_REGISTRY = (
    ATTENTION_INPUTS
    + """
import pickle, sys, json
if sys.argv[2] == "guarded":
    import attnguard
    import transformers.modeling_utils  # where a guarded process wraps the registry
got = json.loads(sys.argv[1])
outs, names = {}, {}
for key, blob in got["blobs"].items():
    fn = pickle.loads(bytes.fromhex(blob))
    names[key] = f"{fn.__module__}.{fn.__qualname__}"
    try:
        outs[key] = run(fn)
    except Exception as exc:
        outs[key] = type(exc).__name__
print(json.dumps(outs))
print(json.dumps(names))
"""
)


def test_registry_entries_pickle_and_run_in_a_fresh_interpreter() -> None:
    made = run_code(PICKLE_REGISTRY, env=env_for(ATTNGUARD_LOG="none"))
    assert made.returncode == 0, made.stderr[-3000:]
    sent = json.loads(made.stdout)
    # guarded on CPU the flash entry runs transformers' flash path on the SDPA twins
    assert all(isinstance(v, list) for v in sent["outs"].values())
    arg = json.dumps({"blobs": sent["blobs"]})
    guarded = run_code(UNPICKLE_REGISTRY, arg, "guarded", env=env_for(ATTNGUARD_LOG="none"))
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    outs, names = map(json.loads, guarded.stdout.splitlines())
    assert outs == sent["outs"]  # that process's own guarded entries
    assert all(n.startswith("_attnguard_hook.attnguard:transformers/") for n in names.values())
    plain = run_code(UNPICKLE_REGISTRY, arg, "unguarded", env=env_for())
    assert plain.returncode == 0, plain.stderr[-3000:]
    outs, names = map(json.loads, plain.stdout.splitlines())
    # unguarded: transformers' own functions; sdpa computes the same, flash fails as it does
    # without attnguard on a machine without flash-attn
    assert names == {
        "sdpa": "transformers.integrations.sdpa_attention.sdpa_attention_forward",
        "flash_attention_2": "transformers.integrations.flash_attention.flash_attention_forward",
    }
    assert outs["sdpa"] == sent["outs"]["sdpa"] and isinstance(outs["flash_attention_2"], str)


GADGETS = [
    "attnguard:os:system",
    "attnguard:posix:system",
    "attnguard:subprocess:getoutput",
    "attnguard:builtins:exec",
    # a guarded library's module, reaching through to what it imported
    "attnguard:transformers/utils/import_utils:os/system",
    "attnguard:transformers/utils/import_utils:subprocess/getoutput",
]


@pytest.mark.parametrize("name", GADGETS)
@pytest.mark.parametrize("switch", ["0", "1"])
def test_the_hook_module_resolves_no_name_attnguard_did_not_wrap(
    name: str, switch: str, tmp_path: Path
) -> None:
    """A pickle naming ``_attnguard_hook`` / ``attnguard:os:system`` ran a shell command on
    ``pickle.load`` in any process of an environment with attnguard installed.
    Only functions of the guarded libraries, under their own names, may resolve."""
    mark = tmp_path / "ran"
    command = f"touch {mark}" if "exec" not in name else f"open({str(mark)!r}, 'w')"
    blob = b"c_attnguard_hook\n" + name.encode() + b"\n(V" + command.encode() + b"\ntR."
    code = "import pickle, sys; pickle.loads(bytes.fromhex(sys.argv[1]))"
    res = run_code(code, blob.hex(), env=env_for(ATTNGUARD=switch, ATTNGUARD_LOG="none"))
    assert not mark.exists(), f"{name} ran {command!r}"
    assert res.returncode == 1 and "AttributeError: Can't get attribute" in res.stderr, res.stderr


PICKLE_FLASH = """
import pickle, sys, json
import torch
if sys.argv[1] == "guarded":
    import attnguard
import flash_attn

torch.manual_seed(0)
q, k, v = (torch.randn(2, 5, 4, 16) for _ in range(3))
if sys.argv[2] == "dump":
    fn = flash_attn.flash_attn_func
    blob = pickle.dumps(fn)
    assert pickle.loads(blob) is fn
    out = fn(q, k, v, causal=True)
    print(json.dumps({"blob": blob.hex(), "out": [round(x, 5) for x in out.flatten().tolist()]}))
else:
    fn = pickle.loads(bytes.fromhex(sys.argv[2]))
    from flash_attn.flash_attn_interface import flash_attn_func
    print(fn is flash_attn_func)
    try:
        print(json.dumps([round(x, 5) for x in fn(q, k, v, causal=True).flatten().tolist()]))
    except RuntimeError as exc:
        print("RuntimeError", str(exc).splitlines()[0])
"""


@pytest.mark.skipif(not (STANDINS / "flash_attn").is_dir(), reason="flash_attn stand-in missing")
def test_flash_attn_function_pickles_to_a_fresh_interpreter() -> None:
    env = env_for(STANDINS, ATTNGUARD_LOG="none")
    made = run_code(PICKLE_FLASH, "guarded", "dump", env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    sent = json.loads(made.stdout)
    assert b"_attnguard_hook" in bytes.fromhex(sent["blob"])
    guarded = run_code(PICKLE_FLASH, "guarded", sent["blob"], env=env)
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    same, out = guarded.stdout.splitlines()
    assert same == "True" and json.loads(out) == sent["out"]  # that process's own guard
    plain = run_code(PICKLE_FLASH, "unguarded", sent["blob"], env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    same, out = plain.stdout.splitlines()
    # the original function, failing on CPU tensors as flash-attn does
    assert same == "True" and out.startswith("RuntimeError Could not run")


def test_loading_methods_keep_their_kind_subclasses_and_super(
    tiny_checkpoint, guard, captured
) -> None:
    import test_failopen
    import transformers
    from transformers import LlamaForCausalLM, PreTrainedModel

    own = vars(PreTrainedModel)
    # the very descriptor kinds (a wrapt proxy would pass isinstance checks, not these)
    assert type(own["from_pretrained"]) is classmethod
    assert type(own["_from_config"]) is classmethod
    for name in ("_check_and_adjust_attn_implementation", "set_attn_implementation"):
        if name in own:  # transformers >= 4.54
            assert type(own[name]) is types.FunctionType, name
    assert own["from_pretrained"].__func__.__wrapped__ is not None  # and they are ours
    bound = LlamaForCausalLM.from_pretrained
    assert type(bound) is types.MethodType and bound.__self__ is LlamaForCausalLM
    assert pickle.loads(pickle.dumps(bound)) == bound
    sub = test_failopen.MyLlama.from_pretrained
    assert pickle.loads(pickle.dumps(sub)) == sub
    model = test_failopen.MyLlama.from_pretrained(
        str(tiny_checkpoint("llama")), attn_implementation="flash_attention_2"
    )
    assert type(model) is test_failopen.MyLlama and model.loaded_by_subclass
    # flash cannot run here: the guard decided for the subclass (flash's path on the SDPA twins)
    assert model.config._attn_implementation == "flash_attention_2"
    (fallback,) = [e for e in captured if e["event"] == "backend_fallback"]
    assert fallback["rule"] == "flash-on-sdpa"
    assert fallback["model"] == "MyLlama" and fallback["applied"] is True
    # PreTrainedModel itself binds through the same classmethod
    assert transformers.PreTrainedModel.from_pretrained.__func__ is own["from_pretrained"].__func__


def _define_subclass() -> Any:
    from transformers import LlamaForCausalLM

    class MyLlama(LlamaForCausalLM):
        @classmethod
        def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
            model = super().from_pretrained(*args, **kwargs)
            model.loaded_by_subclass = True
            return model

    MyLlama.__module__ = __name__
    MyLlama.__qualname__ = "MyLlama"
    return MyLlama


def __getattr__(name: str) -> Any:  # MyLlama is built lazily (importing transformers)
    if name == "MyLlama":
        cls = _define_subclass()
        globals()["MyLlama"] = cls
        return cls
    raise AttributeError(name)


# --- 2. python -m ----------------------------------------------------------------------------------


def test_a_package_run_with_dash_m_is_guarded(tmp_path: Path) -> None:
    """verl-style ``python -m pkg.trainer.main`` whose package imports attnguard."""
    pkg = tmp_path / "mypkg"
    (pkg / "trainer").mkdir(parents=True)
    (pkg / "__init__.py").write_text("import attnguard  # noqa: F401\n")
    (pkg / "trainer" / "__init__.py").write_text("")
    (pkg / "trainer" / "main.py").write_text(
        "import attnguard\nprint('guarded:', attnguard.is_active())\n"
    )
    res = subprocess.run(
        [PY, "-X", "dev", "-m", "mypkg.trainer.main"],
        env=env_for(tmp_path, ATTNGUARD_LOG="none"),
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "guarded: True"


def test_only_the_attnguard_command_itself_is_exempt() -> None:
    """``python -m attnguard`` and the ``attnguard`` script never guard themselves: with every
    event on stderr, asking for the version prints the version and nothing else."""
    env = env_for(ATTNGUARD="1", ATTNGUARD_LOG_LEVEL="info")
    commands = [[PY, "-m", "attnguard", "--version"]]
    script = Path(PY).parent / "attnguard"
    if script.is_file():
        commands.append([str(script), "--version"])
    for cmd in commands:
        res = subprocess.run(cmd, env=env, capture_output=True, text=True)
        assert res.returncode == 0 and res.stderr == "", (cmd, res.stderr)
        assert res.stdout == f"attnguard {attnguard.__version__}\n"
    # the same settings in a program that uses attnguard: its activation is on stderr
    res = run_code("import attnguard; attnguard.is_active()", env=env)
    assert '"event": "activated"' in res.stderr
