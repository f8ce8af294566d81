"""Fail-open corners: whatever attnguard does, the user's program keeps its results, output and
exit code. Each test is a user's program, run guarded and unguarded in fresh interpreters where
start-up, exit, pickling or ``-m`` matter, with real transformers models and the flash-attn
stand-in of tests/standins."""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest
from helpers.packages import STANDINS
from helpers.processes import PY, REPO, subprocess_env

import attnguard
from attnguard.failopen import fail_open, report_internal_error
from attnguard.observability import events

HOOK_DIR = REPO / "hook"


def env_for(*paths: str | Path, **extra: str) -> dict[str, str]:
    """A child environment: this checkout's attnguard and its ``_attnguard_hook`` first."""
    env = subprocess_env(HF_HUB_OFFLINE="1", TQDM_DISABLE="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([*map(str, paths), str(HOOK_DIR), env["PYTHONPATH"]])
    return env


def run_py(
    code: str, *args: str, env: dict[str, str], cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def startup_hook_installed() -> bool:
    import sysconfig

    return (Path(sysconfig.get_paths()["purelib"]) / "attnguard.pth").is_file()


needs_hook = pytest.mark.skipif(
    not startup_hook_installed(), reason="the ATTNGUARD=1 start-up hook is not installed here"
)


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
    made = run_py(PICKLE_REGISTRY, env=env_for(ATTNGUARD_LOG="none"))
    assert made.returncode == 0, made.stderr[-3000:]
    sent = json.loads(made.stdout)
    # guarded on CPU the flash entry runs transformers' flash path on the SDPA twins
    assert all(isinstance(v, list) for v in sent["outs"].values())
    arg = json.dumps({"blobs": sent["blobs"]})
    guarded = run_py(UNPICKLE_REGISTRY, arg, "guarded", env=env_for(ATTNGUARD_LOG="none"))
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    outs, names = map(json.loads, guarded.stdout.splitlines())
    assert outs == sent["outs"]  # that process's own guarded entries
    assert all(n.startswith("_attnguard_hook.attnguard:transformers/") for n in names.values())
    plain = run_py(UNPICKLE_REGISTRY, arg, "unguarded", env=env_for())
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
    res = run_py(code, blob.hex(), env=env_for(ATTNGUARD=switch, ATTNGUARD_LOG="none"))
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
    made = run_py(PICKLE_FLASH, "guarded", "dump", env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    sent = json.loads(made.stdout)
    assert b"_attnguard_hook" in bytes.fromhex(sent["blob"])
    guarded = run_py(PICKLE_FLASH, "guarded", sent["blob"], env=env)
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    same, out = guarded.stdout.splitlines()
    assert same == "True" and json.loads(out) == sent["out"]  # that process's own guard
    plain = run_py(PICKLE_FLASH, "unguarded", sent["blob"], env=env)
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
    res = run_py("import attnguard; attnguard.is_active()", env=env)
    assert '"event": "activated"' in res.stderr


# --- 3. settings that used to slip through -------------------------------------------------------

BAD_LOGS = [
    "/tmp/x{rank[0]}.log",
    "/tmp/x{rank.foo}.log",
    "/tmp",
    "/etc/hostname/events.jsonl",
]


@pytest.mark.parametrize("value", BAD_LOGS)
def test_attnguard_run_starts_its_command_guarded_despite_a_bad_log_path(value: str) -> None:
    """A log setting is no reason to refuse the command: its guard says the value once and
    writes to stderr (tests/test_bad_log_setting.py)."""
    child = "import attnguard; print('child ran', attnguard.is_active(), attnguard.settings().log)"
    res = subprocess.run(
        [PY, "-m", "attnguard", "run", "--", PY, "-c", child],
        env=env_for(ATTNGUARD_LOG=value),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0 and res.stdout == "child ran True stderr\n", res.stderr
    assert "Traceback" not in res.stderr
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"attnguard: invalid ATTNGUARD_LOG={value!r} (")
    assert "valid values: stderr | none | a file path" in line
    assert line.endswith("(events go to stderr instead)")


@needs_hook
@pytest.mark.parametrize("value", [*BAD_LOGS, "/proc/attnguard-events.jsonl"])
def test_startup_hook_with_a_bad_log_path_runs_the_program_guarded_on_stderr(value: str) -> None:
    if value.startswith("/proc/") and not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    res = run_py(
        "import attnguard; print('ran', attnguard.is_active(), attnguard.settings().log)",
        env=env_for(ATTNGUARD="1", ATTNGUARD_LOG=value),
    )
    assert res.returncode == 0 and res.stdout == "ran True stderr\n", res.stderr
    (line,) = res.stderr.splitlines()
    assert line.startswith(f"attnguard: invalid ATTNGUARD_LOG={value!r} (")
    assert line.endswith("(events go to stderr instead)")


def test_activate_with_a_log_file_that_cannot_be_opened_raises_and_stays_off() -> None:
    if not Path("/proc").is_dir():
        pytest.skip("no /proc here")
    with pytest.raises(ValueError) as err:
        attnguard.activate(log="/proc/attnguard-events.jsonl")
    assert str(err.value).startswith(
        "attnguard: invalid ATTNGUARD_LOG='/proc/attnguard-events.jsonl' (cannot write "
        "/proc/attnguard-events.jsonl: No such file or directory); valid values: stderr | none"
    )
    assert not attnguard.is_active()


# --- 4. full disk, broken stderr -----------------------------------------------------------------

# A program that calls flash_attn on CPU tensors and falls back to torch SDPA itself when the
# kernel refuses: it works without attnguard; with it, attnguard reroutes the call (one warning).
FLASH_USER = """
import sys
if sys.argv[1] == "stderr-full":
    sys.stderr = open("/dev/full", "w")  # stderr on a full device
if sys.argv[2] == "guarded":
    import attnguard
import torch
import torch.nn.functional as F
from flash_attn import flash_attn_func

torch.manual_seed(0)
q, k, v = (torch.randn(2, 5, 4, 16) for _ in range(3))
try:
    out = flash_attn_func(q, k, v, causal=True)
except RuntimeError:  # no kernel for these inputs: the same attention on torch SDPA
    t = lambda x: x.transpose(1, 2)
    out = t(F.scaled_dot_product_attention(t(q), t(k), t(v), is_causal=True))
print(f"{out.sum().item():.5f}")
"""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize(
    ("where", "log"), [("stderr-full", "stderr"), ("ok", "/dev/full")], ids=["stderr", "log"]
)
def test_a_full_device_changes_neither_output_nor_exit_code(where: str, log: str) -> None:
    env = env_for(STANDINS, ATTNGUARD_LOG=log, ATTNGUARD_LOG_FORMAT="json")
    plain = run_py(FLASH_USER, where, "unguarded", env=env)
    guarded = run_py(FLASH_USER, where, "guarded", env=env)
    assert plain.returncode == 0, plain.stderr
    assert (guarded.returncode, guarded.stdout) == (plain.returncode, plain.stdout)
    # a log file on a full device is given up with one line on stderr, which then gets the
    # warning and the summary (tests/test_log_write_errors.py); a full stderr says nothing
    said = guarded.stderr.splitlines()
    if log == "stderr":
        assert said == plain.stderr.splitlines()
    else:
        assert said[0].startswith(
            "attnguard WARNING: ATTNGUARD_LOG: cannot write /dev/full: ENOSPC"
        )
        assert [json.loads(line)["event"] for line in said[1:]] == ["backend_rerouted", "summary"]
    # and with a working stderr attnguard did speak: the test ran the guarded path
    spoke = run_py(FLASH_USER, "ok", "guarded", env=env_for(STANDINS, ATTNGUARD_LOG="stderr"))
    assert spoke.stdout == plain.stdout and "backend_rerouted" in spoke.stderr


# --- 5. the app's logging ------------------------------------------------------------------------


def test_records_reach_the_app_whose_record_factory_sets_rank_and_host(
    tiny_checkpoint, captured, monkeypatch
) -> None:
    """Distributed apps often stamp every record with rank/host in a record factory."""
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    old_factory = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = old_factory(*args, **kwargs)
        record.rank = "app-rank-3"
        record.host = "app-host"
        return record

    got: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            got.append(record)

    root = logging.getLogger()
    handler = Keep()
    logging.setLogRecordFactory(factory)
    root.addHandler(handler)
    try:
        attnguard.activate(log="none")
        from transformers import LlamaForCausalLM

        LlamaForCausalLM.from_pretrained(
            str(tiny_checkpoint("llama")), attn_implementation="flash_attention_2"
        )
    finally:
        root.removeHandler(handler)
        logging.setLogRecordFactory(old_factory)
    (rec,) = [r for r in got if r.name == "attnguard"]
    assert rec.event == "backend_fallback" and rec.levelno == logging.WARNING
    assert (rec.rank, rec.host) == ("app-rank-3", "app-host")  # the app's own, untouched
    assert (rec.ag_rank, rec.ag_host) == (3, events._HOST)  # attnguard's, renamed
    assert rec.world_size == 4 and not hasattr(rec, "ag_world_size")
    assert rec.selected == "sdpa_twin" and rec.getMessage().startswith("backend_fallback: ")


# --- 6. the error reporter itself ----------------------------------------------------------------


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no message for you")


def test_a_failing_error_report_still_returns_the_users_result(guard, monkeypatch) -> None:
    def broken_emit(*args: Any, **kwargs: Any) -> bool:
        raise RuntimeError("the event pipeline is broken")

    def guard_that_fails(call: Any, x: int) -> int:
        raise KeyError("attnguard bug")

    monkeypatch.setattr(events, "emit", broken_emit)
    assert fail_open("site", lambda x: x * 7, guard_that_fails, (6,), {}) == 42
    report_internal_error("site", ValueError("x"))  # returns, raises nothing


def test_the_users_own_error_still_propagates_once_when_reporting_fails(guard, monkeypatch) -> None:
    monkeypatch.setattr(events, "emit", lambda *a, **k: 1 / 0)
    boom = RuntimeError("kernel says no")
    calls = []

    def original() -> None:
        calls.append(1)
        raise boom

    def recovering_guard(call: Any) -> None:
        try:
            call()
        except RuntimeError:
            raise _Unprintable() from None  # our recovery fails, and its report fails too

    with pytest.raises(RuntimeError) as err:
        fail_open("site", original, recovering_guard, (), {})
    assert err.value is boom and calls == [1]


def test_an_exception_without_a_message_is_reported(guard, captured) -> None:
    report_internal_error("site.x", _Unprintable())
    (ev,) = [e for e in captured if e["event"] == "internal_error"]
    assert ev["reason_code"] == "_Unprintable"
    assert ev["reason"].startswith("attnguard failed internally (_Unprintable)")


PATCH_FAILS = """
import sys
import attnguard
from attnguard.observability import events
import attnguard.integrations.transformers.modeling as integration

class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no message")

def broken_patch(module):
    raise Unprintable()

def broken_emit(*args, **kwargs):
    raise RuntimeError("the event pipeline is broken")

integration.patch = broken_patch
if sys.argv[1] == "emit-fails":
    events.emit = broken_emit
import transformers.modeling_utils  # the integration's import hook fires here
from attnguard import runtime
print("imported", sorted(part for _, part in runtime.patched_parts()))
"""


@pytest.mark.parametrize("how", ["emit-works", "emit-fails"])
def test_a_failing_patch_never_breaks_the_users_import(how: str) -> None:
    res = run_py(PATCH_FAILS, how, env=env_for(ATTNGUARD_LOG="stderr", ATTNGUARD_LOG_FORMAT="json"))
    assert res.returncode == 0, res.stderr[-3000:]
    # the failing part is not patched; the other part of the integration patches on its own
    assert res.stdout == "imported ['attnguard.integrations.transformers.availability']\n"
    errors = [
        json.loads(line)
        for line in res.stderr.splitlines()
        if line.startswith("{") and '"internal_error"' in line
    ]
    assert len(errors) == (1 if how == "emit-works" else 0)
    if errors:
        assert errors[0]["site"] == "transformers.patch"
    assert "Traceback" not in res.stderr


def test_attnguard_itself_stays_importable_without_sys_argv() -> None:
    """Embedded interpreters may lack sys.orig_argv entries: activation decides from what is
    there (no crash)."""
    res = run_py(
        "import sys; sys.orig_argv = []; import attnguard; print(attnguard.is_active())",
        env=env_for(ATTNGUARD_LOG="none"),
    )
    assert res.returncode == 0 and res.stdout == "True\n", res.stderr


# --- 7. a fact probe that would kill the process ---------------------------------------------------

CRASHING_FLASH = {
    # an installed flash-attn (metadata and all) whose import kills the interpreter, as a badly
    # broken native extension does
    "flash_attn/__init__.py": "import ctypes\nctypes.string_at(0)  # SIGSEGV\n",
    "flash_attn-2.8.3.dist-info/METADATA": "Metadata-Version: 2.1\nName: flash-attn\nVersion: 2.8.3\n",
    "flash_attn-2.8.3.dist-info/RECORD": "",
}

SDPA_USER = """
import sys
if sys.argv[2] == "guarded":
    import attnguard
import torch
from transformers import LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1], attn_implementation="sdpa")
with torch.no_grad():
    print(model(torch.tensor([[1, 5, 9, 2]])).logits.flatten()[:4].tolist())
print("flash_attn imported:", "flash_attn" in sys.modules)
"""


def test_a_flash_attn_whose_import_crashes_does_not_touch_an_sdpa_program(
    tmp_path: Path, tiny_checkpoint
) -> None:
    site = tmp_path / "site"
    for rel, text in CRASHING_FLASH.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    env = env_for(site, ATTNGUARD_LOG=str(tmp_path / "ev.jsonl"))
    crash = run_py("import flash_attn", env=env)
    assert crash.returncode == -11  # the stand-in really kills the process
    path = str(tiny_checkpoint("llama"))
    plain = run_py(SDPA_USER, path, "plain", env={**env, "ATTNGUARD": "0"})
    guarded = run_py(SDPA_USER, path, "guarded", env=env)
    assert plain.returncode == guarded.returncode == 0, guarded.stderr[-2000:]
    assert guarded.stdout == plain.stdout
    assert guarded.stdout.endswith("flash_attn imported: False\n")
