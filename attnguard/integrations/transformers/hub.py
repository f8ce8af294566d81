"""Flash attention that transformers loads from the Hugging Face kernel hub.

transformers 5.x loads a hub kernel for attention in three ways: an ``"org/repo"`` request
(``attn_implementation="kernels-community/flash-attn2"``, ``set_attn_implementation`` alike), its
own fallback when a ``flash_attention_2/3/4`` request meets no flash-attn and the ``kernels``
package is there (``FLASH_ATTN_KERNEL_FALLBACK``), and the models that list the flash kernels they
work with (``_compatible_flash_implementations``: GPT-OSS goes to
``kernels-community/vllm-flash-attn3``). Every way ends in one loader,
``transformers.integrations.hub_kernels.load_and_register_attn_kernel`` (4.56-4.57:
``load_and_register_kernel``), which this module wraps (4.52-4.55 call ``kernels`` from
``modeling_utils`` without one: their hub requests are left as they are):

* the loader runs first, exactly as it would without attnguard (its network calls, its cache);
  a hub kernel that loads computes every call, untouched, and is recorded (``attnguard doctor``
  and the activated event say which hub kernel serves);
* one that cannot load (no ``kernels``, a version transformers refuses, offline without a cached
  build, no build for this torch and device, its import failing) is recorded too
  (:mod:`attnguard.facts.hub`), and :func:`attnguard.kernels.verdict` decides: the
  twins compute it where its functions are flash-attn's (the loader registers the request's
  attention and mask functions as it would have, and hands transformers' flash code path the
  twins in place of the kernel's functions), or attnguard steps aside (its error stands). One
  event per hub kernel says which.

The plan (:mod:`attnguard.plan.backend`) leaves a request that transformers sends to the hub to
transformers (``LoadRequest.hub_kernel``, from :func:`route`), so that the hub kernel is tried.
"""

from __future__ import annotations

import contextvars
import functools
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from ... import callguard, kernel_identity, kernels, runtime
from ...computing import NOW, subject
from ...errors import AttnGuardError
from ...facts import hub as hub_facts
from ...failopen import report_internal_error
from ..ledger import Ledger
from . import wiring

MODULE = "transformers.integrations.hub_kernels"
SITE = "transformers.hub_kernel"  # events say f"{SITE}:{name}": one per hub kernel
# transformers' loader of attention hub kernels, by release (the first one the module has)
LOADERS = ("load_and_register_attn_kernel", "load_and_register_kernel")
# modules that may bind the loader at their import (4.57's modeling_utils)
_BINDERS = ("transformers.modeling_utils", "transformers.modeling_flash_attention_utils")

ledger = Ledger("transformers_hub")
_lock = threading.Lock()  # one decision at a time about a hub kernel that did not load


@dataclass
class _Gate:
    """The model whose backend gate is running (its class, and the request it made): the loader
    is called from inside that gate and needs both to judge the model's arguments and say so.
    ``strict``: the AttnGuardError strict mode raised in the loader (transformers turns a failed
    fallback load into its own flash-attn ImportError; the gate raises this one instead)."""

    cls: type
    requested: Any
    strict: AttnGuardError | None = None


_GATE: contextvars.ContextVar[_Gate | None] = contextvars.ContextVar(
    "attnguard_hub_gate", default=None
)


@contextmanager
def gate(cls: type, requested: Any) -> Iterator[None]:
    """While open, a hub kernel loaded on this thread is loaded for ``cls``'s ``requested``."""
    current = _Gate(cls, requested)
    token = _GATE.set(current)
    try:
        yield
    except Exception as exc:
        if current.strict is not None and exc is not current.strict:
            raise current.strict from exc
        raise
    finally:
        _GATE.reset(token)


# --- what transformers would do -----------------------------------------------------------------


def package() -> hub_facts.HubPackage:
    """The ``kernels`` package as this transformers release sees it: its version and the
    versions the release accepts (its own ``KERNELS_MIN_VERSION`` / ``KERNELS_MAX_VERSION``)."""
    utils = sys.modules.get("transformers.utils.import_utils")
    low = getattr(utils, "KERNELS_MIN_VERSION", None)
    high = getattr(utils, "KERNELS_MAX_VERSION", None)
    accepted = ",".join(f"{op}{v}" for op, v in ((">=", low), ("<", high)) if isinstance(v, str))
    return hub_facts.HubPackage(hub_facts.kernels_version(), accepted or None, "transformers")


