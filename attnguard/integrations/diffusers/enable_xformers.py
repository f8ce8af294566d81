"""``enable_xformers_memory_efficient_attention()`` where xformers is not installed.

A pipeline's or a model's ``enable_xformers_memory_efficient_attention()`` calls
``set_use_memory_efficient_attention_xformers(True)`` on every attention module. Two kinds:

* the classic ``Attention`` of ``diffusers.models.attention_processor`` (Stable Diffusion's UNet
  and VAE) installs processors that call ``xformers.ops.memory_efficient_attention``, through that
  module's global ``xformers``;
* an ``AttentionModuleMixin`` of ``diffusers.models.attention`` (Flux, ...) switches its module to
  the dispatcher's ``xformers`` backend.

Both check ``is_xformers_available()`` first (``ModuleNotFoundError``), then
``torch.cuda.is_available()`` (``ValueError``: diffusers refuses xformers without CUDA even where
it is installed), then probe the kernel with one call on the GPU.

Where xformers is missing on a machine with CUDA, the method runs as diffusers wrote it, with a
view of its module's globals in which ``is_xformers_available()`` is True and ``xformers``
(``xops``) is attnguard's stand-in for the package (``.ops`` as :func:`.twins.kernel_twins`):
diffusers' own checks, probe and choice of processors run unchanged, for that call only.
``import xformers`` still fails everywhere else and ``is_xformers_available()`` still answers False
(programs that test for xformers keep seeing the truth). The classic processors read the module
global at every call: it holds the stand-in from then on (restored on deactivation). One event per
process: ``backend_fallback`` (``xformers_missing``) for the classic processors, the dispatcher's
own ``backend_fallback`` (``backend_package_unusable``, :mod:`.backends`) for the mixin.

Without CUDA, diffusers' error stands, with one ``observed`` event (``xformers_missing``): serving
there would turn its ``ModuleNotFoundError`` into the ``ValueError`` of its next check, or compute
where diffusers refuses to.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
from collections.abc import Callable
from types import ModuleType, SimpleNamespace
from typing import Any

from ... import callguard, runtime
from ...errors import AttnGuardError
from ...failopen import report_internal_error
from ...kernels import Kernel
from ...observability import events
from ..ledger import Ledger
from . import shape

SITE = "diffusers.xformers_processors"
METHOD = "set_use_memory_efficient_attention_xformers"
ledger = Ledger("diffusers")  # the classic Attention's method, the processors' global
mixin_ledger = Ledger("diffusers")  # AttentionModuleMixin's method
_lock = threading.Lock()
_state = {"served": False, "announced": False, "processors": False}
_observed: set[str] = set()  # why diffusers' error stood (one event each)


def patch(module: ModuleType) -> None:
    """Guard ``Attention.set_use_memory_efficient_attention_xformers`` of
    ``diffusers.models.attention_processor`` (the classic processors), and the xformers processors
    a script installs itself (``set_attn_processor(XFormersAttnProcessor())``)."""
    _patch_class(ledger, getattr(module, "Attention", None), "xformers", classic=True)
    _patch_processors(module)


def _patch_processors(module: ModuleType) -> None:
    """Each processor class of the module whose ``__call__`` reaches the kernel through the
    module's ``xformers`` global (recognised by its code, not its name): where xformers is not
    installed, its first call puts the module's global on attnguard's stand-in (one
    ``backend_fallback``, ``xformers_missing``), as ``enable_xformers_memory_efficient_attention()``
    would on a machine with CUDA; the twin computes what xformers would, on any device (an
    installed xformers without CUDA ops has its CPU calls computed by the same twin). Warn mode,
    or the remedy switched off: diffusers' own error stands, said once."""
    for cls in list(vars(module).values()):
        call = vars(cls).get("__call__") if isinstance(cls, type) else None
        if getattr(cls, "__module__", None) == module.__name__ and shape.reads_names(
            call, ("xformers", "memory_efficient_attention")
        ):
            ledger.patch(cls, "__call__", lambda original: _processor_call(module, original))


