"""Interpreter start-up hook for attnguard (``ATTNGUARD=1``, no code change).

Installed at the top of site-packages and run by ``attnguard.pth`` (every Python) or by
``attnguard.start`` (PEP 829, Python >= 3.15). With ATTNGUARD unset or 0 it returns after one
environment lookup and imports nothing. With it on, it checks the settings and waits: attnguard
activates when the program first imports a library it guards (:mod:`attnguard._bootstrap`). It
never raises: a broken guard must not break Python.

It is also where attnguard's call-time wrappers live for pickle (importing this module activates
nothing): a wrapper of ``pkg.mod.func`` is pickled by reference as
``_attnguard_hook."attnguard:pkg/mod:func"``, which the module ``__getattr__`` below answers with
that very wrapper in the process that made it, and in any other process with that process's own
wrapper of the same name when it has one, else with the function ``pkg.mod.func`` itself (or its
guarded replacement) -- only when that is a function of a library attnguard guards, defined under
that very name. Anything else is refused before anything is imported: this module is importable
in every process of an environment where attnguard is installed, so it must never resolve a name
a plain pickle would show for what it is (``os.system``).
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
    """If the ATTNGUARD switch is on: check the settings and let attnguard activate when the
    program imports a library it guards; swallow every error."""
    global in_progress
    if os.environ.get("ATTNGUARD", "").strip().lower() in _OFF:
        return
    in_progress = True
    try:
        import attnguard  # noqa: F401  (in the hook: checks ATTNGUARD_*, then waits)
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
    from attnguard.cli import run_as_command

    run_as_command()


# --- pickling call-time wrappers by reference ----------------------------------------------------

_PREFIX = "attnguard:"
_wrappers: dict = {}  # encoded name -> weak reference to the wrapper this process made


def register_picklable(wrapper: object, module: str, qualname: str) -> str:
    """Name under which ``wrapper`` (guarding ``module.qualname``) pickles; one per live wrapper."""
    import weakref

    base = _PREFIX + module.replace(".", "/") + ":" + qualname.replace(".", "/")
    name, n = base, 1
    while True:
        ref = _wrappers.get(name)
        held = ref() if ref is not None else None
        if held is None or held is wrapper:
            break
        n += 1
        name = f"{base}~{n}"
    _wrappers[name] = weakref.ref(wrapper)
    return name


# The libraries whose functions attnguard wraps (attnguard.config.INTEGRATIONS): the only
# modules a name may make this module import.
LIBRARIES = ("transformers", "flash_attn", "xformers", "diffusers")


def _held(name: str) -> object:
    ref = _wrappers.get(name)
    return ref() if ref is not None else None


def __getattr__(name: str) -> object:
    if not name.startswith(_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    held = _held(name)
    if held is not None:
        return held  # the pickling process: pickle checks it finds the very object
    module, _, qualname = name[len(_PREFIX) :].split("~", 1)[0].partition(":")
    module, qualname = module.replace("/", "."), qualname.replace("/", ".")
    refused = AttributeError(
        f"module {__name__!r} has no attribute {name!r}: it resolves only functions of "
        f"{', '.join(LIBRARIES)} that attnguard wraps"
    )
    if module.partition(".")[0] not in LIBRARIES or not qualname:
        raise refused
    import importlib
    import types

    obj: object = importlib.import_module(module)
    held = _held(name)  # the import may have patched it here: this process's own wrapper
    if held is not None:
        return held
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    # what a guarded replacement stands for, else the object itself: a plain function defined
    # under this very name (never one reached through another module: ``os.system``)
    function = getattr(obj, "__attnguard_original__", obj)
    if (
        type(function) is not types.FunctionType
        or getattr(function, "__module__", None) != module
        or getattr(function, "__qualname__", None) != qualname
    ):
        raise refused
    return obj