def _transformers_loads_hub() -> bool:
    """transformers' own answer: is the ``kernels`` package there, at a version it accepts?"""
    utils = sys.modules.get("transformers.modeling_utils")
    check = getattr(utils, "is_kernels_available", None)
    try:
        return bool(check()) if callable(check) else False
    except Exception:
        return False


def _flash_available(implementation: str) -> bool:
    """transformers' own answer: is the flash-attn package behind ``implementation`` there?
    (The check its backend gate asks: the compatibility matrix's, else the release's
    ``is_flash_attn_N_available``.)"""
    version = implementation.split("|", 1)[-1].rsplit("_", 1)[-1]
    flash_utils = sys.modules.get("transformers.modeling_flash_attention_utils")
    matrix = getattr(flash_utils, "FLASH_ATTENTION_COMPATIBILITY_MATRIX", None)
    check = None
    if isinstance(matrix, dict) and version.isdigit():
        check = (matrix.get(int(version)) or {}).get("general_availability_check")
    if not callable(check):
        utils = sys.modules.get("transformers.utils.import_utils")
        check = getattr(utils, f"is_flash_attn_{version}_available", None)
    try:
        return bool(check()) if callable(check) else True
    except Exception:
        return True


def fallback_repo(implementation: str) -> str:
    """The hub kernel transformers loads for ``implementation`` (``flash_attention_2``) when
    flash-attn is missing ("" where this release has no such fallback)."""
    utils = sys.modules.get("transformers.modeling_utils")
    table = getattr(utils, "FLASH_ATTN_KERNEL_FALLBACK", None)
    if not isinstance(table, dict):
        flash_utils = sys.modules.get("transformers.modeling_flash_attention_utils")
        table = getattr(flash_utils, "FLASH_ATTN_KERNEL_FALLBACK", None)
    found = table.get(implementation.split("|", 1)[-1]) if isinstance(table, dict) else None
    return found if isinstance(found, str) else ""


def route(cls: type, requested: Any) -> str:
    """The hub kernel transformers will load for ``cls``'s ``requested`` implementation, or ""
    when it loads none: an ``"org/repo"`` request itself; the hub kernel a model's own list of
    compatible flash kernels routes a flash request to; transformers' fallback for a
    ``flash_attention_N`` request where flash-attn N is missing and ``kernels`` is accepted."""
    from . import routing

    if not isinstance(requested, str):
        return ""
    if kernel_identity.hub_repo(requested):
        return requested
    if not kernel_identity.is_flash_request(requested):
        return ""
    routed = routing.routed_to(cls, requested)
    if routed is not None:
        return routed if kernel_identity.hub_repo(routed) else ""
    return fallback_route(requested) if getattr(cls, "_supports_flash_attn", True) else ""


def fallback_route(requested: str) -> str:
    """The hub kernel transformers' own fallback loads for a ``flash_attention_N`` request here:
    its flash-attn package missing (transformers' own check) and ``kernels`` at a version it
    accepts; "" where it loads none."""
    repo = fallback_repo(requested)
    if repo and not _flash_available(requested) and _transformers_loads_hub():
        return repo
    return ""


def report() -> dict[str, Any]:
    """For ``attnguard doctor``: the ``kernels`` package as this transformers release sees it,
    offline mode, the hub kernel transformers itself loads for each flash request here, the hub
    kernels this machine has without network and what attnguard does where each cannot load, and
    what became of the hub kernels tried in this process."""
    import importlib

    try:
        importlib.import_module("transformers.modeling_utils")
    except Exception as exc:
        return {"error": f"transformers does not import ({type(exc).__name__})"}
    pkg = package()
    refusal = pkg.refusal()
    loads_hub = _transformers_loads_hub()
    fallback = {}
    for implementation in ("flash_attention_2", "flash_attention_3", "flash_attention_4"):
        repo = fallback_repo(implementation)
        if not repo:
            continue
        if _flash_available(implementation):
            fallback[implementation] = "its flash-attn package is installed: no hub kernel"
        elif loads_hub:
            fallback[implementation] = f"{repo} (transformers' own fallback)"
        else:
            fallback[implementation] = (
                f"none: transformers would load {repo}, but {refusal[1]}"
                if refusal
                else f"none ({repo} not tried)"
            )
    return {
        "kernels": pkg.version,
        "accepted": pkg.accepted,
        "refused": refusal[1] if refusal else None,
        "offline": hub_facts.offline(),
        "flash_requests": fallback,
        "here": [
            {
                "repo": k.repo,
                "variants": list(k.variants),
                "source": k.source,
                "twins_compute": _twins_compute(k.repo),
            }
            for k in hub_facts.cached()
        ],
        "tried": [
            {"repo": k.repo, "loaded": k.loaded, "reason_code": k.reason_code, "reason": k.reason}
            for k in hub_facts.outcomes()
        ],
    }


