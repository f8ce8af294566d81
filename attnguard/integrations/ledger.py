"""The patch ledger every integration records its patches in, and the check of a library's entry
point against the twin that stands for it (its signature), shared by the integrations.

A :class:`Ledger` records (owner, attribute or dict key, original, wrapper) for each patch and
undoes only what is still ours: if someone patched the same attribute after us, we leave their
object in place rather than clobbering it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..observability import events

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


def unrecognised_entry(site: str, original: Any, twin: Any) -> bool:
    """True, after one ``observed`` event, when ``original`` is not shaped as ``twin`` takes it:
    that entry point stays as the library wrote it."""
    original = getattr(original, "__attnguard_original__", original)
    why = signature_unrecognised(original, twin)
    if why is None:
        return False
    events.emit(
        "observed",
        site=site,
        reason_code="signature_unrecognised",
        reason=f"{site}: {why}; left unguarded (attnguard does not guess at a function it has "
        "not seen)",
    )
    return True
