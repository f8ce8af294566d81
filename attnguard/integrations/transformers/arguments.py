"""The arguments transformers' flash path computes on attnguard's twins, and what to do with one
it would not compute.

transformers hands a flash kernel only the keyword arguments its signature declares and drops the
rest (``_process_flash_attention_kwargs``' ``supports_mapping``); anything its flash functions do
not name ends in a ``**kwargs`` they never read. What the path computes on the twins is read from
the release itself (:mod:`.wiring`: its functions' parameters and name maps), the
twins' signatures, the probe's verdict and the arguments every model threads through
(``TransformersKwargs``) -- never from a version number or a model name. Which of the others an
attention class passes by name is read from its module's code (:mod:`.routing`),
once, at load: an argument a model's forward only threads through ``**kwargs`` is dropped by
every attention implementation alike. What is left is never dropped silently:
:func:`unguarded_error` is the error the call meets with the requested kernel itself.

Also here: model modules that import transformers' flash path only where a flash-attn was
installed when they were imported (Falcon, GPT-Neo) get the names they read bound
(:func:`bind_flash_globals`).
"""

from __future__ import annotations

import inspect
import sys
import threading
from types import ModuleType
from typing import Any

from ... import callguard
from ...computing import NOW
from ...fallback import families
from ..ledger import Ledger
from . import wiring as transformers_wiring
from .wiring import FUNC

MODULE = "transformers.modeling_flash_attention_utils"

ledger = Ledger("transformers_arguments")
_lock = threading.RLock()
# family name -> what its twins compute (keyed by the name: torch.compile hashes a str, not a
# Family, on the per-call read)
_computed: dict[str, frozenset[str]] = {}
_NONE: frozenset[str] = frozenset()  # a constant: torch 2.4 cannot trace a call of frozenset()


def _typed_kwargs() -> set[str]:
    """The keyword arguments transformers threads through every model's forward to its attention
    functions (``TransformersKwargs`` / ``FlashAttentionKwargs``: positions, packed-row bounds,
    output flags): each is read by the flash path or carries no numbers."""
    names: set[str] = set()
    for module_name, attr in (
        ("transformers.utils.generic", "TransformersKwargs"),
        (MODULE, "FlashAttentionKwargs"),
    ):
        typed = getattr(sys.modules.get(module_name), attr, None)
        for klass in getattr(typed, "__mro__", ()):
            names |= set(getattr(klass, "__annotations__", {}))
    return names


def _registry_parameters() -> set[str]:
    """The named parameters of transformers' flash registry function (``flash_attention_forward``)."""
    fn = getattr(
        sys.modules.get("transformers.integrations.flash_attention"),
        "flash_attention_forward",
        None,
    )
    return set(transformers_wiring._named_parameters(fn)) if callable(fn) else set()


def computed_arguments(
    wiring: Any = None, missed: set[str] | None = None, family: Any = None
) -> frozenset[str]:
    """The keyword arguments of a flash registry call that transformers' flash path on the twins
    of ``family`` (flash-attn 2's where None) computes (or that carry no numbers): the
    parameters of the path's own functions, except those it hands the kernel only where the
    kernel declares them and the twins do not (or the probe found not computed: ``missed``),
    and the arguments every model threads through. Dropout counts as computed for a family
    whose kernels have none (no ``dropout_p``: transformers passes the real kernel none either;
    ``family.dropout``). ``wiring``: the release's (:mod:`.wiring`); without it, the last one
    computed for the family (read per call, under torch.compile too: no lock on that path, a
    lock being a graph break there; the one dict read is atomic)."""
    family = families.FA2 if family is None else family
    if wiring is None:
        found = _computed.get(family.name)
        return found if found is not None else _NONE
    with _lock:
        twin = families.twins_for(family)[families.VARLEN]
        declared = transformers_wiring._named_parameters(twin)
        dropped = {
            arg
            for arg, names in wiring.conditional
            if arg in (missed or set())
            or not (
                any(n in declared for n in names) or (not family.dropout and "dropout_p" in names)
            )
        }
        known = (_registry_parameters() | set(wiring.path_parameters) | _typed_kwargs()) - dropped
        _computed[family.name] = frozenset(known)
        return _computed[family.name]


