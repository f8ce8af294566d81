"""The race: the candidates' implementations, measuring them on a call's own inputs (GPU work),
and :func:`pick`, the winner from what was measured.

Every candidate takes the call exactly as the caller made it (flash-attn's arguments) and returns
what flash-attn returns. The race runs each on the call's own tensors (copies of the KV caches,
which a call writes in place; detached copies of q/k/v when they need gradients), warms each up
once, then times ``REPS`` interleaved rounds (wall clock with the GPU synchronised: for small
calls the host's launch cost is part of what a step pays) and compares outputs, and gradients
for a backward pass with one fixed random gradient, with the requested kernel's.

:func:`pick`: the fastest candidate whose outputs (and gradients) are within the dtype's rounding
of the requested kernel's (:data:`~attnguard.selection.buckets.TOLERANCE`), and at least
:data:`MARGIN` faster than it in the median and in every timed round; else the requested kernel
stays.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .. import fallback
from ..fallback import torch_flash
from ..fallback.masks import normalize_window
from .buckets import REQUESTED, SDPA_BACKENDS, TOLERANCE, Call

Tensor = torch.Tensor
Impl = Callable[[tuple[Any, ...], dict[str, Any]], Any]
REPS = 3
MARGIN = 0.05  # a candidate must be at least 5 % faster than the requested kernel to win


@dataclass(frozen=True)
class Measured:
    """One candidate's result on the call's own inputs."""

    ms: float = math.inf  # median of the timed rounds
    out_diff: float = math.inf  # max |candidate - requested| / max |requested|, outputs
    grad_diff: float | None = None  # the same over q/k/v gradients (when the call trains)
    error: str | None = None
    rounds: tuple[float, ...] = ()  # each timed round's ms, rounds interleaved across candidates


def _faster_every_round(m: Measured, base: Measured, margin: float) -> bool:
    pairs = list(zip(m.rounds, base.rounds, strict=False))
    return all(mine <= theirs * (1.0 - margin) for mine, theirs in pairs)


@dataclass(frozen=True)
class Verdict:
    winner: str
    why: dict[str, str]  # candidate -> why it won / lost


def pick(measured: dict[str, Measured], dtype: str, margin: float = MARGIN) -> Verdict:
    """The fastest candidate within tolerance and ``margin`` faster than the requested one."""
    tol = TOLERANCE.get(dtype, 0.0)
    base = measured.get(REQUESTED)
    why: dict[str, str] = {}
    if base is None or base.error is not None or not math.isfinite(base.ms):
        reason = base.error if base is not None and base.error else "not measured"
        return Verdict(REQUESTED, {REQUESTED: f"the requested kernel could not be timed: {reason}"})
    eligible: list[tuple[float, str]] = []
    for name, m in measured.items():
        if name == REQUESTED:
            continue
        if m.error is not None:
            why[name] = f"failed on this call: {m.error}"
        elif m.out_diff > tol:
            why[name] = f"outputs differ by {m.out_diff:.3g} of max |out| (> {tol:g})"
        elif m.grad_diff is not None and m.grad_diff > tol:
            why[name] = f"gradients differ by {m.grad_diff:.3g} of max |grad| (> {tol:g})"
        elif m.ms > base.ms * (1.0 - margin):
            why[name] = f"{m.ms:.3f} ms: not {margin:.0%} faster than {base.ms:.3f} ms"
        elif not _faster_every_round(m, base, margin):
            # timing noise must not pick a kernel that is not really faster: the margin has
            # to hold in every round, not only in the median
            why[name] = f"{m.ms:.3f} ms: not {margin:.0%} faster in every timed round"
        else:
            eligible.append((m.ms, name))
    if not eligible:
        why[REQUESTED] = "no candidate within tolerance and faster by the margin"
        return Verdict(REQUESTED, why)
    eligible.sort()
    best_ms, best = eligible[0]
    why[best] = f"{best_ms:.3f} ms vs {base.ms:.3f} ms ({base.ms / best_ms:.2f}x), within tolerance"
    for ms, name in eligible[1:]:
        why[name] = f"{ms:.3f} ms: slower than {best}"
    why[REQUESTED] = f"{base.ms:.3f} ms: slower than {best}"
    return Verdict(best, why)


def _named(params: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict:
    named = dict(zip(params, args, strict=False))
    named.update(kwargs)
    return named


def _sdpa_backend(params: tuple[str, ...], backend: str) -> Impl:
    """flash_attn_func computed by SDPA with only ``backend`` allowed (plain calls only:
    full attention, or causal with as many queries as keys; no LSE)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = getattr(SDPBackend, backend)

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        c = _named(params, args, kwargs)
        q, k, v = c["q"], c["k"], c["v"]
        scale = c.get("softmax_scale")
        gqa = q.shape[2] != k.shape[2]
        with sdpa_kernel([chosen]):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=bool(c.get("causal")),
                scale=scale,
                enable_gqa=gqa,
            )
        return out.transpose(1, 2).contiguous()

    return run


