"""Environment -> activate(), for ``import attnguard``, the start-up hook and ``attnguard run``.

Imports nothing heavy at module level: the start-up hook loads this in every guarded process.
"""

from __future__ import annotations

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


def _is_cli_process() -> bool:
    """The ``attnguard`` command or ``python -m attnguard``: tools, not programs to guard.

    While ``python -m`` imports the target's package, ``sys.argv[0]`` is still "-m".
    """
    hook = sys.modules.get("_attnguard_hook")
    return bool(getattr(hook, "in_cli", False)) or sys.argv[:1] == ["-m"]


_reported = False


def activate_from_env() -> None:
    """Activate with ATTNGUARD_* settings.

    From user code a bad setting raises ValueError. Inside the interpreter start-up hook it is
    printed once to stderr and the program runs unguarded: the hook never breaks Python.
    """
    global _reported
    from .runtime import activate

    if _is_cli_process() and not _in_startup_hook():
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
