"""Per-call guard on every entry of transformers' attention registry.

The registry is ``ALL_ATTENTION_FUNCTIONS``: a plain dict on 4.49-4.50, an ``AttentionInterface``
from 4.51 whose class-wide ``_global_mapping`` every instance reads. Models look the function up
at each forward, so replacing the entries guards live models too. Each entry becomes a plain
closure from :func:`wrap_registry_entry` (a wrapt proxy there breaks
torch.compile). ``AttentionInterface.register`` is wrapped as well, so entries registered later
(hub kernels, user functions) are guarded. Unpatch puts back exactly what was there, unless
someone replaced our entry since.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

from ... import callguard, kernel_identity, runtime
from ...computing import NOW, subject
from ...fallback.registry import all_sdpa_backends, flash_call_on_sdpa
from ...kernel_identity import DROPOUT_FAMILIES, Family, KernelId
from ...kernels import EntryKind
from ...observability import events
from ..ledger import Ledger
from . import arguments, twin_calls
from .interface import registry_mapping

# the registry's dict entries and AttentionInterface.register
ledger = Ledger("transformers_attention")

Tensor = torch.Tensor
_BOOL = torch.bool
_FP32 = torch.float32


# transformers' own registry functions, known by the object itself (module, attribute)
_FLASH_FUNCTION = ("transformers.integrations.flash_attention", "flash_attention_forward")
_SDPA_FUNCTION = ("transformers.integrations.sdpa_attention", "sdpa_attention_forward")
# transformers' paged functions update the cache inside: never re-run or rerouted
_PAGED_MODULES = frozenset(
    f"transformers.integrations.{m}" for m in ("flash_paged", "sdpa_paged", "eager_paged")
)


def _is(fn: Any, where: tuple[str, str]) -> bool:
    return fn is not None and getattr(sys.modules.get(where[0]), where[1], None) is fn


def identity(name: str) -> KernelId | None:
    """What the kernel behind registry key ``name`` is: the verdict recorded when it loaded (a hub
    kernel, known by the functions it exports), else what its whole name says."""
    found = NOW.get(subject("transformers", name))
    return found.requested if found is not None else kernel_identity.of_request(name)


def registry_kind(name: str, fn: Any) -> EntryKind | None:
    """How the guard treats registry entry ``name`` holding ``fn``, from what ``fn`` is (never
    from a piece of ``name``): transformers' flash code path (flash rules, with the twins of the
    family of the kernel behind ``name``), its sdpa function (sdpa rules), a paged function
    (dtypes and devices only, never re-run), any other function (dtypes and devices only); None:
    left untouched — a hub kernel's own attention function, or transformers' flash code path
    over a kernel whose semantics attnguard does not know (its own calls, its own errors)."""
    fn = getattr(fn, "__attnguard_original__", fn)
    if _is(fn, _FLASH_FUNCTION):
        kernel = identity(name)
        if kernel is not None and kernel.family is Family.PAGED:
            return EntryKind.REGISTRY_PAGED
        return EntryKind.REGISTRY_FLASH if kernel is None or kernel.flash else None
    if _is(fn, _SDPA_FUNCTION):
        return EntryKind.REGISTRY_SDPA
    if getattr(fn, "__module__", None) in _PAGED_MODULES or kernel_identity.bare(name) != name:
        return EntryKind.REGISTRY_PAGED
    if kernel_identity.hub_repo(name) is not None:
        return None  # a hub kernel's own attention function: untouched
    return EntryKind.REGISTRY_OTHER


def _registry_entry(name: str, original: Callable[..., Any], kind: EntryKind) -> callguard.Entry:
    twin: Callable[..., Any] | None = None
    known = identity(name)
    family = known.family if known is not None else None
    if kind == EntryKind.REGISTRY_SDPA:
        family = Family.SDPA  # transformers' own sdpa function, under whatever key
    elif kind != EntryKind.REGISTRY_FLASH and family is not Family.PAGED:
        family = None  # a function of its own under a known name: its own semantics
    if kind == EntryKind.REGISTRY_FLASH:
        dropout = known is None or known.family in DROPOUT_FAMILIES
        twin = _registry_flash_twin if dropout else _registry_flash_twin_no_dropout
    elif kind == EntryKind.REGISTRY_SDPA:
        twin = functools.partial(_sdpa_every_backend, original)
    # (module, query, key, value, attention_mask, ...): the registry's calling convention
    positions = {"query": 1, "key": 2, "value": 3, "attention_mask": 4}
    return callguard.Entry(
        name,
        kind,
        original,
        tensors=("query", "key", "value"),
        twin=twin,
        mask="attention_mask",
        positions=positions,
        in_force=runtime.IN_FORCE,
        site_for=functools.partial(registry_site, name),
        uncomputed=arguments.uncomputed_error if kind == EntryKind.REGISTRY_FLASH else None,
        left_alone=_stepped_aside if kind == EntryKind.REGISTRY_FLASH else None,
        family=family,
    )


def _registry_flash_twin(
    module: Any, query: Any, key: Any, value: Any, *rest: Any, **kw: Any
) -> Any:
    mask = rest[0] if rest else kw.pop("attention_mask", None)
    return flash_call_on_sdpa(module, query, key, value, mask, rest, kw, window=_flash_window(kw))


def _registry_flash_twin_no_dropout(
    module: Any, query: Any, key: Any, value: Any, *rest: Any, **kw: Any
) -> Any:
    """The flash registry entry's twin for a family without dropout (flash-attn 3 and 4 take no
    ``dropout_p``: transformers' flash path never hands them the model's dropout)."""
    mask = rest[0] if rest else kw.pop("attention_mask", None)
    kw.pop("dropout", None)
    rest = rest[:1]  # (attention_mask,): a positional dropout is dropped, as the path drops it
    return flash_call_on_sdpa(module, query, key, value, mask, rest, kw, window=_flash_window(kw))


def _flash_window(kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """The flash ``window_size`` this release's flash path makes of ``sliding_window``; where
    attnguard does not know it, the window of transformers' eager path (keys ``i - j < w``), what
    the flash path's own warning for these calls recommends."""
    w = kwargs.get("sliding_window")
    if not isinstance(w, int) or w <= 0:
        return None
    from . import flash_path

    return flash_path.flash_window(w) or (w - 1, w - 1)


