"""Activation state: settings in force, which integrations are patched, post-import hooks.

Patches land as soon as their library is imported (post-import hooks of
:mod:`attnguard.importhooks`, which never import nor wait inside a finder), so
``from flash_attn import flash_attn_func`` in user code binds the guarded function when attnguard
was activated first. Hooks cannot be unregistered; after :func:`deactivate` they do nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import threading
from typing import TYPE_CHECKING, Any

from . import config, launch
from ._settings import InForce
from .config import Settings, read
from .observability import events, workload

if TYPE_CHECKING:
    from .integrations import Integration

_lock = threading.RLock()
# the settings in force: handed to the integrations, which hand it to the call guard
IN_FORCE = InForce(Settings(enabled=False))
_active = False
_hooks_registered: set[tuple[str, str]] = set()  # (integration, patch module)
_patched: dict[tuple[str, str], None] = {}  # (integration, patch module), in patch order
# parts of the integrations ATTNGUARD_DISABLE cannot name (not in patched_integrations())
_unswitchable: dict[tuple[str, str], None] = {}
_refused: set[str] = set()  # integrations not patched for their version (reported once)
_overrides: dict[str, Any] = {}

# the variable that marks a guarded process's children (attnguard.launch.mark_process)
PARENT_VAR = launch.PARENT_VAR


def settings() -> Settings:
    """The settings in force (enabled=False when not active)."""
    return IN_FORCE.settings


def is_active() -> bool:
    return _active


def integrations() -> dict[str, Any]:
    """patch module name -> the module, for every part of every switchable integration
    (importing these imports torch)."""
    from .integrations import REGISTRY

    return {
        part.module: importlib.import_module(part.module)
        for integration in REGISTRY
        if integration.switchable
        for part in integration.parts
    }


def _version_refused(integration: Integration) -> bool:
    """True (after one ``observed`` event per process) when the installed library is outside
    the versions the integration declares."""
    name = integration.name
    from .installed import imported_version

    version = imported_version(integration.package, integration.distribution)
    why = integration.supports(version)
    if why is None:
        return False
    if name not in _refused:
        _refused.add(name)
        events.emit(
            "observed",
            site=f"{name}.patch",
            reason_code="version_unsupported",
            reason=f"{why}: not patched, the {name} integration is off in this process",
            version=version,
        )
    return True


def _on_import(integration: Integration, part: str, module: Any) -> None:
    """Post-import hook body: patch this part of a switchable integration if we are active, it
    is allowed and its library's version is one the integration supports. Never raises."""
    name = integration.name
    with _lock:
        if not _active or not IN_FORCE.settings.allows(name) or (name, part) in _patched:
            return
        try:
            if _version_refused(integration):
                return
            importlib.import_module(part).patch(module)
            _patched[(name, part)] = None
        except Exception as exc:
            from .failopen import report_internal_error

            report_internal_error(f"{name}.patch", exc)  # never raises


def _on_unswitchable_import(integration: Integration, part: str, module: Any) -> None:
    """Post-import hook body of an integration that is not switchable (nothing it does changes
    what the program computes): patched whenever we are active. Never raises."""
    with _lock:
        if not _active or (integration.name, part) in _unswitchable:
            return
        try:
            importlib.import_module(part).patch(module)
            _unswitchable[(integration.name, part)] = None
        except Exception as exc:
            from .failopen import report_internal_error

            report_internal_error(f"{integration.name}.patch", exc)


def _not_followed(integration: Integration, part: str, module: Any) -> None:
    """A part's module was still being imported (by another thread, before attnguard was there)
    and its import cannot be followed: the part is not patched, and one event says so."""
    events.emit(
        "observed",
        site=f"{integration.name}.patch",
        reason_code="import_in_progress",
        reason=(
            f"{module.__name__} was still being imported when attnguard activated, and its "
            f"import could not be followed: {part} is not patched in this process (activate "
            "attnguard before other threads import it: ATTNGUARD=1, or import attnguard first)"
        ),
    )