def _torch_flash_dense(params: tuple[str, ...]) -> Impl:
    """flash_attn_func computed by torch's own flash kernel in one call."""

    def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        c = _named(params, args, kwargs)
        q, k, v = c["q"], c["k"], c["v"]
        scale = c.get("softmax_scale")
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        window = normalize_window(
            c.get("window_size") or (-1, -1), bool(c.get("causal")), k.shape[1]
        )
        out, lse = torch_flash.attention(
            q, k, v, None, None, q.shape[1], k.shape[1], dropout_p=0.0, scale=scale, window=window
        )
        return (out, lse, None) if c.get("return_attn_probs") else out

    return run


def implementations(
    entry: str, original: Callable[..., Any], params: tuple[str, ...], names: list[str]
) -> dict[str, Impl]:
    """name -> how that candidate computes a call of ``entry``."""
    twin = fallback.FLASH_FUNCTIONS[entry]
    out: dict[str, Impl] = {}
    for name in names:
        if name == REQUESTED:
            out[name] = lambda a, k: original(*a, **k)
        elif name == "sdpa" or (name == "torch_flash" and entry != "flash_attn_func"):
            # the twin: on a GPU its varlen / KV-cache routes are torch's flash kernel
            out[name] = lambda a, k: twin(*a, **k)
        elif name == "torch_flash":
            out[name] = _torch_flash_dense(params)
        elif name in SDPA_BACKENDS:
            out[name] = _sdpa_backend(params, SDPA_BACKENDS[name])
    return out


def _first(result: Any) -> Tensor:
    return result[0] if isinstance(result, tuple) else result


def _rel_diff(got: Tensor, ref: Tensor) -> float:
    scale = max(ref.detach().float().abs().max().item(), 1e-6)
    return (got.detach().float() - ref.detach().float()).abs().max().item() / scale


class _Inputs:
    """Per-candidate copies of what a call changes (KV caches) or needs gradients for."""

    def __init__(
        self, params: tuple[str, ...], args: tuple[Any, ...], kwargs: dict[str, Any], call: Call
    ):
        self.params = params
        self.args = args
        self.kwargs = kwargs
        self.call = call
        self.grad_names = ("q", "k", "v") if call.grad else ()
        self.copy_names = ("k_cache", "v_cache") if call.entry == "flash_attn_with_kvcache" else ()

    def fresh(self) -> tuple[tuple[Any, ...], dict[str, Any], list[Tensor]]:
        args, kwargs = list(self.args), dict(self.kwargs)
        leaves: list[Tensor] = []
        for name in (*self.grad_names, *self.copy_names):
            where = self.params.index(name) if name in self.params else None
            positional = where is not None and where < len(args)
            value = args[where] if positional else kwargs.get(name)
            if not isinstance(value, Tensor):
                continue
            if name in self.grad_names:
                value = value.detach().clone().requires_grad_(True)
                leaves.append(value)
            else:
                value = value.clone()
            if where is not None and where < len(args):
                args[where] = value
            else:
                kwargs[name] = value
        return tuple(args), kwargs, leaves


