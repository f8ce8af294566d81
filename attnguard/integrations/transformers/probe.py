"""A first-use check that transformers' own flash path, given the twins, computes flash's numbers.

:mod:`.wiring` reads *how* a release hands its flash path the kernel functions; this
module checks *what comes out*, once per process, before the first load that relies on it. It
calls transformers' own flash entry of the attention registry (the public
``ALL_ATTENTION_FUNCTIONS["flash_attention_2"]``, the function every model calls) on a handful of
tiny float64 CPU inputs, with recording stand-ins of the twins handed in where the wiring says,
and compares each output with flash-attn's semantics computed independently from the same
arguments (:func:`attnguard.fallback.registry.flash_call_on_sdpa`: masks spelled out for SDPA /
explicit attention, no twin involved):

* a dense causal batch and a non-causal (encoder) batch -> ``flash_attn_func``;
* a padded batch (2D mask), and one decode step against it -> unpad, ``flash_attn_varlen_func``,
  pad;
* a packed row (``position_ids`` restarting at 0, no mask), and the same row given by
  ``cu_seq_lens_*`` -> ``flash_attn_varlen_func`` with the sequences' boundaries, none attending
  across;
* a sliding window -> the ``window_size`` the release passes is recorded (its convention, whatever
  it is, is what flash would get) and the output must honour it;
* softcapping;
* attention sinks (``s_aux``, one logit per head), dense and padded. A release that does not hand
  them to the twins does not fail the probe: ``s_aux`` is then an argument the twins do not
  compute (``Result.uncomputed``), and a model that passes it is not run on them.

It runs once per flash-attn family whose twins the path is handed (:mod:`attnguard.fallback.
families`), the calls made as that family's request (``flash_attention_3`` for flash-attn 3's
twins): transformers hands each family's kernels what their signatures declare (flash-attn 3's
and 4's no dropout), and a family whose twins take no sinks finds them not computed.

Every call must reach a stand-in in the role the wiring gave it, with arguments the twin takes
(a twin has no ``**kwargs``: an argument it does not know raises), and every output must match.
Anything else -- an exception anywhere in transformers' path, a stand-in never called, a
different number -- fails the probe with the reason, and the flash path is not kept (attnguard
steps aside). It runs in a few milliseconds on one CPU thread (no OpenMP pool is started: a program that
forks later is not affected), emits nothing, leaves the global RNG alone and restores what it
changed (:func:`attnguard.integrations.transformers.flash_path.swapped_kernels`).
"""

from __future__ import annotations

import functools
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .wiring import FUNC, PAD, VARLEN, Wiring

FLASH_KEY = "flash_attention_2"
_ATOL = 1e-5  # a different mask moves outputs by ~0.1; rounding (an fp32 softmax) by < 1e-6


@dataclass(frozen=True)
class Result:
    ok: bool
    reason: str = ""
    # flash's window_size for sliding_window=w, as (left - w, right - w); None: not recorded
    window_offset: tuple[int, int] | None = None
    cases: tuple[str, ...] = field(default=())
    # optional arguments the flash path does not get computed on the twins: argument -> why
    uncomputed: dict[str, str] = field(default_factory=dict)


class ProbeFailed(Exception):
    pass


@dataclass(frozen=True)
class _Case:
    name: str
    batch: int
    q_len: int
    k_len: int
    causal: bool = True
    pad: tuple[int, ...] = ()  # padded key positions per row, counted from the left
    position_ids: tuple[int, ...] = ()
    cu_seqlens: tuple[int, ...] = ()
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False
    expects: tuple[str, ...] = ()  # roles that must have been called
    optional: str = ""  # the argument this case checks; its failure marks only that uncomputed


