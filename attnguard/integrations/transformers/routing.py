"""Where transformers itself sends a model's flash request, and what that model hands its
attention function: what the load-time plan needs to keep the model's semantics on the twins or
step aside.

Some model classes list the flash kernels they work with (``_compatible_flash_implementations``,
transformers 5.x): a ``flash_attention_2`` request for them is rerouted by transformers' own gate
to the first one (``kernels-community/vllm-flash-attn3`` for GPT-OSS, whose attention sinks
flash-attn 2 lacks; ``MiniMaxAI/msa`` for MiniMax M3's block-sparse attention). attnguard's
twins keep such a model's semantics only where they compute every argument its attention passes:
the keywords of its calls of the attention function, read from the model's own module (its
shape, not its name). Anything else steps aside at load: the request goes to transformers as
made, and transformers' own routing (or its error) stands.
"""

from __future__ import annotations

import ast
import inspect
import sys
import threading
from typing import Any

_REGISTRY = "ALL_ATTENTION_FUNCTIONS"
_CONVENTIONAL = "attention_interface"  # the name every model file gives the looked-up function

_lock = threading.Lock()
_keywords: dict[str, frozenset[str]] = {}


def routed_to(cls: type, requested: Any) -> str | None:
    """The implementation transformers' gate would load for ``requested`` on ``cls`` instead
    (its ``_compatible_flash_implementations``, the first with builds for this device), or None
    when it keeps the request."""
    compatible = getattr(cls, "_compatible_flash_implementations", None)
    if not compatible or not isinstance(requested, str) or requested in compatible:
        return None
    if not _transformers_says_flash(requested):
        return None
    utils = sys.modules.get("transformers.modeling_utils")
    devices = getattr(utils, "FLASH_ATTN_KERNEL_DEVICES", None)
    fallback = getattr(utils, "FLASH_ATTN_KERNEL_FALLBACK", None) or {}
    device_type = getattr(utils, "get_device_type", None)
    chosen = list(compatible)
    if isinstance(devices, dict) and callable(device_type):
        try:
            device = device_type()
            chosen = [
                impl
                for impl in compatible
                if device in devices.get(fallback.get(impl, impl), (device,))
            ] or chosen
        except Exception:
            pass
    return str(chosen[0])


def _transformers_says_flash(requested: str) -> bool:
    """transformers' own answer to "is this a flash request?" (the question its gate asks before
    routing: ``is_flash_attention_requested``); False where this release has no such question
    (it routes nothing either)."""
    generic = sys.modules.get("transformers.utils.generic")
    ask = getattr(generic, "is_flash_attention_requested", None)
    if not callable(ask):
        return False
    try:
        return bool(ask(requested_attention_implementation=requested))
    except Exception:
        return False


def attention_keywords(cls: type) -> frozenset[str]:
    """The keyword names the attention classes of ``cls``'s module pass to the attention function
    they look up in transformers' registry (``**kwargs`` passed on are not named: the call-time
    check sees those). Read once per module; empty where the source is not readable."""
    name = getattr(cls, "__module__", "")
    with _lock:
        found = _keywords.get(name)
    if found is not None:
        return found
    found = frozenset()
    module = sys.modules.get(name)
    try:
        tree = ast.parse(inspect.getsource(module)) if module is not None else None
    except (OSError, TypeError, SyntaxError):
        tree = None
    if tree is not None:
        found = frozenset(_keywords_of(tree))
    with _lock:
        _keywords[name] = found
    return found


def _keywords_of(tree: ast.Module) -> set[str]:
    names = {_CONVENTIONAL}
    for node in ast.walk(tree):
        value = getattr(node, "value", None)
        if not isinstance(node, (ast.Assign, ast.AnnAssign)) or value is None:
            continue
        if any(isinstance(n, ast.Name) and n.id == _REGISTRY for n in ast.walk(value)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    keywords: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names:
            keywords.update(k.arg for k in node.keywords if k.arg is not None)
    return keywords


def uncomputed_keywords(cls: type, computed: frozenset[str]) -> list[str]:
    """The keywords ``cls``'s attention passes that the flash path on the twins does not compute
    (``computed``: :func:`.transformers_arguments.computed_arguments`)."""
    return sorted(attention_keywords(cls) - computed)
