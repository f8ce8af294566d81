"""Flash attention that diffusers loads from the Hugging Face kernel hub: its ``*_hub`` backends.

diffusers keeps one hub kernel per ``*_hub`` backend in ``_HUB_KERNELS_REGISTRY`` (the repo, the
kernel's function the backend calls, ``kernel_fn`` once loaded, and the functions its
context-parallel code reaches, ``wrapped_forward_fn`` / ``wrapped_backward_fn``). Choosing such a
backend (``set_attention_backend``, ``attention_backend(...)``) runs diffusers' requirements check
(the ``kernels`` package installed, at a version diffusers accepts: its own bounds, read from its
error) and then ``_maybe_download_kernel_for_backend`` (``kernels.get_kernel``: the cache,
``LOCAL_KERNELS``, or the hub). Both run first, exactly as they would without attnguard:

* the hub kernel loads: it computes every call, untouched; recorded (:mod:`attnguard.facts.hub`,
  ``attnguard doctor``), no event;
* it cannot (either raised): recorded, and :func:`attnguard.kernels.verdict`
  decides. Where the kernel's functions are flash-attn's, ``kernel_fn`` becomes attnguard's twin
  of the function the backend calls (:func:`.twins.hub_kernel_twin`) and diffusers' backend
  function runs as it would with the kernel (one ``backend_fallback`` per hub kernel, site
  ``diffusers.hub_kernel:<repo>``); otherwise (SageAttention, aiter, a backend shaped otherwise)
  diffusers' error stands, with one ``observed`` event.

The twins never compute what they do not: the context-parallel functions, and a call passing an
argument the flash-attn 3/4 twins do not compute (``qv``, FP8 descales), raise the error
diffusers raised at load, with one ``observed`` event (``no_twin``). A backend diffusers never
loaded (chosen by ``DIFFUSERS_ATTN_BACKEND``, or named by a call) is left as diffusers has it.
"""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ... import callguard, kernel_identity, kernels, runtime
from ...computing import NOW, subject
from ...errors import AttnGuardError
from ...facts import hub as hub_facts
from ...failopen import report_internal_error
from ...fallback import families
from ...observability import events
from ..ledger import Ledger
from . import shape

SITE = "diffusers.hub_kernel"  # events say f"{SITE}:{repo}": one per hub kernel
ledger = Ledger("diffusers_hub")
_lock = threading.RLock()
_KERNEL_ATTRS = ("kernel_fn", "wrapped_forward_fn", "wrapped_backward_fn")
# diffusers' words for a `kernels` release it refuses ("... a `kernels` version of at least 0.12")
_AT_LEAST = re.compile(r"`kernels` version of at least (\d+(?:\.\d+)*)")


def _name(backend: Any) -> str:
    return str(getattr(backend, "value", backend))


def is_hub(module: ModuleType, backend: Any) -> bool:
    return _name(backend) in shape.hub_configs(module)


def package(err: BaseException | None) -> hub_facts.HubPackage:
    """The ``kernels`` package as diffusers sees it: its version and, where diffusers refused
    it, the versions diffusers accepts (the bound its own error names)."""
    found = _AT_LEAST.search(str(err)) if err is not None else None
    accepted = f">={found.group(1)}" if found else None
    return hub_facts.HubPackage(hub_facts.kernels_version(), accepted, "diffusers")


def patch(module: ModuleType) -> None:
    """Wrap diffusers' loader of hub kernels (where this diffusers has one shaped as known)."""
    if shape.hub_configs(module) and shape.hub_loader(module) is not None:
        ledger.patch(module, shape.HUB_LOADER, lambda original: _wrap_loader(module, original))


def _row(name: str) -> str:
    return subject("diffusers", name)