_CASES = (
    _Case("dense", 2, 6, 6, expects=(FUNC,)),
    _Case("encoder", 2, 5, 5, causal=False, expects=(FUNC,)),
    _Case("padded", 2, 6, 6, pad=(2, 0), expects=(VARLEN, PAD)),
    _Case("decode", 2, 1, 6, pad=(0, 1), expects=(VARLEN, PAD)),
    _Case("packed", 1, 7, 7, position_ids=(0, 1, 2, 0, 1, 2, 3), expects=(VARLEN,)),
    _Case(
        "packed_cu",
        1,
        7,
        7,
        position_ids=(0, 1, 2, 3, 0, 1, 2),
        cu_seqlens=(0, 4, 7),
        expects=(VARLEN,),
    ),
    _Case("window", 1, 8, 8, sliding_window=3, expects=(FUNC,)),
    _Case("softcap", 1, 5, 5, softcap=2.0, expects=(FUNC,)),
    _Case("sinks", 2, 6, 6, sinks=True, expects=(FUNC,), optional="s_aux"),
    _Case("sinks_padded", 2, 6, 6, pad=(2, 0), sinks=True, expects=(VARLEN,), optional="s_aux"),
)
_HEADS, _KV_HEADS, _HEAD_DIM = 4, 2, 8


class _Recorder:
    """Stand-ins of the twins that remember what transformers called, on the probing thread."""

    def __init__(self, twins: dict[str, Callable[..., Any]]) -> None:
        self.thread = threading.get_ident()
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.kernels = {role: self._wrap(role, fn) for role, fn in twins.items()}

    def _wrap(self, role: str, twin: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(twin)  # transformers reads the kernel's signature (its kwarg support)
        def stand_in(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self.thread:
                self.calls.append((role, args, kwargs))
            return twin(*args, **kwargs)

        return stand_in


def _module(torch: Any, causal: bool, implementation: str = FLASH_KEY) -> Any:
    """What transformers' flash entry reads from the attention module calling it (the request
    it reads its kernels by: ``implementation``)."""
    module = torch.nn.Module()
    # read for float32 inputs only; on "meta": no weights drawn from the global RNG
    module.proj = torch.nn.Linear(2, 2, dtype=torch.float64, device="meta")
    module.is_causal = causal
    module.layer_idx = 0
    module.config = types.SimpleNamespace(_attn_implementation=implementation)
    return module


def _inputs(torch: Any, case: _Case, generator: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    shape_q = (case.batch, _HEADS, case.q_len, _HEAD_DIM)
    shape_k = (case.batch, _KV_HEADS, case.k_len, _HEAD_DIM)
    # float64: not float32, which transformers would "cast back" for flash with a warning
    q = torch.randn(shape_q, generator=generator, dtype=torch.float64)
    k = torch.randn(shape_k, generator=generator, dtype=torch.float64)
    v = torch.randn(shape_k, generator=generator, dtype=torch.float64)
    mask = None
    if case.pad:
        mask = torch.ones(case.batch, case.k_len, dtype=torch.long)
        for row, n in enumerate(case.pad):
            mask[row, :n] = 0
    kwargs: dict[str, Any] = {}
    if case.position_ids:
        kwargs["position_ids"] = torch.tensor([case.position_ids])
    if case.cu_seqlens:
        cu = torch.tensor(case.cu_seqlens, dtype=torch.int32)
        longest = max(b - a for a, b in zip(case.cu_seqlens, case.cu_seqlens[1:], strict=False))
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest)
        kwargs["max_length_k"] = longest
    if case.sliding_window is not None:
        kwargs["sliding_window"] = case.sliding_window
    if case.softcap is not None:
        kwargs["softcap"] = case.softcap
    if case.sinks:
        kwargs["s_aux"] = 2.0 * torch.randn(_HEADS, generator=generator, dtype=torch.float64)
    return q, k, v, mask, kwargs


def _window_offset(calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]], w: int) -> Any:
    sizes = {tuple(kw["window_size"]) for _, _, kw in calls if "window_size" in kw}
    if len(sizes) != 1:
        raise ProbeFailed(f"sliding_window={w} reached the kernel as window_size {sorted(sizes)}")
    left, right = sizes.pop()
    return left - w, right - w


def _check(
    torch: Any, entry: Callable[..., Any], recorder: _Recorder, implementation: str
) -> Result:
    generator = torch.Generator().manual_seed(20261125)
    offset = None
    uncomputed: dict[str, str] = {}
    for case in _CASES:
        if case.optional in uncomputed:
            continue
        try:
            found = _check_case(torch, entry, recorder, case, generator, implementation)
        except ProbeFailed as exc:
            if not case.optional:
                raise
            uncomputed[case.optional] = str(exc)
            continue
        offset = found if found is not None else offset
    return Result(True, "", offset, tuple(c.name for c in _CASES), uncomputed)


