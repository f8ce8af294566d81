"""One zoo model: guarded flash_attention_2 (flash-attn absent, CPU, fp32) against what
transformers' flash code path computes, and against eager.

The reference for "what the flash path computes" is transformers' own flash path run with
*reference kernels* handed in where flash-attn's functions would be: float64 attention written out
here from flash-attn's documented semantics (bottom-right causal alignment, ``window_size``,
softcap, and attention sinks as one extra logit per head that takes probability mass and gives no
value). So the release's own quirks (a decoder its flash path runs bidirectionally, a window
convention, padding it drops) are part of the reference, as they are of the real kernel; where the
flash path and eager disagree, the record says so (``eager_differs``). The reference kernels take
exactly the keywords they compute (no ``**kwargs``): transformers hands a kernel what its
signature declares, and what it hands them is computed.

Outcomes: ``exact`` (the guarded model computes the flash path's numbers on every batch, or fails
on a batch exactly as the flash path does with the reference kernels), ``aside`` (the guarded load
fails with the unguarded load's own error, and attnguard said why in one event), ``wrong``,
``harm`` (guarded fails where unguarded loads, or fails differently), ``not_built``.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from typing import Any

import torch
from helpers.tensors import band_keep, reference
from workers import zoo

FLASH = "flash_attention_2"
ATOL = 2e-4  # relative: fp32 rounding of tiny models (a different mask moves them by > 1e-2)


# ---- reference kernels: flash-attn's semantics, float64, written out ---------------------------


def _attend(
    q: Any, k: Any, v: Any, scale: Any, causal: bool, window: Any, softcap: Any, sinks: Any
) -> Any:
    """One sequence: q (Sq, H, D), k/v (Sk, Hk, D) -> (Sq, H, Dv), float64 inside (rows with no
    visible key: zeros, as flash-attn)."""
    left, right = (-1, -1) if window is None else (int(window[0]), int(window[1]))
    keep = band_keep(q.shape[0], k.shape[0], left, 0 if causal else right)  # bottom-right
    scale = None if scale is None else float(scale)
    out = reference(q[None], k[None], v[None], keep, scale=scale, softcap=softcap, sinks=sinks)
    return out[0].to(q.dtype)


def ref_flash_attn_func(
    q: Any,
    k: Any,
    v: Any,
    dropout_p: float = 0.0,
    softmax_scale: Any = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    s_aux: Any = None,
) -> Any:
    assert alibi_slopes is None and not dropout_p
    out = torch.stack(
        [
            _attend(q[b], k[b], v[b], softmax_scale, causal, window_size, softcap, s_aux)
            for b in range(q.shape[0])
        ]
    )
    return (out, None, None) if return_attn_probs else out


def ref_flash_attn_varlen_func(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: Any,
    max_seqlen_k: Any,
    dropout_p: float = 0.0,
    softmax_scale: Any = None,
    causal: bool = False,
    window_size: Any = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Any = None,
    s_aux: Any = None,
) -> Any:
    assert alibi_slopes is None and not dropout_p and block_table is None
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if cq[-1] != q.shape[0] or ck[-1] != k.shape[0] or cq != sorted(cq) or ck != sorted(ck):
        raise ValueError(
            f"cu_seqlens {cq} / {ck} do not partition the {q.shape[0]} / {k.shape[0]} packed tokens"
        )
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for n in range(len(cq) - 1):
        qs, ks = q[cq[n] : cq[n + 1]], k[ck[n] : ck[n + 1]]
        vs = v[ck[n] : ck[n + 1]]
        if qs.shape[0]:
            out[cq[n] : cq[n + 1]] = _attend(
                qs, ks, vs, softmax_scale, causal, window_size, softcap, s_aux
            )
    return (out, None, None) if return_attn_probs else out


REFERENCE_KERNELS = {
    "flash_attn_func": ref_flash_attn_func,
    "flash_attn_varlen_func": ref_flash_attn_varlen_func,
}


def on_reference_kernels(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """``model`` (loaded for flash) run with transformers' flash path computing on the reference
    kernels (handed in where attnguard hands its twins: attnguard must be active)."""
    from attnguard.integrations.transformers import flash_path

    with flash_path.swapped_kernels(REFERENCE_KERNELS):
        flash_path.preload(FLASH)  # as transformers' gate does at load
        return zoo.run(model, inputs)


# ---- one model ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Record:
    entry: zoo.Entry
    outcome: str  # exact | aside | wrong | harm | not_built
    detail: str = ""
    errors: dict[str, float] = dataclasses.field(default_factory=dict)
    eager_differs: dict[str, float] = dataclasses.field(default_factory=dict)
    path_errors: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    drawn: list[str] = dataclasses.field(default_factory=list)


def dtype_kwargs() -> dict[str, Any]:
    import transformers
    from packaging.version import Version

    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return {key: torch.float32}


def error_text(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return math.inf
    keep = torch.isfinite(want)
    if not bool(keep.all()):
        got, want = got[keep], want[keep]
    if not want.numel():
        return 0.0
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _real_tokens(out: torch.Tensor, inputs: dict[str, Any]) -> torch.Tensor:
    """Per-token outputs of a padded batch at its real tokens (padded positions are undefined
    on the flash path: flash zeroes them, eager does not)."""
    mask = inputs.get("attention_mask")
    if mask is not None and out.shape[:2] == mask.shape:
        return out[mask.bool()]
    return out


_FLASH_PATH_FILES = ("modeling_flash_attention_utils.py", "integrations/flash_attention.py")


def _in_flash_path(exc: BaseException) -> bool:
    """The error was raised inside transformers' flash path: its flash modules, or a model's own
    flash attention class (``GPTNeoFlashAttention2``), or a kernel they called."""
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.replace("\\", "/").endswith(_FLASH_PATH_FILES):
            return True
        if "transformers" in code.co_filename and "Flash" in getattr(code, "co_qualname", ""):
            return True
        tb = tb.tb_next
    return False


def compare(
    flash: Any, ref: Any, plain: dict[str, Any], record: Record, eager: bool = True
) -> None:
    """Every batch the model takes: the guarded model against the flash path on the reference
    kernels; where both fail, the same error raised inside transformers' flash path (its own,
    with any kernel) passes, and a batch eager fails on too is one the model does not take;
    anything else is wrong. ``eager``: also say where the flash path and eager differ."""
    for name, inputs in zoo.batches(ref, plain).items():
        got_error = want_error = None
        try:
            got = zoo.run(flash, inputs)
        except Exception as exc:
            got_error = exc
        try:
            want = on_reference_kernels(flash, inputs)
        except Exception as exc:
            want_error = exc
        if got_error is not None or want_error is not None:
            try:
                zoo.run(ref, inputs)
            except Exception as exc:  # inputs this model does not take
                record.skipped[name] = f"eager: {error_text(exc)}"
                continue
        both = got_error is not None and want_error is not None
        # (a NameError is an import made only where flash-attn was installed: not the path's)
        own = both and not isinstance(got_error, NameError) and _in_flash_path(got_error)
        if own and type(got_error) is type(want_error):
            record.path_errors[name] = error_text(want_error)  # the flash path's own
            continue
        if got_error is not None or want_error is not None:
            record.errors[name] = math.inf
            record.detail += (
                f"{name}: guarded {error_text(got_error) if got_error else 'ran'}, "
                f"reference {error_text(want_error) if want_error else 'ran'}; "
            )
            continue
        record.errors[name] = relative_error(_real_tokens(got, inputs), _real_tokens(want, inputs))
        if eager:
            on_eager = zoo.run(ref, inputs)
            differs = relative_error(_real_tokens(want, inputs), _real_tokens(on_eager, inputs))
            if not differs <= ATOL:
                record.eager_differs[name] = differs


def check(entry: zoo.Entry, root: Any, eager: bool = True) -> Record:
    """Build, save, load guarded with flash and with eager, compare; or, where the guarded load
    fails, check that the unguarded load fails the same way."""
    import attnguard
    from attnguard.observability import events

    try:
        model, plain = zoo.build(entry)
    except zoo.NotBuilt as exc:
        return Record(entry, "not_built", str(exc))
    drawn = zoo.randomise_special(model)
    path = root / entry.model_type
    cls = entry.cls
    try:
        model.save_pretrained(path)
    except Exception as exc:
        return Record(entry, "not_built", f"save: {error_text(exc)}")
    ref = model  # eager, the weights just saved
    events.reset_counts()  # every load's events are emitted, not only the process's first
    with events.capture() as seen:
        try:
            flash = zoo.prepare(
                cls.from_pretrained(path, attn_implementation=FLASH, **dtype_kwargs())
            )
            guarded_error = None
        except Exception as exc:
            guarded_error = exc
    seen = [e for e in seen if e["event"] != "activated"]
    record = Record(entry, "exact", events=seen, drawn=drawn)
    if guarded_error is not None:
        attnguard.deactivate()
        try:
            cls.from_pretrained(path, attn_implementation=FLASH, **dtype_kwargs())
            unguarded = None
        except Exception as exc:
            unguarded = exc
        finally:
            attnguard.activate(log="none")
        same = unguarded is not None and (type(unguarded), str(unguarded)) == (
            type(guarded_error),
            str(guarded_error),
        )
        # a checkpoint that does not load back at all (its config does not round-trip): the
        # zoo's, not the guard's (the unguarded load fails before reading it)
        try:
            cls.from_pretrained(path, attn_implementation="eager", **dtype_kwargs())
        except Exception as exc:
            record.outcome, record.detail = "not_built", f"load: {error_text(exc)}"
            shutil.rmtree(path, ignore_errors=True)
            return record
        record.outcome = "aside" if same else "harm"
        record.detail = f"guarded {error_text(guarded_error)}" + (
            "" if same else f"; unguarded {error_text(unguarded) if unguarded else 'loads'}"
        )
        shutil.rmtree(path, ignore_errors=True)
        return record
    compare(flash, ref, plain, record, eager)
    shutil.rmtree(path, ignore_errors=True)  # tiny, but hundreds of them
    if any(not v <= ATOL for v in record.errors.values()):
        record.outcome = "wrong"
    return record