def _register_hooks() -> None:
    from . import importhooks
    from .integrations import REGISTRY

    for integration in REGISTRY:
        on_import = _on_import if integration.switchable else _on_unswitchable_import
        for part in integration.parts:
            key = (integration.name, part.module)
            if key in _hooks_registered and part.trigger not in sys.modules:
                continue  # its hook waits for the import
            _hooks_registered.add(key)
            # Fires now when the module is already imported (whole), else at the end of its
            # import (also one under way in another thread); hooks that fired once re-patch
            # what is there.
            importhooks.register_post_import_hook(
                functools.partial(on_import, integration, part.module),
                part.trigger,
                cannot_follow=functools.partial(_not_followed, integration, part.module),
            )


def versions() -> dict[str, str | None]:
    """Versions of the stack, from package metadata (nothing heavy is imported)."""
    import platform
    from importlib import metadata

    from .integrations import REGISTRY

    out: dict[str, str | None] = {"python": platform.python_version()}
    patched = [i.distribution for i in REGISTRY]  # each integration's library
    # kernels: the Hugging Face kernel hub's loader (transformers and diffusers use it)
    for dist in dict.fromkeys(("attnguard", "torch", *patched, "accelerate", "kernels")):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _hub_fields() -> dict[str, Any]:
    """Where the kernels package is installed: the hub kernels this machine can load without
    network (the Hugging Face cache, LOCAL_KERNELS) and whether huggingface_hub is offline."""
    from .facts import hub

    if hub.kernels_version() is None:
        return {}
    try:
        cached = [f"{k.repo} ({', '.join(k.variants)})" for k in hub.cached()]
    except Exception:
        cached = []
    return {"hub_offline": hub.offline(), "hub_kernels_here": cached}


def _exit_summary() -> None:
    from .observability.summary import emit_exit_summary

    emit_exit_summary()


def _device_read_so_far() -> dict[str, Any]:
    """The device facts the exit summary's advice reads: what decisions read during the run
    (nothing is imported or read for the summary)."""
    machine = sys.modules.get("attnguard.facts.machine")
    return machine.device_read_so_far() if machine is not None else {}


def _ready_exit_summary() -> None:
    """Import the exit summary's modules now that it is due, never first at exit: there an
    import clears CPython's record of an unhandled Ctrl-C (see ``events._at_exit``)."""
    from .observability import summary  # noqa: F401


def _device_now() -> dict[str, Any]:
    """This process's device for the exit summary's advice, at its first event: what decisions
    read, else whether CUDA is there at all (torch already imported: nothing is imported, and no
    GPU is initialised to ask)."""
    found = _device_read_so_far()
    if found:
        return found
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    return {"device": "cuda" if torch.cuda.is_available() else "cpu"}


def _first_event() -> bool:
    _ready_exit_summary()  # this process now has something to summarise
    workload.note_device(_device_now)  # once: the advice speaks of this machine
    if events.launch_context()["world_size"] <= 1:
        return False  # no job (yet: a Ray actor sets its rank later)
    from .observability.summary import announce_first_event

    return announce_first_event()


def _unpatch(name: str, part: str) -> None:
    try:
        importlib.import_module(part).unpatch()
    except Exception as exc:
        from .failopen import report_internal_error

        report_internal_error(f"{name}.unpatch", exc)
    _patched.pop((name, part), None)


def _unpatch_unswitchable() -> None:
    for name, part in reversed(list(_unswitchable)):
        _unswitchable.pop((name, part), None)
        _unpatch(name, part)