def _wrap_loader(module: ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _maybe_download_kernel_for_backend(backend: Any) -> Any:
        name = _name(backend)
        config = shape.hub_configs(module).get(name)
        if config is None or runtime.IN_FORCE.settings is None:
            return original(backend)
        # diffusers' own attempt, every time it makes one: where the twins serve the backend
        # after a failed load, its loader sees the kernel missing again and tries (the kernel
        # may load now), and the twins stay where it fails again
        ours = {a: getattr(config, a, None) for a in _KERNEL_ATTRS}
        ours = {a: fn for a, fn in ours.items() if getattr(fn, "__attnguard_twin__", False)}
        for attr in ours:
            setattr(config, attr, None)
        try:
            result = original(backend)
        except Exception as err:
            for attr, fn in ours.items():
                setattr(config, attr, fn)
            if ours or failed(module, name, err):
                return None
            raise
        try:
            if config.kernel_fn is not None:
                hub_facts.record(config.repo_id, None, package(None), library="diffusers")
                identity = kernel_identity.of_request(config.repo_id)
                if identity is not None:
                    decided = kernels.verdict(identity, None, library="diffusers")
                    callguard.apply_verdict(
                        runtime.IN_FORCE.settings, decided, f"{SITE}:{config.repo_id}", _row(name)
                    )
        except Exception as ours_err:
            report_internal_error(f"{SITE}:{config.repo_id}", ours_err)
        return result

    _maybe_download_kernel_for_backend.__attnguard_original__ = original  # type: ignore[attr-defined]
    return _maybe_download_kernel_for_backend


def failed(module: ModuleType, name: str, err: BaseException) -> bool:
    """diffusers could not load the hub kernel of backend ``name`` (``err``: its requirements
    check's or its loader's error). True: the twins compute the backend's calls now; False:
    ``err`` stands. Strict mode raises AttnGuardError; nothing else is raised."""
    try:
        return _failed(module, name, err)
    except AttnGuardError:
        raise
    except Exception as ours:
        report_internal_error(f"{SITE}:{name}", ours)
        return False


def _failed(module: ModuleType, name: str, err: BaseException) -> bool:
    config = shape.hub_configs(module)[name]
    repo = config.repo_id
    with _lock:
        if NOW.on_twins(_row(name)):
            return True
        outcome = hub_facts.record(repo, err, package(err), library="diffusers")
        twin, problem = _twin(module, name, config)
        identity = kernel_identity.of_request(repo) or kernel_identity.KernelId(
            repo, kernel_identity.Source.HUB, None
        )
        decided = kernels.verdict(
            identity,
            (outcome.reason_code, outcome.reason),
            path_problem=problem,
            chosen_for=name,
            library="diffusers",
        )
        site = f"{SITE}:{repo}"
        fields = {"requested": name, "hub_kernel": repo, "rule": decided.rule}
        if not callguard.apply_verdict(
            runtime.IN_FORCE.settings, decided, site, _row(name), **fields
        ):
            return False
        assert twin is not None
        _serve(name, config, twin, err.with_traceback(None))
        return True


def _twin(module: ModuleType, name: str, config: Any) -> tuple[Callable[..., Any] | None, str]:
    """The twin that computes backend ``name``'s calls, or why its code path is not the one
    attnguard's twins cover ("" with no twin: attnguard does not know what the kernel
    computes)."""
    from .twins import hub_kernel_twin

    family = families.hub_family(config.repo_id)
    if family is None:
        return None, ""
    fn = shape.registry(module)._backends.get(shape.backends(module).get(name))
    if not shape.reads_names(fn, shape.HUB_KERNEL_READS):
        return None, "its *_hub backend function does not call the hub kernel's kernel_fn"
    if config.kernel_fn is not None and not getattr(config.kernel_fn, "__attnguard_twin__", False):
        return None, "the hub kernel loaded, and diffusers refused what it found in it"
    twin = hub_kernel_twin(family, config.function_attr)
    if twin is None:
        return None, f"it calls {family}'s {config.function_attr}, which has no twin"
    return twin, ""


def _serve(name: str, config: Any, twin: Callable[..., Any], err: BaseException) -> None:
    """Put the twin where the backend function calls the kernel; the context-parallel
    functions diffusers would have resolved from the kernel raise ``err``."""
    from ...fallback.refusal import Uncomputed

    repo = config.repo_id

    @functools.wraps(twin)
    def kernel(*args: Any, **kwargs: Any) -> Any:
        try:
            return twin(*args, **kwargs)
        except Uncomputed as why:  # an argument the twin does not compute: diffusers' error
            _stand_aside(name, repo, f"calls passing {why}")
            raise err.with_traceback(None) from None

    kernel.__attnguard_twin__ = True  # type: ignore[attr-defined]
    ledger.patch(config, "kernel_fn", lambda _o: kernel)
    config.kernel_fn = kernel  # again, where the ledger holds an earlier patch
    for fn_attr in ("wrapped_forward_fn", "wrapped_backward_fn"):
        path = getattr(config, fn_attr.replace("_fn", "_attr"), None)
        if path is not None and getattr(config, fn_attr, None) is None:
            refused = _refusal(name, repo, err)
            ledger.patch(config, fn_attr, lambda _o, _r=refused: _r)
            setattr(config, fn_attr, refused)


def _stand_aside(name: str, repo: str, what: str) -> None:
    if not events.is_compiling():
        events.emit(
            "observed",
            site=f"{SITE}:{repo}",
            reason_code="no_twin",
            reason=f"hub kernel {repo} ({name}) did not load here and attnguard's twins do not "
            f"compute {what}: diffusers' error stands",
            requested=name,
            hub_kernel=repo,
        )


def _refusal(name: str, repo: str, err: BaseException) -> Callable[..., Any]:
    """A stand-in for a context-parallel kernel function the twins do not replace."""

    def refused(*_args: Any, **_kwargs: Any) -> Any:
        _stand_aside(name, repo, "context-parallel calls")
        raise err.with_traceback(None)

    refused.__attnguard_twin__ = True  # type: ignore[attr-defined]
    return refused


def describe(module: ModuleType, name: str, usable: bool) -> str:
    """``attnguard doctor``'s words for what computes backend ``name``'s calls here."""
    config = shape.hub_configs(module)[name]
    repo = config.repo_id
    identity = kernel_identity.of_request(repo)
    functions = identity.family.value if identity is not None and identity.computable else None
    if NOW.on_twins(_row(name)):
        found = hub_facts.outcome(repo)
        why = f": {found.reason_code}" if found is not None else ""
        return (
            f"attnguard's twin of {functions}'s {config.function_attr} ({repo} did not load{why})"
        )
    found = hub_facts.outcome(repo)
    if found is not None and found.loaded:
        return f"{repo}, loaded by diffusers (as requested)"
    code = hub_facts.HUB_KERNEL_UNAVAILABLE if usable else hub_facts.HUB_PACKAGE_MISSING
    twin, problem = _twin(module, name, config)
    decided = kernels.verdict(
        identity or kernel_identity.KernelId(repo, kernel_identity.Source.HUB, None),
        (code, ""),
        path_problem=problem,
        chosen_for=name,
        library="diffusers",
    )
    where = "where it cannot load" if usable else "it cannot load here"
    then = (
        f"attnguard's twin of {functions}'s {config.function_attr}"
        if decided.twins
        else "diffusers' own error"
    )
    return f"{repo} (diffusers loads it when chosen); {where}: {then}"


def unpatch() -> None:
    ledger.unpatch_all()
    NOW.clear("diffusers")
    hub_facts.reset("diffusers")