def _stepper(impl: Impl, a: tuple, k: dict, leaves: list[Tensor], grad_out: Tensor | None) -> Any:
    """One timed unit: the call, and its backward pass when the call trains."""

    def step() -> tuple[Any, tuple[Tensor, ...] | None]:
        out = impl(a, k)
        if leaves and grad_out is not None:
            return out, torch.autograd.grad(_first(out), leaves, grad_out)
        return out, None

    return step


class OverBudget(Exception):
    """The race would take longer than the time left for races in this process."""


def measure(
    impls: dict[str, Impl],
    params: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: Call,
    budget_s: float = float("inf"),
) -> dict[str, Measured]:
    """Run every candidate on the call's inputs: results compared with the requested kernel's,
    times interleaved over :data:`REPS` rounds. A candidate that raises is disqualified.
    :class:`OverBudget` when the requested kernel's first run, times every run the race would
    make, exceeds ``budget_s`` (nothing else has run then)."""
    with warnings.catch_warnings():
        # a candidate's refusal ("Flash attention kernel not used because ...") is measured,
        # not printed: the program's stderr stays as it was
        warnings.simplefilter("ignore")
        return _measure(impls, params, args, kwargs, call, budget_s)


def _measure(
    impls: dict[str, Impl],
    params: tuple[str, ...],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    call: Call,
    budget_s: float,
) -> dict[str, Measured]:
    inputs = _Inputs(params, args, kwargs, call)
    grad_out: Tensor | None = None
    if call.grad:  # one fixed random gradient of the output, the same for every candidate
        with torch.no_grad():
            probe = _first(impls[REQUESTED](*inputs.fresh()[:2]))
        g = torch.Generator(device=probe.device).manual_seed(0)
        grad_out = torch.randn(probe.shape, generator=g, device=probe.device).to(probe.dtype)
    steps: dict[str, Callable[[], Any]] = {}
    results: dict[str, tuple[Tensor, list[Tensor] | None]] = {}
    errors: dict[str, str] = {}
    for name, impl in impls.items():
        a, k, leaves = inputs.fresh()
        step = _stepper(impl, a, k, leaves, grad_out)
        try:
            out, grads = step()  # also the warm-up
        except Exception as exc:  # a candidate that cannot take the call loses
            errors[name] = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
            continue
        if name == REQUESTED:
            # the cost of the race, projected from one warm run of the requested kernel (the
            # first run of a process also pays CUDA's and the kernel's own start-up)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step()
            torch.cuda.synchronize()
            projected = (time.perf_counter() - t0) * len(impls) * (1 + REPS)
            if projected > budget_s:
                raise OverBudget(f"this race would take about {projected:.1f} s")
        results[name] = (_first(out), list(grads) if grads is not None else None)
        steps[name] = step
    times: dict[str, list[float]] = {name: [] for name in steps}
    order = list(steps)
    for rep in range(REPS if order else 0):
        for name in order[rep % len(order) :] + order[: rep % len(order)]:
            torch.cuda.synchronize()
            t = time.perf_counter()
            steps[name]()
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t) * 1e3)
    out: dict[str, Measured] = {}
    ref = results.get(REQUESTED)
    for name in impls:
        if name in errors:
            out[name] = Measured(error=errors[name])
            continue
        got, grads = results[name]
        ms = statistics.median(times[name])
        if ref is None:
            out[name] = Measured(ms=ms, rounds=tuple(times[name]))
            continue
        out_diff = _rel_diff(got, ref[0]) if got.shape == ref[0].shape else math.inf
        grad_diff = None
        if grads is not None and ref[1] is not None:
            grad_diff = max(_rel_diff(a, b) for a, b in zip(grads, ref[1], strict=True))
        out[name] = Measured(ms, out_diff, grad_diff, rounds=tuple(times[name]))
    return out
