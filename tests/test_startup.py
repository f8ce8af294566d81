"""Free to leave on: with ``ATTNGUARD=1`` set for a whole environment, a Python that
never imports transformers, flash_attn or xformers imports nothing of the guard's machinery;
attnguard activates at the first import of one of them, before its code runs; settings are still
checked at start-up. Fresh interpreters with the ``ATTNGUARD=1`` start-up hook throughout (cost
is measured in bench/bench_startup.py, never asserted here)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.events import json_lines
from helpers.hook import env_for, needs_hook
from helpers.packages import STANDINS
from helpers.processes import PY

pytestmark = needs_hook

MODULES = "import sys; loaded = sorted(sys.modules); import json; print(json.dumps(loaded))"


def python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-c", code], env=env_for(**env), capture_output=True, text=True, timeout=300
    )


def modules_added(**env: str) -> set[str]:
    """Modules a fresh ``python -c`` has at its first line with ``ATTNGUARD=1`` (and ``env``)
    that it does not have with ``ATTNGUARD=0``."""
    off, on = python(MODULES, ATTNGUARD="0", **env), python(MODULES, ATTNGUARD="1", **env)
    assert off.returncode == on.returncode == 0 and on.stderr == "", on.stderr
    return set(json.loads(on.stdout)) - set(json.loads(off.stdout))


# The guard's own start-up modules, and the standard-library ones they need that a bare
# interpreter has not imported yet (a log file adds the path checks and the placeholder parser).
WATCHER = {"_attnguard_hook", "attnguard", "attnguard._bootstrap", "attnguard.config"}
WATCHER |= {"attnguard.launch", "attnguard.importhooks", "__future__"}
LOG_FILE_CHECKS = {"attnguard.safefiles", "_string", "errno"}


@pytest.mark.parametrize("log", ["stderr", "file"])
def test_a_process_that_imports_no_guarded_library_imports_only_the_watcher(
    log: str, tmp_path: Path
) -> None:
    extra = {} if log == "stderr" else {"ATTNGUARD_LOG": str(tmp_path / "ev-{rank}.jsonl")}
    added = modules_added(**extra)
    assert added <= WATCHER | (LOG_FILE_CHECKS if extra else set()), added
    outside = {m for m in added if m.partition(".")[0] not in ("attnguard", "_attnguard_hook")}
    assert outside <= set(sys.stdlib_module_names), outside
    # nothing of the machinery, nor what it would pull in
    heavy = {"attnguard.runtime", "attnguard.observability.events", "wrapt", "structlog", "typing"}
    assert not added & (heavy | {"dataclasses", "re", "threading", "importlib.metadata"})
    assert not list(tmp_path.iterdir())  # no log file for a process with nothing to log


def test_settings_and_the_switch_words_are_checked_at_start_up() -> None:
    """A process that imports nothing still says a bad value, once, with what is done instead:
    a bad switch leaves the process unguarded, a bad mode is warn mode."""
    for var, value, instead in (
        ("ATTNGUARD_MODE", "loud", "attnguard runs in warn mode"),
        ("ATTNGUARD", "2", "attnguard is off for this process"),
    ):
        res = python("print('ran')", **{"ATTNGUARD": "1", var: value})
        assert res.returncode == 0 and res.stdout == "ran\n"
        assert res.stderr.count(f"invalid {var}={value!r}; valid values:") == 1, res.stderr
        assert res.stderr.count("\n") == 1 and instead in res.stderr


def test_the_first_import_of_a_guarded_library_activates_before_its_code_runs() -> None:
    """``from flash_attn import flash_attn_func`` (the stand-in) binds the guarded function:
    activation happened at the import, before flash_attn's module ran to its end; after it the
    hook no longer waits."""
    code = (
        "import attnguard._bootstrap as b\n"
        "waiting = b._waiting\n"
        "from flash_attn import flash_attn_func\n"
        "from attnguard import runtime\n"
        "print(json := __import__('json').dumps([waiting, runtime.is_active(),\n"
        "    hasattr(flash_attn_func, '__attnguard_original__'), b._waiting]))\n"
    )
    res = subprocess.run(
        [PY, "-c", code],
        env=env_for(STANDINS, ATTNGUARD="1", ATTNGUARD_LOG="none"),
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == [True, True, True, False]


def test_using_the_api_activates_a_waiting_hook() -> None:
    res = python(
        "import attnguard; print(attnguard.is_active(), attnguard.settings().mode)",
        ATTNGUARD="1",
        ATTNGUARD_MODE="warn",
        ATTNGUARD_LOG="none",
    )
    assert res.returncode == 0 and res.stdout.split() == ["True", "warn"], res.stderr


CHILD_FIRST = """
import subprocess, sys
child = [sys.executable, "-c", "import transformers"]
# a tool started before the parent imports a library to guard: a program of its own (nothing
# tells it from the rank a Python wrapper starts: launcher -> python wrap.py -> python train.py)
subprocess.run(child, check=True)
import transformers
# started once the parent is guarded: its helpers, also through a wrapper that never activates
subprocess.run(child, check=True)
subprocess.run([sys.executable, "-c", f"import subprocess; subprocess.run({child!r}, check=True)"],
               check=True)
