"""The patch ledger, the fail-open call helper and picklable wrappers, shared by every integration.

A :class:`Ledger` records (owner, attribute or dict key, original, wrapper) for each patch and
undoes only what is still ours: if someone patched the same attribute after us, we leave their
object in place rather than clobbering it.

:func:`fail_open` runs a guard around an original callable: an error raised by attnguard's own code
is reported once as ``internal_error`` and the unmodified original call runs instead; an error
raised by the original itself propagates untouched.

:func:`make_picklable` lets a call-time wrapper be pickled by reference like the function it
wraps (``ProcessPoolExecutor``, ``torch.multiprocessing``, ``pickle.dumps`` of a registry entry).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from . import events
from .errors import AttnGuardError

T = TypeVar("T")

_MISSING = object()


@dataclass
class PatchRecord:
    owner: Any  # an object whose attribute we replaced, or a dict whose item we replaced
    attr: str
    original: Any  # what owner.__dict__ (or the dict) held, e.g. a classmethod; or _MISSING
    wrapper: Any
    item: bool = False  # owner[attr] rather than owner.attr

    def current(self) -> Any:
        """What the owner holds now (``_MISSING`` when nothing)."""
        held = self.owner if self.item else vars(self.owner)
        return held.get(self.attr, _MISSING)

    def restore(self) -> None:
        if self.item:
            if self.original is _MISSING:
                del self.owner[self.attr]
            else:
                self.owner[self.attr] = self.original
        elif self.original is _MISSING:
            delattr(self.owner, self.attr)
        else:
            setattr(self.owner, self.attr, self.original)


class Ledger:
    """Records the patches of one integration so they can be undone exactly."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.records: list[PatchRecord] = []
        self._lock = threading.Lock()

    def patch(self, owner: Any, attr: str, make: Callable[[Any], Any]) -> Any:
        """Replace ``owner.attr`` with ``make(original)``; returns the wrapper.

        ``original`` is the raw object from the owner's ``__dict__`` (a ``classmethod`` stays a
        classmethod), or the inherited attribute when the owner has none of its own.
        """
        with self._lock:
            if any(r.owner is owner and r.attr == attr for r in self.records):
                return getattr(owner, attr)  # already ours: patching is idempotent
            own = vars(owner).get(attr, _MISSING) if hasattr(owner, "__dict__") else _MISSING
            original = own if own is not _MISSING else getattr(owner, attr, None)
            wrapper = make(original)
            setattr(owner, attr, wrapper)
            self.records.append(PatchRecord(owner, attr, own, wrapper))
            return wrapper

    def patch_item(self, mapping: dict[str, Any], key: str, make: Callable[[Any], Any]) -> Any:
        """Replace ``mapping[key]`` with ``make(original)`` (registries kept in dicts).

        A key whose wrapper someone replaced since gets a new record: at unpatch the newer one
        restores their object and the older one, no longer in place, is skipped.
        """
        with self._lock:
            for r in self.records:
                if r.item and r.owner is mapping and r.attr == key and r.current() is r.wrapper:
                    return r.wrapper
            original = mapping[key]
            wrapper = make(original)
            mapping[key] = wrapper
            self.records.append(PatchRecord(mapping, key, original, wrapper, item=True))
            return wrapper

    def unpatch_all(self) -> list[PatchRecord]:
        """Restore originals in reverse order; skip attributes someone else replaced since.

        Returns the records that were skipped (not ours anymore).
        """
        skipped: list[PatchRecord] = []
        with self._lock:
            for rec in reversed(self.records):
                if rec.current() is not rec.wrapper:
                    skipped.append(rec)
                    continue
                rec.restore()
            self.records.clear()
        return skipped


class OriginalCall:
    """Calls the original and remembers whether it raised, so fail_open can tell whose error."""

    __slots__ = ("fn", "raised")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.raised: BaseException | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.fn(*args, **kwargs)
        except BaseException as exc:
            self.raised = exc
            raise


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def own_location(exc: BaseException) -> str:
    """Where in attnguard's own code ``exc`` passed last: ``attnguard/<file>:<line> in <func>``
    (the deepest attnguard frame of its traceback), or ``"unknown"``."""
    where = "unknown"
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = os.path.abspath(code.co_filename)
        if path.startswith(_PACKAGE_DIR + os.sep):
            rel = os.path.relpath(path, os.path.dirname(_PACKAGE_DIR)).replace(os.sep, "/")
            where = f"{rel}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return where


