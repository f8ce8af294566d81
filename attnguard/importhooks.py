"""Code that runs when a module is imported: before its own code (the start-up hook's deferred
activation) and after it (each integration's patch), through one finder on ``sys.meta_path``.

The rule this module exists for: **no import, no activation and no lock wait inside a finder's
``find_spec``.** Python calls ``find_spec`` while it holds its global import lock (and the
module's own lock). Anything done there that imports, or waits for another module's lock,
deadlocks against a thread that is importing at the same moment: it holds that module's lock
and needs the global one for its next import. (``importlib.util.find_spec`` of a submodule
waits for the parent package's lock; wrapt's post-import hook finder calls it, and so did an
activation run from ``find_spec``: a worker thread's ``import asyncio``, or a second thread's
``import transformers.modeling_utils``, hung the program.)

So :class:`ImportWatcher.find_spec` only reads two dicts and asks the finders behind it on
``sys.meta_path`` for the spec, with the very ``path`` and ``target`` Python gave it; when a
watched module is found, its loader is wrapped. The work runs in the wrapped loader, where
Python holds only that module's lock (per module, with deadlock detection) and other threads
import freely: the callbacks due before the module's code (:func:`call_before`) in
``create_module``, before the module is in ``sys.modules``; the post-import hooks
(:func:`register_post_import_hook`) in ``exec_module``, after the module's code. Module objects keep the real loader (``__loader__``,
``__spec__.loader``).

A module whose import began before this finder was there (another thread is running its code
while attnguard activates) cannot be followed through its loader: it is in ``sys.modules``, not
yet whole. Its spec is followed instead (:func:`_follow`): Python marks a spec
``_initializing`` while the module's code runs and clears the mark in that importing thread once
the module is in place, still holding the module's lock; the hooks run there, then, before any
other thread can get the module. Nobody waits for anybody.

Standard library only (``sys`` and ``_thread``): the start-up hook imports it in every guarded
process.
"""

from __future__ import annotations

import sys
from _thread import RLock, get_ident

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from types import ModuleType
    from typing import Any

# Module name -> callbacks to run once, before that module's code runs (then dropped).
_before: dict[str, list[Callable[[], None]]] = {}
# Module name -> hooks to run once, after the module was imported (then dropped).
_after: dict[str, list[Callable[[ModuleType], None]]] = {}
# Modules whose code a wrapped loader is running now: a hook registered meanwhile waits for
# the end of that run (the module is in sys.modules, but not yet whole).
_executing: dict[str, int] = {}
# (thread, module) pairs being looked up: a finder behind ours that re-enters the import
# system for the same name finds the plain spec, not ours again.
_finding: set[tuple[int, str]] = set()
# Guards registration against a loader finishing the same module. Taken by registration and
# by exec_module, never by find_spec, and nothing is called while it is held. Re-entrant: a
# signal handler runs in the main thread between any two of its bytecodes, also while it holds
# this lock, and an import there (of a watched module) takes it again; every section under it
# is a few dict operations that stand such an interleaving.
_lock = RLock()


