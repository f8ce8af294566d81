"""The zoo's enumeration: one class per model type of the installed transformers that declares
flash support, found in transformers' auto mappings at run time (tests/workers/zoo.py builds
them)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable
from typing import Any

# mapping names in the order their classes stand for a model type
_FIRST = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")


@dataclasses.dataclass(frozen=True)
class Entry:
    model_type: str
    cls_name: str
    mapping: str  # the auto mapping it was found in (CAUSAL_LM, MODEL, ...)

    @property
    def cls(self) -> Any:
        import transformers

        return getattr(transformers, self.cls_name)


def entries(only: Iterable[str] | None = None) -> list[Entry]:
    """One flash-declaring class per model type, sorted by model type; ``only``: of these model
    types alone (the whole zoo imports every model's module: seconds a sample need not spend)."""
    return _enumerate(None if only is None else frozenset(only))[0]


def unimportable(only: Iterable[str] | None = None) -> dict[str, str]:
    """Model types none of whose classes could be imported here (a module that needs a package
    this environment lacks, such as torchvision): model type -> the import error, first line."""
    return _enumerate(None if only is None else frozenset(only))[1]


@functools.cache
def _enumerate(only: frozenset[str] | None) -> tuple[list[Entry], dict[str, str]]:
    import transformers
    from transformers.models.auto import modeling_auto

    names = [n for n in _FIRST if hasattr(modeling_auto, n)]
    names += sorted(
        n
        for n in dir(modeling_auto)
        if n.startswith("MODEL") and n.endswith("_MAPPING_NAMES") and n not in _FIRST
    )
    found: dict[str, Entry] = {}
    failed: dict[str, str] = {}
    for name in names:
        mapping = getattr(modeling_auto, name)
        if not isinstance(mapping, dict):
            continue
        for model_type, classes in mapping.items():
            if model_type in found or (only is not None and model_type not in only):
                continue
            for cls_name in classes if isinstance(classes, (list, tuple)) else [classes]:
                try:  # transformers' lazy module imports the model's file here
                    cls = getattr(transformers, cls_name, None)
                except Exception as exc:  # noqa: BLE001 (any import error of that file)
                    failed.setdefault(model_type, f"{cls_name}: {exc!r}".splitlines()[0][:300])
                    continue
                if cls is not None and _declares_flash(cls) and _has_forward(cls):
                    short = name.removeprefix("MODEL_FOR_").removesuffix("_MAPPING_NAMES")
                    found[model_type] = Entry(model_type, cls_name, short)
                    break
    return (
        [found[k] for k in sorted(found)],
        {k: v for k, v in sorted(failed.items()) if k not in found},
    )


def _has_forward(cls: type) -> bool:
    """Not a generation-only wrapper (whose forward is torch's unimplemented one: it takes no
    forward call, flash or not; its parts are models of their own)."""
    forward = getattr(cls, "forward", None)
    return getattr(forward, "__name__", "") != "_forward_unimplemented"


def _declares_flash(cls: type) -> bool:
    for attr in ("_supports_flash_attn", "_supports_flash_attn_2"):
        value = getattr(cls, attr, None)
        if value is not None:
            return bool(value)
    return False
