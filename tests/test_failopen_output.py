"""Fail-open corners, continued (tests/test_failopen.py): settings that used to slip through (a bad
log path), a full device and a broken stderr, the app's own logging, the error reporter itself
failing, a patch that fails, a fact probe whose import would crash the process: whatever
attnguard does, the user's program keeps its results, output and exit code. User programs run
guarded and unguarded in fresh interpreters, with the flash-attn stand-in of tests/standins."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.hook import env_for, needs_hook
from helpers.packages import STANDINS
from helpers.processes import PY, run_code

import attnguard
from attnguard.failopen import fail_open, report_internal_error
from attnguard.observability import events

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
    res = run_code(
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
    plain = run_code(FLASH_USER, where, "unguarded", env=env)
    guarded = run_code(FLASH_USER, where, "guarded", env=env)
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
    spoke = run_code(FLASH_USER, "ok", "guarded", env=env_for(STANDINS, ATTNGUARD_LOG="stderr"))
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
    res = run_code(
        PATCH_FAILS, how, env=env_for(ATTNGUARD_LOG="stderr", ATTNGUARD_LOG_FORMAT="json")
    )
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
    res = run_code(
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
    crash = run_code("import flash_attn", env=env)
    assert crash.returncode == -11  # the stand-in really kills the process
    path = str(tiny_checkpoint("llama"))
    plain = run_code(SDPA_USER, path, "plain", env={**env, "ATTNGUARD": "0"})
    guarded = run_code(SDPA_USER, path, "guarded", env=env)
    assert plain.returncode == guarded.returncode == 0, guarded.stderr[-2000:]
    assert guarded.stdout == plain.stdout
    assert guarded.stdout.endswith("flash_attn imported: False\n")