def report_lines(data: dict[str, Any]) -> list[str]:
    """``attnguard doctor``'s text for :func:`report`."""
    if "error" in data:
        return [f"  {data['error']}"]
    version, accepted = data["kernels"], data["accepted"]
    window = f"kernels{accepted}" if accepted else "any version"
    if version is None:  # absent: nothing was refused
        head = f"kernels: not installed (this transformers accepts {window})"
    elif data["refused"]:
        head = f"kernels {version}: refused (this transformers accepts only {window})"
    else:
        head = f"kernels {version}: accepted (this transformers accepts {window})"
    lines = [f"  {head}; huggingface_hub offline: {'yes' if data['offline'] else 'no'}"]
    for request, what in data["flash_requests"].items():
        lines.append(f"  {request} with its flash-attn missing: {what}")
    lines.append("  hub kernels this machine has without network (cache, LOCAL_KERNELS):")
    for k in data["here"] or []:
        does = (
            f"where it cannot load, attnguard's twins compute its {k['twins_compute']} functions"
            if k["twins_compute"]
            else "not known to attnguard: where it cannot load, its error stands"
        )
        lines.append(f"    {k['repo']} [{', '.join(k['variants'])}] ({k['source']}): {does}")
    if not data["here"]:
        lines.append("    none")
    for k in data["tried"]:
        state = "loaded" if k["loaded"] else f"did not load ({k['reason_code']}: {k['reason']})"
        lines.append(f"  this process: {k['repo']} {state}")
    lines.append(
        "  known hub kernels whose functions are flash-attn's: "
        + ", ".join(k.describe() for k in kernel_identity.HUB_REPOS.values())
    )
    return lines


def _twins_compute(repo: str) -> str | None:
    """The family attnguard's twins compute for hub kernel ``repo`` where it cannot load."""
    kernel = kernel_identity.of_request(repo)
    return kernel.family.value if kernel is not None and kernel.computable else None


# --- the loader ---------------------------------------------------------------------------------


