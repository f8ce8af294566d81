"""Environment -> activate(), for ``import attnguard``, the start-up hook and ``attnguard run``.

Imports nothing heavy at module level: the start-up hook loads this in every guarded process.
"""

from __future__ import annotations

import os
import sys


def _in_startup_hook() -> bool:
    hook = sys.modules.get("_attnguard_hook")
    return bool(getattr(hook, "in_progress", False))


# Launchers that only start worker processes: the workers inherit ATTNGUARD=1 and are guarded;
# the launcher itself has no rank and would add a stray "rank 0" activation and summary.
_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "deepspeed")


def _is_launcher_process() -> bool:
    argv = list(getattr(sys, "orig_argv", []))
    words = [a.rsplit("/", 1)[-1] for a in argv[:3]]
    if any(w in _LAUNCHERS for w in words):
        return True
    return words[1:3] == ["accelerate", "launch"] or argv[1:3] == [
        "-m",
        "accelerate.commands.launch",
    ]


# What ``python -m`` may run as the attnguard command itself.
_CLI_MODULES = ("attnguard", "attnguard.__main__", "attnguard.cli")
# Interpreter options that take a value (``-X dev``, ``-W ignore``, ...).
_OPTIONS_WITH_VALUE = "WX"


def _main_module(argv: list[str]) -> str | None:
    """The module ``python [options] -m MODULE ...`` runs (from ``sys.orig_argv``), else None."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--" or not arg.startswith("-") or arg == "-":
            return None  # a script (or stdin) comes first
        if arg.startswith("--"):
            i += 2 if arg == "--check-hash-based-pycs" else 1
            continue
        flags = arg[1:]
        for j, flag in enumerate(flags):
            if flag == "m":
                rest = flags[j + 1 :]
                if rest:
                    return rest
                return argv[i + 1] if i + 1 < len(argv) else None
            if flag == "c":
                return None
            if flag in _OPTIONS_WITH_VALUE:
                if not flags[j + 1 :]:
                    i += 1  # the value is the next word
                break
        i += 1
    return None


def _is_cli_process() -> bool:
    """The ``attnguard`` command or ``python -m attnguard``: tools, not programs to guard.

    Decided from ``sys.orig_argv``: ``python -m pkg.train`` whose package imports attnguard is a
    program (``sys.argv[0]`` is "-m" for every module while its package imports).
    """
    hook = sys.modules.get("_attnguard_hook")
    if getattr(hook, "in_cli", False):
        return True
    argv = [str(a) for a in getattr(sys, "orig_argv", None) or []]
    if len(argv) < 2:
        return False
    if _main_module(argv) in _CLI_MODULES:
        return True
    # the console script: python /venv/bin/attnguard ... (before it sets in_cli)
    script = argv[1]
    return not script.startswith("-") and os.path.basename(script) == "attnguard"


_reported = False


def activate_from_env() -> None:
    """Activate with ATTNGUARD_* settings.

    From user code a bad setting raises ValueError. Inside the interpreter start-up hook it is
    printed once to stderr and the program runs unguarded: the hook never breaks Python.
    """
    global _reported
    from .runtime import activate

    if _is_cli_process():
        return
    if _in_startup_hook() and _is_launcher_process():
        return
    if not _in_startup_hook():
        activate()
        return
    try:
        activate()
    except BaseException as exc:
        if not _reported:
            _reported = True
            try:
                sys.stderr.write(f"{exc} (attnguard is off for this process)\n")
            except BaseException:
                pass
