"""Interpreter start-up hook for attnguard (``ATTNGUARD=1``, no code change).

Installed at the top of site-packages and run by ``attnguard.pth`` (every Python) or by
``attnguard.start`` (PEP 829, Python >= 3.15). With ATTNGUARD unset or 0 it returns after one
environment lookup and imports nothing. It never raises: a broken guard must not break Python.
"""

import os
import sys

# Read by attnguard's import-time activation: inside the hook a bad setting is reported on
# stderr and the program runs unguarded instead of raising.
in_progress = False
# Set by the ``attnguard`` command: the CLI process itself is never guarded.
in_cli = False

_OFF = ("", "0", "false", "no", "off")


def start() -> None:
    """Activate attnguard if the ATTNGUARD switch is on; swallow every error."""
    global in_progress
    if os.environ.get("ATTNGUARD", "").strip().lower() in _OFF:
        return
    in_progress = True
    try:
        import attnguard  # noqa: F401  (importing activates, reading ATTNGUARD_* settings)
    except BaseException as exc:  # never break the interpreter
        try:
            sys.stderr.write(f"attnguard: start-up hook failed, running unguarded: {exc!r}\n")
        except BaseException:
            pass
    finally:
        in_progress = False


def cli() -> None:
    """Entry point of the ``attnguard`` command (kept here so importing it activates nothing)."""
    global in_cli
    in_cli = True
    from attnguard.cli import main

    sys.exit(main())