def named_uncomputed(caller: type) -> frozenset[str] | None:
    """The arguments outside :func:`computed_arguments` (of any family whose twins serve here:
    each call is then checked against its own family's) that ``caller`` (an attention class)
    passes the attention function by name in its own code; None where that code is not
    readable (or names nothing: then every argument counts)."""
    from . import routing

    named = routing.attention_keywords(caller)
    sets = list(_computed.values()) or [computed_arguments()]
    return frozenset(named - frozenset.intersection(*sets)) if named else None


def uncomputed(
    kwargs: dict[str, Any],
    among: frozenset[str] | None = None,
    known: frozenset[str] | None = None,
) -> list[str]:
    """The arguments of this flash registry call that the flash path on the twins would drop:
    not among :func:`computed_arguments`, with a value that can carry numbers (not None, not a
    bool flag), and (unless ``among`` is None) among ``among``: those the calling attention
    class names itself (an argument its model's forward only threads through ``**kwargs``, such
    as a vision tower's ``grid_thw``, is dropped by every attention implementation alike).
    ``known``: the arguments computed (flash-attn 2's twins' where None)."""
    known = computed_arguments() if known is None else known
    return sorted(
        k
        for k, v in kwargs.items()
        if k not in known
        and (among is None or k in among)
        and v is not None
        and not isinstance(v, bool)
    )


_KERNEL_MODULES = {
    "flash_attention_2": "flash_attn",
    "flash_attention_3": "flash_attn_interface",
    "flash_attention_4": "flash_attn.cute",
}


def unguarded_error(implementation: str, query: Any, key: Any, value: Any) -> BaseException:
    """The error this call meets in transformers' flash path without attnguard, where the
    kernel cannot run here: the kernel package's import error (flash-attn missing or broken), or
    the kernel's own error on these tensors (no CUDA, an old GPU, CPU tensors). Nothing is
    fetched from the hub and no shared cache is touched."""
    import importlib

    name = _KERNEL_MODULES.get(implementation.split("|", 1)[-1], "flash_attn")
    try:
        package = importlib.import_module(name)
        kernel = getattr(package, FUNC)
    except Exception as exc:
        return exc
    kernel = getattr(kernel, "__attnguard_original__", kernel)
    try:
        kernel(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2))
    except Exception as exc:
        return exc
    return RuntimeError(f"{implementation}'s kernel ran here although attnguard found it unusable")


# --- model modules that import the flash path only where a flash-attn was there --------------------

_bound: dict[str, tuple[str, ...]] = {}