def _sdpa_every_backend(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """transformers' sdpa entry with every SDPA backend allowed again (after "No available
    kernel" under a narrower ``sdpa_kernel`` context): the dispatcher still picks the fastest."""
    with all_sdpa_backends():
        return original(*args, **kwargs)


def _stepped_aside(entry: callguard.Entry, args: tuple[Any, ...]) -> None:
    """A flash registry call failed where attnguard left transformers' flash path alone because
    it does not recognise it: say so once (the error itself is the caller's, unchanged)."""
    try:
        if events.is_compiling():
            return
        from . import flash_path

        why = flash_path.stepped_aside(entry.name)
        if why:
            events.emit(
                "observed",
                site=registry_site(entry.name, args),
                reason_code="flash_path_unrecognised",
                reason=f"{entry.name} call failed; left as is: {why}",
                requested=entry.name,
            )
    except Exception as exc:
        from ...failopen import report_internal_error

        report_internal_error(f"transformers.{entry.name}", exc)


def registry_site(name: str, args: tuple[Any, ...]) -> str:
    return f"transformers.{name}:{type(args[0]).__name__ if args else '?'}"


def wrap_registry_entry(
    name: str, original: Callable[..., Any], kind: EntryKind | None = None
) -> Callable[..., Any]:
    """A guarded closure for one attention-registry function (signature preserved).

    Registry functions are called ``fn(module, query, key, value, attention_mask, ...)``. The
    check is inlined (a helper call would cost as much as a check); devices compare as
    ``get_device()`` integers, cheaper than ``torch.device`` objects.
    """
    entry = _registry_entry(name, original, kind or registry_kind(name, original) or _OTHER)
    lat = NOW.latched
    flash = entry.kind == EntryKind.REGISTRY_FLASH
    twin_arguments, aside_for = NOW.twin_arguments, arguments.TWIN_ASIDE
    watch, compiling, note_call = (
        twin_calls.WATCH,
        twin_calls._is_compiling,
        twin_calls.note_registry_call,
    )

    def check(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if len(args) < 4:
            return False  # not a registry-shaped call: leave it alone
        query, key, value = args[1], args[2], args[3]
        dt = query.dtype
        dev = query.get_device()
        mask = args[4] if len(args) > 4 else kwargs.get("attention_mask")
        # on the twins: what reaches them (the exit summary's advice), calls remedied below too
        on_twins = flash and watch[0] and twin_arguments and twin_arguments.get(name) is not None
        if on_twins and not compiling():
            note_call(mask, kwargs)
        if key.dtype is not dt or value.dtype is not dt:
            return True
        if key.get_device() != dev or value.get_device() != dev:
            return True
        if lat and (name, type(args[0])) in lat:
            return True
        if flash:
            known = twin_arguments.get(name) if twin_arguments else None
            if known is not None and not known.issuperset(kwargs):
                aside = aside_for.get(type(args[0]))
                if aside is None:  # not judged yet: the slow path judges (never in a trace)
                    if not events.is_compiling() and arguments.carries_numbers(kwargs, known):
                        return True
                elif aside and arguments.carries_numbers(kwargs, known, aside):
                    return True
            return (
                mask is not None
                and (mask.get_device() != dev or mask.dim() == 4)
                or bool(kwargs.get("output_attentions"))
            )
        if mask is None or not isinstance(mask, Tensor):
            return False
        md = mask.dtype
        return mask.get_device() != dev or (
            md is not dt and md is not _BOOL and md is not _FP32 and md.is_floating_point
        )

    return callguard.guard(entry, check)


def _is_guarded(fn: Any) -> bool:
    return getattr(fn, "__attnguard_original__", None) is not None


_OTHER = EntryKind.REGISTRY_OTHER


def _guard_entry(mapping: dict[str, Any], key: str) -> None:
    fn = mapping.get(key)
    if not callable(fn) or _is_guarded(fn):
        return
    kind = registry_kind(key, fn)
    if kind is None:
        return  # what it is says: untouched
    ledger.patch_item(mapping, key, lambda original: wrap_registry_entry(key, original, kind))


def reidentify(modeling_utils: ModuleType, key: str) -> None:
    """The kernel behind registry key ``key`` is known now (a hub kernel loaded: the verdict
    recorded says what it is): guard its entry by what it is, or give it back untouched."""
    mapping = registry_mapping(modeling_utils)
    fn = mapping.get(key) if mapping is not None else None
    if fn is None:
        return
    original = getattr(fn, "__attnguard_original__", fn)
    if registry_kind(key, original) is None:
        if original is not fn:
            mapping[key] = original  # untouched (the ledger skips an entry no longer ours)
        return
    if original is not fn:
        mapping[key] = original
    _guard_entry(mapping, key)


def patch(modeling_utils: ModuleType) -> None:
    """Guard every registry entry, and entries registered from now on."""
    mapping = registry_mapping(modeling_utils)
    if mapping is None:
        return
    for key in list(mapping):
        _guard_entry(mapping, key)
    interface = getattr(modeling_utils, "AttentionInterface", None)
    if interface is not None and hasattr(interface, "register"):
        ledger.patch(interface, "register", _make_register)


def _make_register(original: Any) -> Any:
    # A classmethod from the class's own __dict__, or the inherited one bound to the class.
    func = getattr(original, "__func__", original)

    @functools.wraps(func)
    def register(cls: Any, key: str, value: Any) -> Any:
        result = func(cls, key, value)
        try:
            mapping = getattr(cls, "_global_mapping", None)
            if isinstance(mapping, dict) and mapping.get(key) is value:
                _guard_entry(mapping, key)
        except Exception as exc:  # never break a registration
            from ...failopen import report_internal_error

            report_internal_error("transformers.AttentionInterface.register", exc)
        return result

    return classmethod(register)


def unpatch() -> None:
    """Restore every original entry that still holds our wrapper; unwrap ``register``."""
    ledger.unpatch_all()
    callguard.reset_latches()
