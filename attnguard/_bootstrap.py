"""Environment -> activate(), for ``import attnguard``, the start-up hook and ``attnguard run``.

``ATTNGUARD=1`` is set once for a whole environment, so the start-up hook runs in every Python
there: pip, shells' tools, tokenizer and DataLoader workers, launchers. In the hook nothing of the
guard is imported until the program imports a library attnguard patches: the hook checks the
ATTNGUARD_* values (a bad one is said at start-up, with the substitute used instead), decides
whether the process is a helper of a guarded parent (:mod:`attnguard.launch`) and asks
:mod:`attnguard.importhooks` to call it back when transformers, flash_attn or xformers is first
imported. That import (or a call of attnguard's API) activates attnguard then, in the library's
loader before its code runs, so its post-import patches land exactly as when attnguard
was active from the start. A process that never imports them pays for this module,
:mod:`attnguard.config`, :mod:`attnguard.launch` and :mod:`attnguard.importhooks`
(standard-library ``os``, ``sys`` and ``_thread`` only; bench/bench_startup.py measures it).

Imports nothing heavy at module level.
"""

from __future__ import annotations

import os
import sys

from . import config, importhooks, launch


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


def _say_unknown_variables() -> None:
    """Misspelled ATTNGUARD_* variables, one line each on stderr; the guard runs without them.
    Not in a helper: its guarded parent said them already."""
    try:
        if launch.helper_of_guarded_parent():
            return
        for line in config.unknown_variables():
            sys.stderr.write(line + "\n")
    except Exception:
        pass


def activate_from_env() -> None:
    """Activate with ATTNGUARD_* settings, at ``import attnguard`` or in the start-up hook.

    A bad value (a variable set for a whole cluster must never stop the jobs there) is one line
    on stderr naming the variable, the value, the valid values and what is done instead (its
    least harmful substitute: :func:`attnguard.config.read`); any other failure to activate is
    one line and the program runs unguarded. In the hook the settings are checked now and
    activation waits for a library to guard (:func:`_arm`).
    """
    if _is_cli_process():
        return
    if _in_startup_hook() and _is_launcher_process():
        return
    if not _in_startup_hook():
        _say_unknown_variables()
        _activate_reporting()
        return
    problems = config.check()
    for problem in problems:
        config.say(problem.line)  # each with what is done instead (README "Configuration")
    _say_unknown_variables()
    if any(problem.var == "ATTNGUARD" for problem in problems):
        return  # the switch itself unread: attnguard stays out
    _arm()


def _activate_reporting() -> None:
    """Activate where no caller can take an error (``import attnguard``, the hook's deferred
    activation): a failure is one line on stderr and the program runs unguarded."""
    from .runtime import activate

    try:
        activate()
    except Exception as exc:
        config.say(f"{exc} ({config.OFF})")


# --- waiting for a library to guard ----------------------------------------------------------

_waiting = False  # the start-up hook waits for a library to guard (importhooks.call_before)


def _arm() -> None:
    global _waiting
    libraries = config.INTEGRATIONS
    if any(name in sys.modules for name in libraries):
        _activate_reporting()  # one was imported before the hook ran (another .pth file)
        return
    _waiting = True
    # Activation runs in the library's loader, before its code: never in a finder's
    # find_spec, where Python holds its global import lock (see attnguard.importhooks).
    importhooks.call_before(libraries, activate_pending)


def _disarm() -> bool:
    """Stop waiting; True when the start-up hook was waiting."""
    global _waiting
    waiting, _waiting = _waiting, False
    if not waiting:
        return False
    importhooks.cancel_before(activate_pending)
    return True


def activate_pending() -> None:
    """Activate now when the start-up hook is waiting for a library to guard (the program
    imports one, or calls attnguard's API); otherwise nothing."""
    if _disarm():
        _activate_reporting()
