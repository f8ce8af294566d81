"""Rotary alignment: a model whose parameters span several devices gets forward pre-hooks on its
rotary embedding modules that move ``position_ids`` / ``inv_freq`` to the device of the input
``x`` (transformers 4.49 aligns nothing; Qwen2-VL / Qwen2.5-VL lack it up to 4.57;
``position_ids`` is never moved by transformers).
"""

from __future__ import annotations

import weakref
from typing import Any

from ...observability import events

# model -> hook handles we installed on its rotary modules (removable; dies with the model)
_HOOKS: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
_MARK = "_attnguard_rotary_aligned"
ALIGN_REASON_CODE = "rotary_device_mismatch"


def model_devices(model: Any) -> set[str]:
    """Devices holding the model's parameters and buffers ("cuda:0", "cpu", "meta", ...)."""
    devices: set[str] = set()
    for tensor in list(model.parameters()) + list(model.buffers()):
        devices.add(str(tensor.device))
    return devices


def _forward_params(module: Any) -> list[str]:
    import inspect

    try:
        sig = inspect.signature(type(module).forward)
    except (TypeError, ValueError):
        return []
    return [n for n in sig.parameters if n != "self"]


def is_rotary_module(module: Any) -> bool:
    """A rotary embedding whose forward takes the hidden states and ``position_ids``.

    By class name ("Rotary") or an ``inv_freq`` buffer; vision rotaries of 4.x whose forward
    takes only a length (``forward(seqlen)``) compute on their own buffer's device: nothing to
    align there.
    """
    name = type(module).__name__
    if "rotary" not in name.lower() and not hasattr(module, "inv_freq"):
        return False
    params = _forward_params(module)
    return len(params) >= 2 and "position_ids" in params


def _target_device(module: Any, x: Any) -> Any:
    """Where the rotary computes: accelerate's execution device when the module has an
    AlignDevicesHook (it moves the inputs there right after us), else the input's device."""
    import torch

    hook = getattr(module, "_hf_hook", None)
    exec_device = getattr(hook, "execution_device", None)
    if exec_device is not None:
        if isinstance(exec_device, int):
            return torch.device("cuda", exec_device)
        return torch.device(exec_device)
    return x.device


def _movable(tensor: Any, target: Any) -> bool:
    """A buffer may move between real devices; never to or from "meta" (its values would be
    lost, or are offloaded and restored by accelerate)."""
    return tensor.device != target and tensor.device.type != "meta" and target.type != "meta"


def _align_rotary(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Forward pre-hook body: returns (args, kwargs) with position_ids on the target device."""
    import torch

    from ... import runtime

    params = _forward_params(module)
    x = args[0] if args else kwargs.get(params[0]) if params else None
    if not isinstance(x, torch.Tensor):
        return None
    pos_index = params.index("position_ids")
    in_args = len(args) > pos_index
    position_ids = args[pos_index] if in_args else kwargs.get("position_ids")
    target = _target_device(module, x)
    moves: list[str] = []
    if isinstance(position_ids, torch.Tensor) and position_ids.device != target:
        moves.append("position_ids")
    buffers = [
        n
        for n in ("inv_freq", "original_inv_freq")
        if isinstance(getattr(module, n, None), torch.Tensor)
        and _movable(getattr(module, n), target)
    ]
    moves += buffers
    if not moves:
        return None
    settings = runtime.settings()
    if not settings.enabled or not settings.allows("align"):
        return None
    compiling = events.is_compiling()
    apply = settings.changes_things
    if not compiling:
        before = {
            n: str((position_ids if n == "position_ids" else getattr(module, n)).device)
            for n in moves
        }
        events.emit(
            "tensors_aligned",
            site=f"rotary:{type(module).__name__}",
            reason_code=ALIGN_REASON_CODE,
            reason=(
                f"{type(module).__name__} got inputs on {x.device} but "
                + ", ".join(f"{n} on {d}" for n, d in before.items())
                + (f"; moved them to {target}" if apply else "; left as is (not fix mode)")
            ),
            module=type(module).__name__,
            moved=moves,
            before=before,
            target=str(target),
            applied=apply,
        )
    if not apply:
        return None
    if not compiling:  # a buffer assignment would break a traced graph; position_ids is enough
        for n in buffers:
            setattr(module, n, getattr(module, n).to(target))
    if "position_ids" not in moves:
        return None
    position_ids = position_ids.to(target)
    if in_args:
        args = (*args[:pos_index], position_ids, *args[pos_index + 1 :])
    else:
        kwargs = {**kwargs, "position_ids": position_ids}
    return args, kwargs


def _rotary_pre_hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    try:
        return _align_rotary(module, args, kwargs)
    except Exception as exc:  # fail open: the original forward runs with its own inputs
        from ...failopen import report_internal_error

        try:
            report_internal_error(f"rotary:{type(module).__name__}", exc)
        except Exception:
            pass
        return None


def install_rotary_alignment(model: Any) -> int:
    """Hook the rotary embeddings of a model whose parameters span several devices.

    Each rotary module (see :func:`is_rotary_module`) gets a forward pre-hook that brings
    ``position_ids`` and ``inv_freq`` to the device of its input ``x`` (or to accelerate's
    execution device for that module) and emits ``tensors_aligned`` once per module class
    (``site="rotary:<Class>"``; later repeats only count). The hook reads the settings at call
    time: fix mode moves, warn/strict only report, ``ATTNGUARD_DISABLE=align`` or off does nothing.

    Returns the number of rotary modules guarded (0 for a single-device model: nothing installed).
    Idempotent. The loading wrapper calls it after ``from_pretrained`` when
    ``settings.allows("align")``.
    """
    if len(model_devices(model)) < 2:
        return 0
    handles = _HOOKS.setdefault(model, [])
    guarded = 0
    for module in model.modules():
        if not is_rotary_module(module):
            continue
        guarded += 1
        if getattr(module, _MARK, False):
            continue
        handle = module.register_forward_pre_hook(_rotary_pre_hook, with_kwargs=True)
        setattr(module, _MARK, True)
        handles.append((module, handle))
    return guarded


def remove_rotary_alignment(model: Any) -> int:
    """Remove the hooks :func:`install_rotary_alignment` added; returns how many were removed."""
    handles = _HOOKS.pop(model, [])
    for module, handle in handles:
        handle.remove()
        try:
            delattr(module, _MARK)
        except AttributeError:
            pass
    return len(handles)
