"""transformers' own question "is flash-attn there?", answered by the import transformers makes.

transformers 4.49-4.57 import flash-attn at module import wherever their availability check says
yes (``modeling_flash_attention_utils``: ``if is_flash_attn_2_available(): from flash_attn import
...`` up to 4.53; ``integrations/flash_paged.py``, which ``modeling_utils`` imports, from 4.53;
model files importing flash-attn's layers, ModernBERT's up to 4.57), and that check reads package
metadata and CUDA only. A flash-attn that is installed but whose import raises ("undefined symbol"
in ``flash_attn_2_cuda`` after a torch upgrade) then fails every model import on 4.49-4.54, sdpa
and eager included (4.55-4.57 swallow flash_paged's error; ModernBERT's import still fails).
transformers 5.x reads the version of a package that has no metadata (a source tree on
PYTHONPATH) by importing it, and lets that import's error escape (``import
transformers.activations`` fails).

Patched when ``transformers.utils.import_utils`` has been imported, before ``transformers.utils``
binds these names (a binding that already exists in a loaded transformers module is replaced too):

* 4.49-4.57, the helpers of :data:`HELPERS`. Where a deciding helper answers yes, the import
  transformers makes next is tried once: if it raises, the helper answers no from then on, and
  so do the version helpers of the same package; one ``observed`` event (``extension_broken``)
  names the package and its error. Where transformers answers no, nothing is imported; the
  version helpers never import (they follow what the deciding helper's import found).
* 5.x, ``_is_package_available`` for the flash-attn packages: when transformers' own import of a
  package without metadata raises, the answer is "not available" instead of that error.

transformers then runs as if that flash-attn were not installed: sdpa and eager as always, and a
flash request on attnguard's load-time fallback (the SDPA twins under transformers' flash code
path). Only in fix mode: warn leaves transformers' answer (its import then fails as unguarded) and
strict raises :class:`AttnGuardError` instead; both after the same event. With
``ATTNGUARD_DISABLE=flash_attn`` attnguard imports no flash-attn and transformers' answer stands.
The program's own ``import flash_attn`` is not touched: it fails as it does without attnguard.
docs/broken-flash-attn.md lists, per release, every place transformers asks.
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ... import runtime
from ...errors import AttnGuardError
from ...failopen import report_internal_error
from ...observability import events
from ..ledger import Ledger
from ..protocol import minor_release

FLASH2 = "flash_attn"
FLASH3 = "flash_attn_interface"

# helper -> (package, the imports that decide: those transformers makes after a yes at module
# import; () for the version helpers, which follow that verdict and never import)
_FLASH2_VERSION = {
    "is_flash_attn_greater_or_equal_2_10": (FLASH2, ()),
    "is_flash_attn_greater_or_equal": (FLASH2, ()),
}


def _flash2(*modules: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    return {"is_flash_attn_2_available": (FLASH2, modules), **_FLASH2_VERSION}


# modeling_flash_attention_utils' imports after its yes (it is imported with every model)
_FLASH_UTILS_449 = (FLASH2, "flash_attn.bert_padding")  # flash_attn_func, pad/unpad helpers
_FLASH_UTILS_451 = (*_FLASH_UTILS_449, "flash_attn.layers.rotary")  # and apply_rotary_emb

# transformers minor release -> its helpers whose yes is followed by an import at module import
HELPERS: dict[tuple[int, int], dict[str, tuple[str, tuple[str, ...]]]] = {
    **{(4, m): _flash2(*_FLASH_UTILS_449) for m in (49, 50)},
    **{(4, m): _flash2(*_FLASH_UTILS_451) for m in (51, 52)},
    # ... and flash_attn_interface under the flash-attn 3 check
    (4, 53): {**_flash2(*_FLASH_UTILS_451), "is_flash_attn_3_available": (FLASH3, (FLASH3,))},
    # integrations/flash_paged.py, imported by modeling_utils: flash_attn_varlen_func (4.55-4.57
    # inside a try that swallows the error, but ModernBERT's model file imports flash-attn's
    # layers bare); the flash path's own imports, flash-attn 3's included, are lazy from 4.54
    **{(4, m): _flash2(FLASH2) for m in range(54, 58)},
}
# From 5.0 _is_package_available(pkg, return_version=True) imports a package without metadata.
IMPORTING_CHECK_FROM = (5, 0)
IMPORTING_CHECK_PACKAGES = ("flash_attn", "flash_attn_interface", "flash_attn_3")
# import name -> (distributions, label) for the event
_PACKAGES = {
    "flash_attn": (("flash-attn",), "flash-attn"),
    "flash_attn_interface": (("flash-attn-3", "flash_attn_3"), "flash-attn-3"),
    "flash_attn_3": (("flash-attn-3", "flash_attn_3"), "flash-attn-3"),
}
SITE = "transformers.availability"

ledger = Ledger("transformers_availability")
_lock = threading.RLock()
# import name -> first line of the error its import raised (None: it imports); tried once
_import_errors: dict[str, str | None] = {}


# --- the verdict ---------------------------------------------------------------------------------


def _may_import() -> bool:
    """attnguard imports flash-attn only while active and not told to leave flash-attn alone."""
    settings = runtime.settings()
    return settings.enabled and settings.allows("flash_attn")


def _what(package: str, *, metadata: bool) -> str:
    if not metadata:
        return f"{package} (a package without metadata, such as a source tree on PYTHONPATH)"
    from ...facts import dist_version

    dists, label = _PACKAGES.get(package, ((), package))
    version = dist_version(dists)
    return f"{label} {version} ({package}) is installed but" if version else f"{package}"


def _report(package: str, error: str, how: str, *, metadata: bool = True) -> None:
    """The one event per package: what is broken, and what transformers is told."""
    mode = runtime.settings().mode
    told = f"transformers is told {package} is not available"
    if mode == "fix":
        outcome = f"{told} and runs as if it were not installed"
    else:
        outcome = f"attnguard would: {told} ({mode} mode: not applied)"
    events.emit(
        "observed",
        site=f"{SITE}.{package}",
        reason_code="extension_broken",
        reason=f"{_what(package, metadata=metadata)} fails to import: {error}; {how}: {outcome}",
        package=package,
        error=error,
        applied=mode == "fix",
    )


def _tried(package: str, modules: tuple[str, ...]) -> str | None:
    """The error of importing ``modules`` of ``package`` (None: they import, or nothing was
    tried). Tried at most once, and only by a deciding helper (``modules`` not empty): the
    imports transformers makes next. Once known, a plain dict read (the version helpers run
    inside transformers' flash path, under torch.compile too)."""
    if package in _import_errors or not modules or events.is_compiling():
        return _import_errors.get(package)
    if not _may_import():
        return None
    from ...facts import first_line

    with _lock:
        if package in _import_errors:
            return _import_errors[package]
        error = None
        try:
            for module in modules:
                importlib.import_module(module)
        except Exception as exc:  # ImportError, OSError, ... whatever transformers would get
            error = first_line(exc)
        _import_errors[package] = error
    if error is not None:
        _report(
            package,
            error,
            "transformers' availability check reads package metadata only and would import it "
            "next, and fail",
        )
    return error


def _refuse(package: str, error: str) -> None:
    """Strict mode: raise instead of letting transformers import a package that fails."""
    raise AttnGuardError(
        "extension_broken",
        f"{package} is installed but fails to import: {error}",
        f"tell transformers that {package} is not available",
    )


# --- 4.49-4.57: the helpers ---------------------------------------------------------------------


def _wrap_helper(original: Callable[..., Any], package: str, modules: tuple[str, ...]) -> Any:
    @functools.wraps(original)
    def helper(*args: Any, **kwargs: Any) -> Any:
        answer = original(*args, **kwargs)
        if not answer:
            return answer
        try:
            error = _tried(package, modules)
            mode = runtime.settings().mode
        except Exception as exc:  # ours: transformers' answer stands
            report_internal_error(SITE, exc)
            return answer
        if error is None or mode not in ("fix", "strict"):
            return answer
        if mode == "strict":
            _refuse(package, error)
        return False

    _mark(helper, original)
    return helper


# --- 5.x: _is_package_available ------------------------------------------------------------------


def _raised_by_its_import(exc: BaseException) -> bool:
    """The error left ``_is_package_available`` through its own ``importlib.import_module``."""
    tb = exc.__traceback__
    caller = None
    while tb is not None:
        code = tb.tb_frame.f_code
        if caller == "_is_package_available" and code is importlib.import_module.__code__:
            return True
        caller = code.co_name
        tb = tb.tb_next
    return False


def _wrap_package_check(original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def _is_package_available(pkg_name: str, *args: Any, **kwargs: Any) -> Any:
        if pkg_name not in IMPORTING_CHECK_PACKAGES:
            return original(pkg_name, *args, **kwargs)
        return_version = bool(args[0] if args else kwargs.get("return_version", False))
        known = _import_errors.get(pkg_name)
        if known is not None and return_version and runtime.settings().mode == "fix":
            return False, "N/A"
        try:
            return original(pkg_name, *args, **kwargs)
        except Exception as exc:
            if not _raised_by_its_import(exc):
                raise  # not the import of the package: transformers' own error, unchanged
            error = _verdict_of_failed_import(pkg_name, exc)
            if error is None:
                raise
            mode = runtime.settings().mode
            if mode == "strict":
                _refuse(pkg_name, error)
            if mode != "fix":
                raise
            return False, "N/A"

    _mark(_is_package_available, original)
    return _is_package_available


def _verdict_of_failed_import(package: str, exc: BaseException) -> str | None:
    """Record (once) and report transformers' failed import of ``package``; None when our own
    code failed (the error then propagates as it would unguarded)."""
    try:
        from ...facts import first_line

        with _lock:
            first = _import_errors.get(package) is None
            error = _import_errors[package] = first_line(exc)
        if first:
            how = "transformers imports a package without metadata to read its version, and fails"
            _report(package, error, how, metadata=False)
        return error
    except Exception as own:
        report_internal_error(SITE, own)
        return None


# --- patch / unpatch -----------------------------------------------------------------------------


def _mark(wrapper: Any, original: Any) -> None:
    wrapper.__attnguard_original__ = original
    for name in ("cache_clear", "cache_info"):  # lru_cache'd helpers keep their cache controls
        if hasattr(original, name):
            setattr(wrapper, name, getattr(original, name))


def _rebind(replaced: dict[int, tuple[Any, Any]]) -> None:
    """Where a loaded transformers module bound an original by name (attnguard activated after
    transformers was imported), bind the wrapper instead."""
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or name.partition(".")[0] != "transformers":
            continue
        try:
            found = [(a, v) for a, v in vars(module).items() if id(v) in replaced]
        except Exception:
            continue
        for attr, value in found:
            original, wrapper = replaced[id(value)]
            if value is original:
                ledger.patch(module, attr, lambda _o, _w=wrapper: _w)


def patch(import_utils: ModuleType) -> None:
    """Wrap this release's availability helpers (see :data:`HELPERS`) and, from 5.0,
    ``_is_package_available``."""
    minor = minor_release("transformers")
    if minor is None:
        return
    wraps: dict[str, Callable[[Any], Any]] = {
        helper: lambda o, _p=package, _m=modules: _wrap_helper(o, _p, _m)
        for helper, (package, modules) in HELPERS.get(minor, {}).items()
    }
    if minor >= IMPORTING_CHECK_FROM:
        wraps["_is_package_available"] = _wrap_package_check
    replaced: dict[int, tuple[Any, Any]] = {}
    for name, make in wraps.items():
        original = vars(import_utils).get(name)
        if not callable(original) or hasattr(original, "__attnguard_original__"):
            continue
        replaced[id(original)] = (original, ledger.patch(import_utils, name, make))
    _rebind(replaced)


def unpatch() -> None:
    """Restore every original; forget what the imports found."""
    ledger.unpatch_all()
    with _lock:
        _import_errors.clear()
