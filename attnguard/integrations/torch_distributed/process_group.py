"""torch.distributed's ``init_process_group`` and ``destroy_process_group``, seen by the exit
summary (patched when ``torch.distributed`` is imported, whatever the integrations allowed).

Most training scripts end with ``dist.destroy_process_group()``: the group's store, through
which each rank's record reaches rank 0 at exit, is gone by then. So when the default group is
made, and just before it is destroyed, the store is kept (:mod:`attnguard.observability.jobstore`), a rank
whose events came before the group announces them, and a rank ending its group posts its record
as it stands (:func:`attnguard.observability.summary.on_group_end`) unless its exit record is
there already (``attnguard.finish()`` came first). Nothing here is a collective, changes
the call's arguments or result, or raises: the original runs whatever happens in ours.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

from ..ledger import Ledger

ledger = Ledger("torch_distributed")


def _default_group(c10d: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``destroy_process_group(*args, **kwargs)`` destroys the default group."""
    group = args[0] if args else kwargs.get("group")
    if group is None:
        return True
    try:
        return group is c10d.GroupMember.WORLD or group is c10d._get_default_group()
    except Exception:
        return False


def _wrap_init(original: Any) -> Any:
    if getattr(original, "__attnguard_original__", None) is not None:
        return original

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            from ...observability.summary import on_group_start

            on_group_start()  # never raises
        except Exception:
            pass
        return result

    init_process_group.__attnguard_original__ = original  # type: ignore[attr-defined]
    return init_process_group


def _wrap_destroy(original: Any, c10d: Any) -> Any:
    if getattr(original, "__attnguard_original__", None) is not None:
        return original

    @functools.wraps(original)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            if _default_group(c10d, args, kwargs):
                from ...observability.summary import on_group_end

                on_group_end()  # never raises
        except Exception:
            pass
        return original(*args, **kwargs)

    destroy_process_group.__attnguard_original__ = original  # type: ignore[attr-defined]
    return destroy_process_group


def patch(module: ModuleType) -> None:
    """Wrap both functions on ``torch.distributed`` and ``torch.distributed.distributed_c10d``
    (the same functions, reachable under both names)."""
    c10d = getattr(module, "distributed_c10d", None)
    if c10d is None:
        return  # a torch built without distributed support
    made: dict[int, Any] = {}
    for name, wrap in (
        ("init_process_group", _wrap_init),
        ("destroy_process_group", lambda fn: _wrap_destroy(fn, c10d)),
    ):
        for owner in (c10d, module):
            original = getattr(owner, name, None)
            if not callable(original):
                continue

            def make(orig: Any, _wrap: Any = wrap) -> Any:
                wrapper = made.get(id(orig))
                if wrapper is None:
                    wrapper = made[id(orig)] = _wrap(orig)
                return wrapper

            ledger.patch(owner, name, make)


def unpatch() -> None:
    """Restore the originals."""
    ledger.unpatch_all()