def _code_names(code: Any, out: set[str]) -> None:
    out.update(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            _code_names(const, out)


def _names_read(module: ModuleType) -> set[str]:
    """The global names the functions and methods defined in ``module`` read."""
    names: set[str] = set()
    owner = module.__name__
    for obj in list(vars(module).values()):
        if getattr(obj, "__module__", None) != owner:
            continue
        members = list(vars(obj).values()) if isinstance(obj, type) else [obj]
        for member in members:
            fn = getattr(member, "__func__", member)  # staticmethod / classmethod
            code = getattr(_unwrap(fn), "__code__", None)
            if code is not None:
                _code_names(code, names)
    return names


def _unwrap(fn: Any) -> Any:
    try:
        return inspect.unwrap(fn)
    except ValueError:
        return fn


def bind_flash_globals(model_class: type) -> tuple[str, ...]:
    """The names the module of ``model_class`` reads from transformers' flash path module but
    never bound (it imports them only where a flash-attn was available when it was imported, as
    Falcon's and GPT-Neo's ``_flash_attention_forward``): bound now to the flash path's own
    objects, so the model's flash code runs (on the twins, when they serve) instead of failing
    with a NameError at its first forward. Restored at unpatch. Returns the names bound."""
    import builtins

    flash = sys.modules.get(MODULE)
    name = getattr(model_class, "__module__", "")
    module = sys.modules.get(name)
    if flash is None or module is None or module is flash:
        return ()
    with _lock:
        if name in _bound:
            return _bound[name]
        missing = tuple(
            sorted(
                n
                for n in _names_read(module)
                if n not in vars(module)
                and not hasattr(builtins, n)
                and callable(vars(flash).get(n))
            )
        )
        for n in missing:
            value = vars(flash)[n]
            ledger.patch(module, n, lambda _o, _v=value: _v)
        _bound[name] = missing
        return missing


def unpatch() -> None:
    """Forget what was read, and unbind the names bound in model modules."""
    ledger.unpatch_all()
    with _lock:
        _bound.clear()
        _computed.clear()


# Which flash registry keys the twins serve, and the keyword arguments their flash path computes
# there, is the table of what computes now (``NOW.twin_arguments``, set by the integration that
# hands the twins over): a call with another argument that can carry numbers takes the slow path,
# where it is never dropped silently.
# attention module type -> the arguments outside NOW.twin_arguments its own code passes the flash
# entry by name (its other keywords are threaded through **kwargs, which every implementation
# drops alike); ANY where its code is not readable. Judged at load (or at its first eager call).
TWIN_ASIDE: dict[type, frozenset[str]] = {}
ANY = "*"


def carries_numbers(
    kwargs: dict[str, Any], known: frozenset[str], only: frozenset[str] | None = None
) -> bool:
    """An argument outside ``known`` (and, unless ``only`` holds ANY, among ``only``) that can
    carry numbers (not None, not a bool flag)."""
    among = None if only is None or ANY in only else only
    return any(
        k not in known
        and (among is None or k in among)
        and v is not None
        and v is not True
        and v is not False
        for k, v in kwargs.items()
    )


def uncomputed_error(
    entry: callguard.Entry, site: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> BaseException | None:
    """A flash registry call on the twins that passes an argument the twins would not compute
    (transformers' flash path would drop it for a kernel without it): never dropped. Returns the
    error the call meets without attnguard (to raise), after one event naming the argument;
    None when every argument is computed (also where the twins do not serve this entry)."""
    known = NOW.twin_arguments.get(entry.name)
    if known is None:
        return None
    aside = judge(type(args[0])) if args else frozenset({ANY})
    names = uncomputed(kwargs, None if ANY in aside else aside, known)
    if not names or len(args) < 4:
        return None
    error = unguarded_error(entry.name, args[1], args[2], args[3])
    callguard.note(
        "observed",
        site,
        "flash_argument_uncomputed",
        f"{entry.name} call passes {', '.join(names)}, which attnguard's twins of the "
        "flash-attn kernels do not compute (transformers' flash path hands a kernel only the "
        "arguments its signature declares and drops the rest); left as is: the call fails with "
        f"{entry.name}'s own error ({type(error).__name__})",
        requested=entry.name,
        arguments=names,
    )
    return error


def judge(caller: type) -> frozenset[str]:
    """The arguments outside NOW.twin_arguments that attention class ``caller`` passes by name (ANY
    where its code is not readable), remembered for its calls (:data:`TWIN_ASIDE`)."""
    found = TWIN_ASIDE.get(caller)
    if found is None:
        named = named_uncomputed(caller)
        found = TWIN_ASIDE[caller] = frozenset({ANY}) if named is None else named
    return found


def judge_model(model: Any) -> None:
    """Judge the classes of ``model``'s modules now (at load), so that its calls are checked
    without reading any source, under ``torch.compile`` too."""
    for kind in {type(m) for m in model.modules()}:
        if not kind.__module__.startswith("torch."):
            judge(kind)