class ImportWatcher:
    """The finder: first on ``sys.meta_path`` once anything is registered."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        meta = sys.meta_path
        if meta and meta[0] is not self:
            _to_front(self, meta)
        if fullname not in _before and fullname not in _after:
            return None  # dict reads: no lock, nothing imported
        key = (get_ident(), fullname)
        if key in _finding:
            return None
        _finding.add(key)
        try:
            spec = _find_behind(self, fullname, path, target)
        except Exception:
            return None  # Python asks the finders itself: the same answer, or the same error
        finally:
            _finding.discard(key)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec  # nothing to wrap (a namespace package): imported as without us
        if not isinstance(loader, _HookedLoader):
            spec.loader = _HookedLoader(loader, fullname)
        return spec


def _to_front(watcher: ImportWatcher, meta: list[Any]) -> None:
    """Put the finder first again: another finder inserted in front of it since (typeguard's
    import hook, a plugin's) would take a watched module past it, unpatched. Ours asks the
    finders behind it in their order, so theirs still finds, loads and transforms that module.
    Python may be iterating ``meta`` now: removing ours from behind the one asked and inserting
    it at the front moves only what comes before it, so the iteration goes on at the finder
    after ours as before (no lock, nothing imported)."""
    try:
        meta.remove(watcher)
    except ValueError:
        return  # another thread moved it a moment ago
    meta.insert(0, watcher)


def _find_behind(watcher: ImportWatcher, fullname: str, path: Any, target: Any) -> Any:
    """The spec the finders other than ours give, asked in order as Python asks them."""
    for finder in list(sys.meta_path):
        if finder is watcher or isinstance(finder, ImportWatcher):
            continue
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        spec = find(fullname, path, target)
        if spec is not None:
            return spec
    return None


class _HookedLoader:
    """A module's own loader, with the callbacks before and the hooks after its code."""

    def __init__(self, loader: Any, name: str) -> None:
        self.loader = loader
        self.name = name

    def __getattr__(self, attr: str) -> Any:
        if attr == "loader":  # not set yet (a copy being made): no recursion
            raise AttributeError(attr)
        return getattr(self.loader, attr)  # get_code, is_package, get_resource_reader, ...

    def create_module(self, spec: Any) -> Any:
        # The callbacks due before the module's code run here, before the module is in
        # sys.modules: a thread importing one of its submodules meanwhile waits for the whole
        # package, as it would for a package that is slow to import, instead of running the
        # submodule against a package whose code has not started yet.
        with _lock:
            before = _before.pop(self.name, ())
        for callback in before:
            try:
                callback()
            except Exception:
                pass  # the module imports as without us (callbacks report their own errors)
        create = getattr(self.loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: ModuleType) -> None:
        _give_back_loader(module, self)
        with _lock:
            _executing[self.name] = _executing.get(self.name, 0) + 1
        try:
            self.loader.exec_module(module)
        except BaseException:
            with _lock:
                _end_run(self.name)
            raise  # the import fails as it would; hooks stay for a later import
        with _lock:
            _end_run(self.name)
            hooks = _after.pop(self.name, ())
        imported = sys.modules.get(self.name, module)  # what the importer gets (may replace itself)
        for hook in hooks:
            try:
                hook(imported)
            except Exception:
                pass  # the import stands (hooks report their own errors)


def _end_run(name: str) -> None:
    left = _executing.get(name, 1) - 1
    if left:
        _executing[name] = left
    else:
        _executing.pop(name, None)


def _give_back_loader(module: ModuleType, hooked: _HookedLoader) -> None:
    """The module and its spec name the real loader (what reloads, resources and inspection
    expect)."""
    if getattr(module, "__loader__", None) is hooked:
        try:
            module.__loader__ = hooked.loader
        except (AttributeError, TypeError):
            pass
    spec = getattr(module, "__spec__", None)
    if spec is not None and getattr(spec, "loader", None) is hooked:
        try:
            spec.loader = hooked.loader
        except (AttributeError, TypeError):
            pass


_watcher: ImportWatcher | None = None


def _install() -> None:
    """Put the finder first on ``sys.meta_path`` (once; again if something removed it or put
    another finder in front of it). Called with ``_lock`` held."""
    global _watcher
    if _watcher is None:
        _watcher = ImportWatcher()
    if _watcher not in sys.meta_path:
        sys.meta_path.insert(0, _watcher)
    elif sys.meta_path[0] is not _watcher:
        _to_front(_watcher, sys.meta_path)


def call_before(names: Iterable[str], callback: Callable[[], None]) -> None:
    """Run ``callback`` when one of ``names`` is imported, before that module's code runs (once
    per name; :func:`cancel_before` drops it from every name)."""
    with _lock:
        _install()
        for name in names:
            _before.setdefault(name, []).append(callback)


def cancel_before(callback: Callable[[], None]) -> None:
    with _lock:
        for name in list(_before):
            left = [c for c in _before.get(name, ()) if c is not callback]
            if left:
                _before[name] = left
            else:
                _before.pop(name, None)


def _initializing(module: object) -> bool:
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


_followed_kinds: dict[type, type] = {}


def _followed_kind(kind: type) -> type:
    """``kind`` (a spec's class) whose ``_initializing`` mark, when cleared, runs the hooks."""
    followed = _followed_kinds.get(kind)
    if followed is None:

        def get(spec: Any) -> Any:
            return spec.__dict__.get("_initializing", False)

        def set_(spec: Any, value: Any) -> None:
            if not value and spec.__dict__.get("_initializing"):
                _import_ended(spec)  # before the mark clears: other threads still wait
            spec.__dict__["_initializing"] = value
            if not value:
                spec.__class__ = kind

        followed = type(kind.__name__, (kind,), {"_initializing": property(get, set_)})
        _followed_kinds[kind] = followed
    return followed


def _follow(module: object) -> bool:
    """Have the hooks of a module whose code is running now (its import began before this
    finder was there) run when its import ends, in the importing thread. False when it cannot
    be followed, or has ended meanwhile. Called with ``_lock`` held."""
    spec = getattr(module, "__spec__", None)
    try:
        kind = type(spec)
        spec.__class__ = _followed_kind(kind)
    except Exception:
        return False  # not a class that can be followed
    if spec.__dict__.get("_initializing"):
        return True  # the end, when it comes, waits for _lock, then finds the hooks
    spec.__class__ = kind  # ended before we followed it: the module is whole
    return False


def _import_ended(spec: Any) -> None:
    """The import of ``spec.name`` ends (in the importing thread): run its hooks if it
    succeeded; after a failure they stay for a later import (through the finder)."""
    name = getattr(spec, "name", None)
    module = sys.modules.get(name) if isinstance(name, str) else None
    if module is None:
        return  # the import failed (Python took the module out again)
    with _lock:
        hooks = _after.pop(name, ())
    for hook in hooks:
        try:
            hook(module)
        except Exception:
            pass  # the import stands (hooks report their own errors)


def register_post_import_hook(
    hook: Callable[[ModuleType], None],
    name: str,
    cannot_follow: Callable[[ModuleType], None] | None = None,
) -> None:
    """Run ``hook(module)`` once module ``name`` is imported: now when it already is, else at
    the end of its import (also when that import has begun but its code is still running, in
    this thread or another, through the finder or before it was there).

    A module still being imported that cannot be followed (a spec of a kind whose class cannot
    be switched): ``cannot_follow(module)`` instead, and ``hook`` at a later import of it.
    """
    with _lock:
        module = sys.modules.get(name)
        if module is None or name in _executing:
            _install()
            _after.setdefault(name, []).append(hook)
            return
        unfollowed = False
        if _initializing(module):
            _install()
            _after.setdefault(name, []).append(hook)
            if _follow(module):
                return
            unfollowed = _initializing(module)
            if not unfollowed:
                hooks = _after.get(name, [])
                if hook not in hooks:
                    return  # ran meanwhile, at the end of its import
                hooks.remove(hook)  # ended meanwhile: whole now, the hook runs below
    if not unfollowed:
        hook(module)  # outside the lock: a hook imports
    elif cannot_follow is not None:
        cannot_follow(module)