def _processor_call(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(module, "xformers", 0) is None and runtime.IN_FORCE.settings.enabled:
            try:
                _serve_processors(module)
            except AttnGuardError:
                raise
            except Exception as exc:
                report_internal_error(SITE, exc)
        return original(self, *args, **kwargs)

    wrapper = functools.wraps(original)(__call__)
    wrapper.__attnguard_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _serve_processors(module: ModuleType) -> None:
    """The module's processors call the stand-in from now on (fix mode), else say why not once."""
    with _lock:
        if getattr(module, "xformers", 0) is not None or _state["processors"]:
            return
        _state["processors"] = True
        settings = runtime.IN_FORCE.settings
        if not (settings.changes_things and settings.allows("fallback")):
            _decide_processors()  # warn: what fix mode would do; strict raises; disabled: said
            return
        ledger.patch(module, "xformers", lambda _o: _standin())
        _decide_processors()


def _decide_processors() -> bool:
    settings = runtime.IN_FORCE.settings
    if not settings.allows("fallback"):
        events.emit(
            "observed",
            site=SITE,
            reason_code="xformers_missing",
            reason="an xformers attention processor was called where xformers is not installed; "
            "left as is (ATTNGUARD_DISABLE names fallback): diffusers' error stands",
            requested="xformers",
        )
        return False
    return callguard.decide(
        settings,
        "fallback",
        "backend_fallback",
        SITE,
        "xformers_missing",
        "an xformers attention processor was called where xformers is not installed; diffusers' "
        "xformers attention processors run with attnguard's twin of "
        "xformers.ops.memory_efficient_attention (torch SDPA) in place of the kernel",
        requested="xformers",
        selected=Kernel.SDPA_TWIN.value,
    )


def patch_mixin(module: ModuleType) -> None:
    """Guard ``AttentionModuleMixin.set_use_memory_efficient_attention_xformers`` of
    ``diffusers.models.attention`` (modules on the dispatcher)."""
    _patch_class(mixin_ledger, getattr(module, "AttentionModuleMixin", None), "xops", classic=False)


def _patch_class(book: Ledger, cls: Any, standin: str, *, classic: bool) -> None:
    method = vars(cls).get(METHOD) if isinstance(cls, type) else None
    if callable(method):
        book.patch(cls, METHOD, lambda original: _wrap(original, standin, classic))


def _wrap(original: Callable[..., Any], standin: str, classic: bool) -> Callable[..., Any]:
    def set_use_memory_efficient_attention_xformers(self: Any, *args: Any, **kwargs: Any) -> Any:
        use = args[0] if args else kwargs.get("use_memory_efficient_attention_xformers")
        if use and runtime.IN_FORCE.settings.enabled:
            try:
                viewed = _served_view(original, standin, classic)
            except AttnGuardError:
                raise
            except Exception as exc:
                report_internal_error(SITE, exc)
                viewed = None
            if viewed is not None:
                return _run_viewed(viewed, original, standin, classic, self, args, kwargs)
        return original(self, *args, **kwargs)

    wrapper = functools.wraps(original)(set_use_memory_efficient_attention_xformers)
    wrapper.__attnguard_original__ = original  # type: ignore[attr-defined]
    return wrapper


def _missing(fn: Callable[..., Any], standin: str) -> bool:
    """True when the module ``fn`` belongs to believes xformers is not installed: its
    ``is_xformers_available()`` says False and its global for the package is None (or already
    attnguard's stand-in)."""
    held = fn.__globals__
    available = held.get("is_xformers_available")
    package = held.get(standin, 0)
    ours = getattr(package, "__attnguard_standin__", False)
    return callable(available) and not available() and (package is None or ours)


def _served_view(fn: Callable[..., Any], standin: str, classic: bool) -> Callable[..., Any] | None:
    """``fn`` with a view of its globals in which xformers is installed, where this call is
    served; None where diffusers' own answer stands (xformers installed, no CUDA, warn mode, ...).
    One event says which, once per process."""
    if not _missing(fn, standin):
        return None  # xformers is there: diffusers' own path (the xformers integration guards it)
    import torch

    if not shape.reads_names(fn, ("is_xformers_available", standin)):
        return _stand_aside(
            "unrecognised",
            f"diffusers' {METHOD}() no longer reads is_xformers_available and {standin}",
        )
    if not torch.cuda.is_available():
        return _stand_aside(
            "no_cuda",
            "this machine has no CUDA GPU, and diffusers refuses xformers without one even where "
            "it is installed",
        )
    if classic:
        if not _classic_allowed():
            return None
    elif not _dispatcher_serves():
        return None
    return _view(fn, standin, _standin())


def _classic_allowed() -> bool:
    """fix mode (the remedy allowed): True, the event follows once the call succeeded. warn
    mode: the event says what would have changed; strict mode raises; False."""
    settings = runtime.IN_FORCE.settings
    if settings.changes_things and settings.allows("fallback"):
        return True
    if not _state["announced"]:  # once for the model's every attention module
        _decide_classic()
        _state["announced"] = True
    return False


def _decide_classic() -> bool:
    return callguard.decide(
        runtime.IN_FORCE.settings,
        "fallback",
        "backend_fallback",
        SITE,
        "xformers_missing",
        "enable_xformers_memory_efficient_attention(): xformers is not installed; diffusers' "
        "xformers attention processors run with attnguard's twin of "
        "xformers.ops.memory_efficient_attention (torch SDPA) in place of the kernel",
        requested="xformers",
        selected=Kernel.SDPA_TWIN.value,
    )


def _dispatcher_serves() -> bool:
    """The mixin's modules go to the dispatcher's ``xformers`` backend: True when it runs on the
    twins (its one event: :func:`.backends.serve`'s)."""
    import importlib

    from . import backends

    try:  # what set_attention_backend imports next (not imported inside an import finder here)
        ad = importlib.import_module("diffusers.models.attention_dispatch")
    except Exception:
        ad = None
    check = getattr(ad, "_check_attention_backend_requirements", None)
    original = getattr(check, "__attnguard_original__", None)
    key = shape.backends(ad).get("xformers") if ad is not None else None
    if ad is None or original is None or key is None:
        _stand_aside("unguarded", "attnguard does not guard this diffusers' attention dispatcher")
        return False
    try:
        original(key)
    except RuntimeError as err:
        how = " (enable_xformers_memory_efficient_attention)"
        return backends.serve(ad, "xformers", err, how=how)
    return False  # diffusers can use xformers after all: its own path


def _stand_aside(key: str, why: str) -> None:
    if key not in _observed:
        _observed.add(key)
        events.emit(
            "observed",
            site=SITE,
            reason_code="xformers_missing",
            reason=f"enable_xformers_memory_efficient_attention(): xformers is not installed and "
            f"{why}: diffusers' error stands",
            requested="xformers",
        )


def _standin() -> SimpleNamespace:
    from .twins import kernel_twins

    return SimpleNamespace(
        ops=kernel_twins()["xops"],
        __name__="attnguard's stand-in for xformers",
        __attnguard_standin__=True,
    )


def _view(fn: Callable[..., Any], name: str, standin: Any) -> Callable[..., Any]:
    """``fn`` itself, reading a copy of its module's globals in which xformers is installed."""
    view = dict(fn.__globals__)
    view["is_xformers_available"] = _installed
    view[name] = standin
    viewed = types.FunctionType(fn.__code__, view, fn.__name__, fn.__defaults__, fn.__closure__)
    viewed.__kwdefaults__ = fn.__kwdefaults__
    viewed.__standin__ = standin  # type: ignore[attr-defined]
    return viewed


def _installed() -> bool:
    return True


def _run_viewed(
    viewed: Callable[..., Any],
    original: Callable[..., Any],
    standin: str,
    classic: bool,
    self: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run diffusers' method in the view. Its own refusals (a processor it has no xformers
    variant for) are its errors: the call runs again unguarded and that answer stands."""
    try:
        out = viewed(self, *args, **kwargs)
    except Exception as exc:
        try:
            return original(self, *args, **kwargs)
        except Exception as own:
            if type(own) is not type(exc):  # our view got further than diffusers alone
                report_internal_error(SITE, exc)
            raise own from None
    if classic:
        _bind_classic(viewed, standin)
    return out


def _bind_classic(viewed: Callable[..., Any], name: str) -> None:
    """The classic processors call ``xformers.ops`` through their module's global."""
    module = sys.modules.get(getattr(viewed, "__module__", "") or "")
    with _lock:
        if module is not None and getattr(module, name, 0) is None:
            ledger.patch(module, name, lambda _o: viewed.__standin__)  # type: ignore[attr-defined]
        if not _state["served"]:
            _state["served"] = _state["announced"] = True
            _decide_classic()


def unpatch() -> None:
    ledger.unpatch_all()
    with _lock:
        _state["served"] = _state["announced"] = _state["processors"] = False
        _observed.clear()


def unpatch_mixin() -> None:
    mixin_ledger.unpatch_all()