def _loader(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def load(attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        repo = kernel_identity.hub_repo(attn_implementation)
        if repo is None or runtime.IN_FORCE.settings is None:
            return original(attn_implementation, *args, **kwargs)
        name = kernel_identity.bare(str(attn_implementation))
        # the library's own attempt, every time it makes one (a kernel that did not load before
        # may load now: transformers 5.23 and later try again at the next load)
        try:
            kernel = original(attn_implementation, *args, **kwargs)
        except Exception as exc:
            try:
                served = _failed(attn_implementation, name, repo, exc, args, kwargs)
            except AttnGuardError:
                raise
            except Exception as ours:
                report_internal_error(SITE, ours)
                served = None
            if served is None:
                raise
            return served
        try:
            _loaded(attn_implementation, name, repo, kernel)
        except Exception as ours:
            report_internal_error(SITE, ours)
        return kernel

    load.__attnguard_original__ = original  # type: ignore[attr-defined]
    return load


def _loaded(key: Any, name: str, repo: str, kernel: Any) -> None:
    """The hub kernel loaded: it computes every call, untouched. Recorded as what it is (the
    functions it exports), its registry entry guarded by that, and the twins that served it
    before (a load that failed earlier in this process) no longer do."""
    from . import attention, flash_serving

    hub_facts.record(repo, None, package())
    identity = kernel_identity.of_hub_module(name, kernel)
    row = subject("transformers", name)
    was_on_twins = NOW.on_twins(row)
    callguard.apply_verdict(runtime.IN_FORCE.settings, kernels.verdict(identity, None), SITE, row)
    if was_on_twins:
        flash_serving.stop_serving(name)
    utils = sys.modules.get("transformers.modeling_utils")
    if utils is not None:
        attention.reidentify(utils, str(key))


def _failed(
    key: Any, name: str, repo: str, exc: BaseException, args: tuple[Any, ...], kw: dict[str, Any]
) -> Any:
    """The loader raised: record why, decide, and return the twins' stand-in module or None
    (the error stands)."""
    from . import flash_path, flash_serving

    outcome = hub_facts.record(repo, exc, package())
    current = _GATE.get()
    cls, requested = (current.cls, current.requested) if current is not None else (None, None)
    chosen_for = requested if isinstance(requested, str) and requested != name else ""
    row = subject("transformers", name)
    with _lock:
        if NOW.on_twins(row):  # decided before (and said): the twins serve it again
            return _twins_module(key, args, kw)
        uncomputed: tuple[str, ...] = ()
        path_problem = flash_path.unrecognised(name)
        if cls is not None and not path_problem:
            from . import routing

            uncomputed = tuple(routing.uncomputed_keywords(cls, flash_serving.computed_for(name)))
        identity = kernel_identity.of_request(name)
        assert identity is not None  # a hub name: hub_repo(name) is not None
        decided = kernels.verdict(
            identity,
            (outcome.reason_code, outcome.reason),
            path_problem=path_problem,
            uncomputed=uncomputed,
            chosen_for=chosen_for,
        )
        fields: dict[str, Any] = {
            "requested": chosen_for or name,
            "hub_kernel": name,
            "rule": decided.rule,
        }
        if cls is not None:
            fields["model"] = cls.__name__
        if chosen_for:
            fields["transformers_chooses"] = name
        if not decided.twins and cls is None:  # a call-time lookup: what the load said stands
            return None
        try:
            applied = callguard.apply_verdict(
                runtime.IN_FORCE.settings, decided, f"{SITE}:{name}", row, **fields
            )
        except AttnGuardError as strict:
            if current is not None:
                current.strict = strict
            raise
        if not applied:
            return None
        return _twins_module(key, args, kw)


def _twins_module(key: Any, args: tuple[Any, ...], kw: dict[str, Any]) -> Any:
    """Do what the loader does for a flash kernel that loaded — register ``key``'s attention
    function (transformers' flash attention, or the wrapper it was given) and flash's mask — and
    return a stand-in for the kernel module holding the twins of its functions: those of the
    kernel's family, so transformers passes them what it would pass the kernel."""
    from . import flash_path, flash_serving, flash_state

    utils = sys.modules["transformers.modeling_utils"]
    registry = utils.ALL_ATTENTION_FUNCTIONS
    wrapper = args[0] if args else kw.get("attention_wrapper")
    if wrapper is None:
        flash = registry["flash_attention_2"]
        wrapper = getattr(flash, "__attnguard_original__", flash)
    registry.register(key, wrapper)
    masks = getattr(
        sys.modules.get("transformers.masking_utils"), "ALL_MASK_ATTENTION_FUNCTIONS", None
    )
    if masks is not None:
        masks.register(key, masks["flash_attention_2"])
    name = str(key).split("|", 1)[-1]
    flash_serving.serving(name)
    twins = flash_path.kernels_by_role(flash_state.family_of(name))  # its family's, signatures too
    stand_in = SimpleNamespace(
        __name__=f"attnguard twins of {name}",
        flash_attn_func=twins.get("flash_attn_func"),
        flash_attn_varlen_func=twins.get("flash_attn_varlen_func"),
        flash_attn_with_kvcache=twins.get("flash_attn_with_kvcache"),
    )
    flash_utils = sys.modules.get(flash_state.MODULE)
    forward = getattr(flash_utils, "_flash_attention_forward", None)
    if "implementation" in wiring._named_parameters(forward):
        # 4.56-4.57: the loader binds the kernel module into the attention function and
        # resolves its functions at once (the flash path would otherwise take whichever
        # flash-attn it finds, not this kernel's family)
        registry.register(key, functools.partial(wrapper, implementation=stand_in))
        flash_utils.lazy_import_flash_attention(stand_in, force_import=True)
    return stand_in


# --- patch / unpatch ----------------------------------------------------------------------------


def patch() -> None:
    """Wrap transformers' loader of attention hub kernels where this release has one, and the
    names other transformers modules bound it under at their import."""
    module = sys.modules.get(MODULE)
    if module is None:
        return
    for attr in LOADERS:
        original = vars(module).get(attr)
        if not callable(original):
            continue
        wrapper = ledger.patch(module, attr, _loader)
        for binder in _BINDERS:
            owner = sys.modules.get(binder)
            if owner is not None and vars(owner).get(attr) is original:
                ledger.patch(owner, attr, lambda _o, _w=wrapper: _w)
        return


def unpatch() -> None:
    ledger.unpatch_all()
    NOW.clear("transformers")
    hub_facts.reset()