def signature_unrecognised(original: Any, twin: Any) -> str | None:
    """Why ``original`` (a library's entry point) is not the function ``twin`` stands for, judged
    by its shape: a parameter the twin does not take, or positional parameters in another order
    (a newer release can add or move either). None: the twin takes every call of it."""
    import inspect

    try:
        theirs = inspect.signature(original).parameters
        ours = inspect.signature(twin).parameters
    except (TypeError, ValueError):
        return "its signature is not readable"
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    new = [n for n, p in theirs.items() if p.kind not in variadic and n not in ours]
    if new:
        return f"it takes {', '.join(new)}, which attnguard's twin does not"
    order = [n for n, p in theirs.items() if p.kind in positional]
    if [n for n, p in ours.items() if p.kind in positional][: len(order)] != order:
        return "its positional parameters are not in the order attnguard's twin takes them"
    return None


def report_internal_error(site: str, exc: BaseException) -> None:
    """One ``internal_error`` event per (site, exception type). Never raises: reporting our own
    failure must not fail the call it happened in (a logging handler that raises).

    The event names the exception's type and where attnguard's own code was, never the
    exception's message: a message can carry what the caller passed (paths, device strings,
    tokens), and events leave the process."""
    try:
        kind = type(exc)
        where = own_location(exc)
        what = kind.__name__ if where == "unknown" else f"{kind.__name__} at {where}"
        events.emit(
            "internal_error",
            site=site,
            reason_code=kind.__name__,
            reason=f"attnguard failed internally ({what}) and ran the original call unguarded",
            error_type=f"{kind.__module__}.{kind.__qualname__}",
            location=where,
        )
    except Exception:
        pass


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = sys.modules.get(module, _MISSING)
    for part in qualname.split("."):
        obj = getattr(obj, part, _MISSING)
        if obj is _MISSING:
            break
    return obj


def _is_either(obj: Any, a: Any, b: Any) -> bool:
    return obj is a or obj is b


def make_picklable(wrapper: T, original: Any) -> T:
    """Make a call-time wrapper (a plain closure) picklable by reference; returns ``wrapper``.

    ``functools.wraps`` gives the wrapper the original's ``__module__`` / ``__qualname__``, where
    pickle finds the original, not the wrapper ("not the same object"). The wrapper is renamed
    into the tiny top-level module ``_attnguard_hook`` (installed with the package; importing it
    activates nothing), whose module ``__getattr__`` answers the encoded name with this very
    wrapper in this process, and in any other process with whatever the original's module path
    holds there: the original, or that process's own guarded wrapper. Originals that pickle by
    reference unguarded get this; others (lambdas, local functions) keep their names, so they
    fail to pickle exactly as they do unguarded. Never raises.
    """
    try:
        hook = importlib.import_module("_attnguard_hook")
        register = getattr(hook, "register_picklable", None)
        module = getattr(original, "__module__", None)
        qualname = getattr(original, "__qualname__", None)
        if (
            register is None  # an older start-up hook without the resolver
            or not isinstance(module, str)
            or not isinstance(qualname, str)
            or "<" in qualname
            or not _is_either(_resolve(module, qualname), original, wrapper)
        ):
            return wrapper
        name = register(wrapper, module, qualname)
        wrapper.__module__ = hook.__name__  # type: ignore[attr-defined]
        wrapper.__qualname__ = name  # type: ignore[attr-defined]
    except Exception:
        pass
    return wrapper


def fail_open(
    site: str,
    original: Callable[..., T],
    guard: Callable[..., T],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    own_error: BaseException | None = None,
) -> T:
    """Run ``guard(call, *args, **kwargs)`` where ``call`` invokes ``original``.

    The original's own exceptions propagate as they are (the guard may catch and recover from
    them first); so does :class:`AttnGuardError`, strict mode's deliberate refusal. Any other
    exception is attnguard's fault: report it once and return ``original(*args, **kwargs)``.
    ``own_error`` is a kernel error the caller already caught before calling: when the recovery
    fails, that error is re-raised and the original is not run a second time.
    """
    call = OriginalCall(original)
    try:
        return guard(call, *args, **kwargs)
    except AttnGuardError:
        raise
    except Exception as exc:
        kernel_error = call.raised if call.raised is not None else own_error
        if kernel_error is not None and exc is kernel_error:
            raise  # the kernel's own error, untouched
        try:
            report_internal_error(site, exc)
        except Exception:
            pass
        if kernel_error is not None:
            # the original failed and our recovery failed too: the user sees the original's
            # own error, never one of ours
            raise kernel_error from None
        return original(*args, **kwargs)
