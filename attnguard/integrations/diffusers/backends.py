"""A requested backend diffusers cannot run here: its calls on attnguard's twins, or its error.

diffusers asks ``_check_attention_backend_requirements(backend)`` when a backend is chosen
(``set_attention_backend``, ``attention_backend(...)``); it raises ``RuntimeError`` when the
backend's package cannot be used ("Flash Attention backend 'flash' is not usable because of
missing package ..."). The check is wrapped: for a backend with twins (:data:`.shape.TWINNED`)
the module globals its function calls, ``None`` here, are given the twins (:mod:`.twins`) and the
check passes, with one ``backend_fallback`` event; for any other backend diffusers' error stands,
with one ``observed`` event (``no_twin``). A backend chosen by ``DIFFUSERS_ATTN_BACKEND`` is
never checked by diffusers: it is judged when the dispatcher is patched.

The twins never serve a call they do not compute: the functions diffusers reaches only for
context parallelism (``_wrapped_flash_attn_forward``) raise diffusers' own requirements error.
The ``*_hub`` backends (the ``kernels`` package missing or refused) follow the kernel hub's rule
instead (:mod:`.hub`).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any

from ... import callguard, kernels, runtime
from ...computing import NOW, subject
from ...errors import AttnGuardError
from ...failopen import report_internal_error
from ...kernel_identity import KernelId, Source
from ...observability import events
from ..ledger import Ledger
from . import hub, shape

ledger = Ledger("diffusers")
_lock = threading.Lock()


def site(backend: str) -> str:
    return f"diffusers.{backend}"


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:300]


def patch(module: ModuleType) -> None:
    """Wrap the requirements check; bind guarded kernels; judge the backend
    ``DIFFUSERS_ATTN_BACKEND`` chose."""
    ledger.patch(module, "_check_attention_backend_requirements", lambda o: _wrap(module, o))
    _bind_guarded(module)
    active = getattr(shape.registry(module), "_active_backend", None)
    name = str(getattr(active, "value", active))
    if name in shape.TWINNED and _unusable(module, name):
        try:
            module._check_attention_backend_requirements.__attnguard_original__(active)
        except RuntimeError as err:
            serve(module, name, err, how=" (chosen by DIFFUSERS_ATTN_BACKEND)")


def _bind_guarded(module: ModuleType) -> None:
    """diffusers imported flash-attn's functions before attnguard guarded them: bind the guarded
    ones (the flash_attn integration's, patched first) where the backend functions call them."""
    owner = sys.modules.get("flash_attn")
    for g in ("flash_attn_func", "flash_attn_varlen_func"):
        held = getattr(module, g, None)
        guarded = getattr(owner, g, None)
        if held is not None and getattr(guarded, "__attnguard_original__", None) is held:
            ledger.patch(module, g, lambda _o, _g=guarded: _g)


def _unusable(module: ModuleType, name: str) -> bool:
    """True when the globals the backend's function calls are None: diffusers could not import
    the package (the twins replace nothing that exists)."""
    return all(getattr(module, g, None) is None for g in shape.TWINNED[name].kernels)


def _wrap(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    def _check_attention_backend_requirements(backend: Any) -> Any:
        try:
            return original(backend)
        except RuntimeError as err:
            name = str(getattr(backend, "value", backend))
            if hub.is_hub(module, name):  # a *_hub backend: the kernel hub's rule
                if runtime.IN_FORCE.settings is None or not hub.failed(module, name, err):
                    raise
            elif not serve(module, name, err):
                raise
            return None

    _check_attention_backend_requirements.__wrapped__ = original  # type: ignore[attr-defined]
    _check_attention_backend_requirements.__attnguard_original__ = original  # type: ignore[attr-defined]
    return _check_attention_backend_requirements


def serve(module: ModuleType, name: str, err: RuntimeError, how: str = "") -> bool:
    """True when backend ``name`` now runs on twins (or already did); False: diffusers' error
    ``err`` stands (no twin, warn mode, the remedy disabled). Strict mode raises
    AttnGuardError. Never raises anything else."""
    try:
        return _serve(module, name, err, how)
    except AttnGuardError:
        raise
    except Exception as exc:
        report_internal_error(site(name), exc)
        return False


def _identity(name: str) -> KernelId:
    """What backend ``name``'s kernel is: its package's family (None: attnguard has no twin)."""
    twinned = shape.TWINNED.get(name)
    return KernelId(name, Source.PACKAGE, twinned.family if twinned is not None else None)


def _serve(module: ModuleType, name: str, err: RuntimeError, how: str) -> bool:
    with _lock:
        row = subject("diffusers", name)
        if NOW.on_twins(row):
            return True
        twinned = shape.TWINNED.get(name)
        fn = getattr(shape.registry(module), "_backends", {}).get(shape.backends(module).get(name))
        problem = ""
        if twinned is not None and not _unusable(module, name):
            twinned = None  # the package's functions exist: nothing to stand in for
        elif twinned is not None and not shape.reads_names(fn, twinned.kernels):
            problem = f"its function no longer calls {', '.join(twinned.kernels)}"
        decided = kernels.verdict(
            _identity(name),
            ("backend_package_unusable", _first_line(err)),
            path_problem=problem,
            chosen_for=how,
            library="diffusers",
            function=twinned.function if twinned is not None else "",
        )
        if decided.twins:
            decided = replace(decided, reason_code="backend_package_unusable")
        else:
            decided = replace(decided, reason_code="no_twin")
        if NOW.get(row) is not None and not decided.twins:
            return False  # said once
        if not callguard.apply_verdict(
            runtime.IN_FORCE.settings, decided, site(name), row, requested=name
        ):
            return False
        assert twinned is not None
        from .twins import kernel_twins

        twins = kernel_twins()
        for g in twinned.kernels:
            if getattr(module, g, None) is None:
                ledger.patch(module, g, lambda _o, _t=twins[g]: _t)
        for g in twinned.refused:
            if hasattr(module, g) and getattr(module, g) is None:
                ledger.patch(module, g, lambda _o: _refusal(name, err))
        return True


def _no_twin(name: str, err: RuntimeError, why: str) -> bool:
    row = subject("diffusers", f"{name}:{why}")
    if NOW.get(row) is None:
        decided = kernels.verdict(
            KernelId(name, Source.PACKAGE, None),
            ("no_twin", _first_line(err)),
            library="diffusers",
        )
        decided = replace(decided, reason_code="no_twin", change=f"{why}: diffusers' error stands")
        callguard.apply_verdict(runtime.IN_FORCE.settings, decided, site(name), row, requested=name)
    return False


def _refusal(name: str, err: RuntimeError) -> Callable[..., Any]:
    """A stand-in for a kernel function the twins do not replace: the user's own error."""
    message = str(err)

    def refused(*_args: Any, **_kwargs: Any) -> Any:
        if not events.is_compiling():
            _no_twin(name, err, "its twins do not compute context-parallel calls")
        raise RuntimeError(message)

    return refused


def unpatch() -> None:
    ledger.unpatch_all()
    NOW.clear("diffusers")