def activate(**overrides: Any) -> Settings:
    """Switch the guard on with ATTNGUARD_* settings plus ``overrides``; idempotent.

    A bad argument raises ValueError (naming the setting, the value and the valid values), as
    does a log file asked for here that cannot be written; the settings in force then stay as
    they were. An explicit argument stands over its ATTNGUARD_* variable, which is then not
    read. A bad ATTNGUARD_* value (or an ATTNGUARD_LOG file that cannot be written) never
    raises: a variable set for a whole cluster must not stop the programs there. It is one line
    on stderr, and its least harmful substitute is used (:func:`attnguard.config.read`: a log
    file that cannot be written becomes stderr, the guard stays on).

    A change of settings while active is atomic for running code: patches read the settings
    at every call, so only integrations whose permission changes are patched or unpatched (a
    mode switch among fix, warn and strict keeps every patch); the settings and the log
    streams are swapped in one step each.
    """
    global _active, _overrides
    new, problems = read(overrides=overrides)
    for problem in problems:
        config.say(problem.line)
    with _lock:
        if _active and new == IN_FORCE.settings:
            _overrides = dict(overrides)
            return IN_FORCE.settings
        if not new.enabled:
            if _active:
                deactivate()
            events.configure_sinks(new)
            _overrides = dict(overrides)
            IN_FORCE.settings = new
            return new
        helper = events.is_helper() if events.marked() else launch.helper_of_guarded_parent()
        # Helpers open their (shared, per-rank) file at their first line only. A bad path
        # raises here, before anything changed.
        try:
            events.configure_sinks(new, eager=not helper)
        except ValueError as exc:
            if "log" in overrides:
                raise
            # ATTNGUARD_LOG's file cannot be written: the guard stays on, its events on stderr
            config.say(f"{exc} (events go to stderr instead)")
            new = dataclasses.replace(new, log="stderr")
            events.configure_sinks(new)
        events.set_helper(helper)
        if not helper:
            launch.mark_process()  # the children it starts from now on are its helpers
        for name, part in reversed(list(_patched)):
            if not new.allows(name):
                _unpatch(name, part)
        _overrides = dict(overrides)
        IN_FORCE.settings = new
        _active = True
        events.register_exit_summary(_exit_summary, _first_event)
        workload.set_machine_reader(_device_read_so_far)
        if not helper and events.launch_context()["world_size"] > 1:
            from .observability.jobdir import announce_alive

            announce_alive()  # rank 0 waits at exit for a rank that still runs
        if not helper and events.announce(new):
            events.emit(
                "activated",
                site="attnguard",
                reason_code="activated",
                reason=f"attnguard active in {new.mode} mode",
                versions=versions(),
                settings=new.as_dict(),
                **_hub_fields(),
            )
        events.say_refused_logs()  # a log path another user occupied, if no line said it yet
        if not events.nothing_to_summarise():
            _ready_exit_summary()  # a rank, or a summary someone will read: due at exit
        _register_hooks()  # patches what is imported and now allowed; the rest at import
        return new


def deactivate() -> None:
    """Undo every patch (originals restored by identity); hooks stay registered but inert."""
    global _active
    with _lock:
        for name, part in reversed(list(_patched)):
            _unpatch(name, part)
        _unpatch_unswitchable()
        _refused.clear()
        _active = False
        IN_FORCE.settings = Settings(enabled=False, mode=IN_FORCE.settings.mode)
        # Flush and close a log file now; nothing is emitted while inactive (no exit summary).
        events.configure_sinks(IN_FORCE.settings)


def finish() -> None:
    """Emit attnguard's exit summary now, once, instead of at exit: rank 0 of a job gathers
    every rank's record for the job's summary, another rank hands its record to rank 0.

    attnguard emits the summary by itself when the main thread finishes, before atexit
    handlers run (an OpenTelemetry ``LoggerProvider`` still exports it then). Call ``finish()``
    where your program shuts its logging down itself, before ``provider.shutdown()`` or
    ``force_flush()``. The guard stays active; later events are still emitted, but not counted
    in another summary."""
    events.finish()


def configure(**changes: Any) -> Settings:
    """Change some settings, keeping earlier overrides, and (re)activate with the result."""
    return activate(**{**_overrides, **changes})


def patched_integrations() -> frozenset[str]:
    """The integrations with at least one part patched."""
    return frozenset(name for name, _ in _patched)


def patched_parts() -> frozenset[tuple[str, str]]:
    """(integration, patch module) of every part patched: each part patches on its own."""
    return frozenset(_patched)