print("parent", __import__("os").getpid())
"""


def test_children_are_helpers_of_a_parent_that_was_guarded_when_it_started_them(
    tmp_path: Path,
) -> None:
    log = tmp_path / "ev-{rank}.jsonl"
    res = python(CHILD_FIRST, ATTNGUARD="1", ATTNGUARD_LOG=str(log))
    assert res.returncode == 0, res.stderr
    parent = int(res.stdout.split()[-1])
    recs = json_lines((tmp_path / "ev-0.jsonl").read_text())
    # the first tool's activation and summary, then the parent's; the helpers had nothing to say
    seen = [(r["event"], r["pid"] == parent) for r in recs]
    assert seen == [
        ("activated", False),
        ("summary", False),
        ("activated", True),
        ("summary", True),
    ]
    assert not any(r.get("helper") for r in recs)


CHILD_GETS_A_RANK = """
import os, subprocess, sys
# as Ray starts actors: a child of the guarded driver, with the driver's launch identity at
# start-up, that sets a rank of its own before it imports anything to guard
child = "import os; os.environ.update(RANK='1', WORLD_SIZE='2'); import attnguard; " \
        "from attnguard.observability import events; attnguard.is_active(); print('HELPER', events.is_helper())"
out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True)
print(out.stdout.strip())
import transformers.modeling_utils
"""


def test_a_child_that_gets_a_rank_of_its_own_is_a_rank_not_a_helper(tmp_path: Path) -> None:
    res = python(CHILD_GETS_A_RANK, ATTNGUARD="1", ATTNGUARD_LOG="none")
    assert res.returncode == 0, res.stderr
    assert "HELPER False" in res.stdout.splitlines(), res.stdout


def test_a_misspelled_variable_is_named_once_and_the_guard_runs() -> None:
    """``ATTNGUARD_MOOD=fix`` used to be ignored silently."""
    code = (
        "import subprocess, sys, transformers.modeling_utils, attnguard\n"
        "subprocess.run([sys.executable, '-c', 'import attnguard'])  # a helper: its parent said it\n"
        "print(attnguard.is_active())\n"
    )
    res = python(code, ATTNGUARD="1", ATTNGUARD_MOOD="fix", ATTNGUARD_KERNAL="fastest")
    assert res.returncode == 0 and res.stdout == "True\n", res.stderr
    assert res.stderr.splitlines() == [
        "attnguard: ATTNGUARD_KERNAL is not a setting (ignored); did you mean ATTNGUARD_KERNEL?",
        "attnguard: ATTNGUARD_MOOD is not a setting (ignored); did you mean ATTNGUARD_MODE?",
    ]
    # in code, without the hook: the same lines
    res = python("import attnguard", ATTNGUARD_MOOD="fix", ATTNGUARD_LOG="none")
    assert res.returncode == 0
    assert "ATTNGUARD_MOOD is not a setting (ignored); did you mean ATTNGUARD_MODE?" in res.stderr


def _limit_memory() -> None:
    limit = 1 << 30  # 1 GiB of address space: a plain interpreter needs far less
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


@pytest.mark.parametrize("spec", [">999999999d", "0>2000000000d", "0300d"])
def test_a_huge_field_in_the_log_path_is_a_clear_error_under_a_memory_limit(
    spec: str, tmp_path: Path
) -> None:
    """``ATTNGUARD_LOG=/tmp/x{rank:>999999999d}`` allocated gigabytes at every start-up, and
    under a memory limit said only ``MemoryError()``."""
    value = str(tmp_path / f"x{{rank:{spec}}}")
    res = subprocess.run(
        [PY, "-c", "print('ran')"],
        env=env_for(ATTNGUARD="1", ATTNGUARD_LOG=value),
        capture_output=True,
        text=True,
        preexec_fn=_limit_memory,
        timeout=120,
    )
    assert res.returncode == 0 and res.stdout == "ran\n"
    assert res.stderr.startswith(f"attnguard: invalid ATTNGUARD_LOG={value!r} ("), res.stderr
    assert "a path component holds at most 255" in res.stderr
    assert "MemoryError" not in res.stderr