def _check_case(
    torch: Any,
    entry: Callable[..., Any],
    recorder: _Recorder,
    case: _Case,
    generator: Any,
    implementation: str,
) -> Any:
    """One case; returns the window offset it recorded (None if it has no window)."""
    from ...fallback.registry import flash_call_on_sdpa

    offset = None
    q, k, v, mask, kwargs = _inputs(torch, case, generator)
    module = _module(torch, case.causal, implementation)
    recorder.calls.clear()
    try:
        got, _ = entry(module, q, k, v, mask, dropout=0.0, scaling=None, **kwargs)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ProbeFailed(
            f"its flash path raised {type(exc).__name__} ({first}) on the {case.name} case"
        ) from exc
    called = {role for role, _, _ in recorder.calls}
    missing = [role for role in case.expects if role not in called]
    if missing:
        raise ProbeFailed(
            f"on the {case.name} case it never called {', '.join(missing)} "
            f"(called: {', '.join(sorted(called)) or 'nothing'})"
        )
    window = None
    if case.sliding_window is not None:
        offset = _window_offset(recorder.calls, case.sliding_window)
        window = (case.sliding_window + offset[0], case.sliding_window + offset[1])
    if case.position_ids and not case.cu_seqlens:
        want_cu = [0] + [i for i, p in enumerate(case.position_ids) if i and p == 0]
        want_cu.append(len(case.position_ids))
        seen = [
            kw.get("cu_seqlens_q", args[3] if len(args) > 3 else None)
            for role, args, kw in recorder.calls
            if role == VARLEN
        ]
        if not any(c is not None and c.tolist() == want_cu for c in seen):
            raise ProbeFailed(f"packed rows did not reach the kernel as cu_seqlens {want_cu}")
    ref, _ = flash_call_on_sdpa(module, q, k, v, mask, (), kwargs, window=window)
    got = got.reshape(ref.shape)
    if not torch.allclose(got, ref, atol=_ATOL, rtol=_ATOL):
        diff = float((got - ref).abs().max())
        raise ProbeFailed(
            f"on the {case.name} case its flash path computed other numbers than flash's "
            f"semantics (max difference {diff:.2e})"
        )
    return offset


def _registry_entry(modeling_utils: Any) -> Callable[..., Any]:
    from .interface import registry_mapping

    mapping = registry_mapping(modeling_utils) if modeling_utils is not None else None
    entry = mapping.get(FLASH_KEY) if mapping is not None else None
    if not callable(entry):
        raise ProbeFailed(f"the attention registry has no {FLASH_KEY} entry")
    return getattr(entry, "__attnguard_original__", entry)


def run(
    module: Any,
    wiring: Wiring,
    *,
    kernels: Callable[[], dict[str, Callable[..., Any]]],
    swapped: Callable[[dict[str, Callable[..., Any]]], Any],
    implementation: str = FLASH_KEY,
) -> Result:
    """Run transformers' flash path (the registry entry) on the recording twins; never raises.

    ``kernels()``: the twins the flash path is handed, by role (one family's);
    ``swapped(kernels)``: a context in which the flash path is handed ``kernels`` instead (the
    flash path module's own); ``implementation``: the flash request the calls make (the one
    the family's twins serve: transformers passes each family's kernels what their signatures
    declare, flash-attn 3's no dropout)."""
    import sys

    try:
        import torch

        entry = _registry_entry(sys.modules.get("transformers.modeling_utils"))
        recorder = _Recorder(kernels())
        threads = torch.get_num_threads()
        # one thread: no OpenMP pool started for a few tiny calls (a process that forks later
        # would otherwise hang in its child's first parallel op, as after any parallel op)
        torch.set_num_threads(1)
        try:
            # on the CPU whatever device block the caller's code is in (a model built under
            # ``torch.device("meta")``, as transformers' own loading does)
            with torch.device("cpu"), swapped(recorder.kernels), torch.no_grad():
                return _check(torch, entry, recorder, implementation)
        finally:
            torch.set_num_threads(threads)
    except ProbeFailed as exc:
        return Result(False, f"{exc} [{wiring.describe()}]")
    except Exception as exc:  # the probe itself could not run: not confirmed, so not kept
        return Result(False, f"the check of its flash path could not run ({type(exc).__name__})")
