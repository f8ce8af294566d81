"""What reaches attnguard's twins of transformers' flash path, and what the model classes of flash
requests support, recorded for the exit summary's advice
(:mod:`attnguard.observability.workload`): packed rows (and whether transformers' own sdpa path
would have held them apart), sliding windows, and which backends each class accepts, so the advice
never sends a job where transformers would compute other numbers or refuse the model.

Nothing is read from a tensor. A sliding window is a keyword of the registry call. Packed rows
are what transformers' flash path itself found: it calls ``flash_attn_varlen_func`` for a
registry call without an attention mask only for packed rows (``position_ids`` restarting, read by
its own ``_is_packed_sequence``, or ``cu_seq_lens_*`` given); with a mask it unpads a padded
batch instead. So the registry entry, while the twins serve it, marks whether the call on this
thread came without a mask, and the varlen twin handed to the flash path reads the mark.

Whether transformers' sdpa path would have held those rows apart is what transformers' own mask
code decided for the same forward, recognised by the shape of ``transformers.masking_utils``
(4.53 and later): ``_preprocess_mask_arguments``, called once per mask a forward builds, looks
for packed sequences (``find_packed_sequence_indices(position_ids)``) only where no cache is in
use; finding some, every mask it builds (sdpa's, eager's) holds them apart. :func:`watch_masks`
wraps both: the first notes that a mask is being built (and whether with a cache, for the words),
the second which ``position_ids`` it found packed. A varlen call whose registry call got those
same ``position_ids`` came in a forward whose sdpa path would hold its rows apart; any other one
(a cache in use, a release without that code, rows given only by ``cu_seq_lens``, position ids
the model derived itself) would be mixed by transformers' sdpa path.

Nothing here records inside a ``torch.compile`` trace, nor once everything is known.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch

from ...observability import workload
from ..ledger import Ledger

_is_compiling = torch.compiler.is_compiling
# .maskless: the registry call on this thread came without a mask; .apart: with the position_ids
# the forward's mask code found packed (sdpa holds them apart); .cached: a cache was in use
_call = threading.local()
# .packed: the position_ids the last mask built on this thread found packed (None: none);
# .cached: the position_ids of a mask built with a cache (None: none)
_mask = threading.local()
WATCH = [True]  # False once every fact below is known: the registry entry stops marking calls
_PACKED = (workload.PACKED_ROWS, workload.PACKED_WITH_CACHE, workload.PACKED_ROWS_APART)
MASKS = "transformers.masking_utils"
_PREPARE = "_preprocess_mask_arguments"
_FIND = "find_packed_sequence_indices"


def note_registry_call(mask: Any, kwargs: dict[str, Any]) -> None:
    """A flash registry call the twins serve (outside a compiled graph): mark whether it came
    without a mask and, if so, whether transformers' mask code found its position_ids packed
    (or built its mask with a cache); note a sliding window."""
    maskless = _call.maskless = mask is None
    if maskless:
        positions = kwargs.get("position_ids")
        found = positions is not None and positions is getattr(_mask, "packed", None)
        _call.apart = found
        _call.cached = not found and positions is not None and positions is _cached_positions()
    if not workload.seen(workload.TWIN_CALLS):
        workload.note(workload.TWIN_CALLS)
    window = kwargs.get("sliding_window")
    if type(window) is int and window > 0 and not workload.seen(workload.SLIDING_WINDOW):
        workload.note(workload.SLIDING_WINDOW)
    if all(map(workload.seen, (*_PACKED, workload.SLIDING_WINDOW))):
        WATCH[0] = False


def _cached_positions() -> Any:
    return getattr(_mask, "cached", None)


@functools.cache
def recording_varlen(twin: Callable[..., Any]) -> Callable[..., Any]:
    """``twin`` (the varlen twin as transformers' flash path gets it), noting packed rows."""

    @functools.wraps(twin)
    def flash_attn_varlen_func(*args: Any, **kwargs: Any) -> Any:
        if WATCH[0] and not _is_compiling() and getattr(_call, "maskless", False):
            _note_packed()
        return twin(*args, **kwargs)

    return flash_attn_varlen_func


def _note_packed() -> None:
    if getattr(_call, "apart", False):
        workload.note(workload.PACKED_ROWS_APART)
        return
    workload.note(workload.PACKED_ROWS)
    if getattr(_call, "cached", False):
        workload.note(workload.PACKED_WITH_CACHE)


# --- transformers' mask code: would its sdpa path hold packed rows apart? -----------------------


def watch_masks(module: ModuleType | None, ledger: Ledger) -> None:
    """Wrap the mask code of ``module`` (``transformers.masking_utils``) where it is shaped as
    described above; a release shaped otherwise is not watched (its sdpa path is then taken to
    mix packed rows: the advice keeps the flash request)."""
    prepare = getattr(module, _PREPARE, None)
    find = getattr(module, _FIND, None)
    code = getattr(prepare, "__code__", None)
    if not (callable(find) and code is not None and _FIND in code.co_names):
        return
    try:
        params = list(inspect.signature(prepare).parameters)
    except (TypeError, ValueError):
        return
    cache_at = next((i for i, p in enumerate(params) if p in ("cache", "past_key_values")), None)
    positions_at = params.index("position_ids") if "position_ids" in params else None
    if cache_at is None or positions_at is None:
        return
    ledger.patch(
        module, _PREPARE, lambda o: _preparing(o, params[cache_at], cache_at, positions_at)
    )
    ledger.patch(module, _FIND, _finding)


def _preparing(original: Callable[..., Any], cache: str, at: int, positions_at: int) -> Any:
    @functools.wraps(original)
    def _preprocess_mask_arguments(*args: Any, **kwargs: Any) -> Any:
        if not _is_compiling():
            _mask.packed = None  # a new mask: what the last one found no longer holds
            held = args[at] if len(args) > at else kwargs.get(cache)
            if held is None:
                _mask.cached = None
            elif len(args) > positions_at:
                _mask.cached = args[positions_at]
            else:
                _mask.cached = kwargs.get("position_ids")
        return original(*args, **kwargs)

    _preprocess_mask_arguments.__attnguard_original__ = original  # type: ignore[attr-defined]
    return _preprocess_mask_arguments


def _finding(original: Callable[..., Any]) -> Any:
    @functools.wraps(original)
    def find_packed_sequence_indices(position_ids: Any, *args: Any, **kwargs: Any) -> Any:
        found = original(position_ids, *args, **kwargs)
        if found is not None and not _is_compiling():
            _mask.packed = position_ids
        return found

    find_packed_sequence_indices.__attnguard_original__ = original  # type: ignore[attr-defined]
    return find_packed_sequence_indices


# --- what the model classes of flash requests support ---------------------------------------------


def _supports(cls: type, *attrs: str) -> bool:
    for attr in attrs:
        value = getattr(cls, attr, None)
        if value is not None:
            return bool(value)
    return True


def note_model(cls: type) -> None:
    """A flash request for ``cls`` (each sub-model's class passes its own gate): what it supports,
    as transformers reads it at load (``_supports_sdpa``, ``_supports_flash_attn``,
    ``_supports_flex_attn``), so the advice never names a backend the class refuses. A sub-model
    is recorded where it supports something else than the model it is built in (a vision tower
    that refuses sdpa inside a model that supports it)."""
    from .scope import models_being_built

    support = _support(cls)
    outer = [type(m) for m in models_being_built() if type(m) is not cls]
    if outer and all(_support(o) == support for o in outer):
        return  # a part that supports what its model does (LlamaModel in LlamaForCausalLM)
    sdpa, flash, flex = support
    workload.note_model(
        getattr(cls, "__name__", "?"), sdpa=sdpa, flash=flash, flex=flex, part=bool(outer)
    )


def _support(cls: type) -> tuple[bool, bool, bool]:
    return (
        _supports(cls, "_supports_sdpa"),
        _supports(cls, "_supports_flash_attn", "_supports_flash_attn_2"),
        _supports(cls, "_supports_flex_attn"),
    )


@contextmanager
def unwatched() -> Iterator[None]:
    """While open, this thread's calls are not the program's (the probe's own, on stand-ins)."""
    before = getattr(_call, "maskless", False)
    _call.maskless = False
    try:
        yield
    finally:
        _call.maskless = before


def reset() -> None:
    """Watch again (tests, after the recorded facts were forgotten)."""
    WATCH[0] = True
    _call.maskless = False
    _call.apart = _call.cached = False
    _mask.packed = _mask.cached = None
