"""Fail-open: attnguard's own errors never fail a call, and call-time wrappers pickle.

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
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import AttnGuardError
from .observability import events

T = TypeVar("T")

_MISSING = object()


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
