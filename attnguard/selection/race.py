"""The race: the candidates' implementations, measuring them on a call's own inputs (GPU work),
and :func:`pick`, the winner from what was measured.

Every candidate takes the call exactly as the caller made it (flash-attn's arguments) and returns
what flash-attn returns. A :class:`Race` runs each on the call's own tensors (copies of the KV
caches, which a call writes in place; detached copies of q/k/v when they need gradients): the
requested kernel first (a warm-up and one timed run, the probe the race's cost is projected
from), then every other candidate's warm-up, whose outputs, and gradients for a backward pass
with one fixed random gradient, are compared with the requested kernel's at once; then ``REPS``
interleaved timed rounds (wall clock with the GPU synchronised: for small calls the host's
launch cost is part of what a step pays). Warm-ups are outside the timing: a process's first
call of a kernel also pays its start-up (a cold cuDNN call can take a second).

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
from ..fallback.sdpa import SDPA_TAKES_GQA, repeat_kv_heads
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
        q, k, v = c["q"].transpose(1, 2), c["k"].transpose(1, 2), c["v"].transpose(1, 2)
        n_rep = q.shape[1] // k.shape[1]
        gqa: dict[str, bool] = {}
        if n_rep > 1 and SDPA_TAKES_GQA:
            gqa["enable_gqa"] = True
        elif n_rep > 1:  # this torch's SDPA has no enable_gqa: the heads repeated, as it would
            k, v = repeat_kv_heads(k, n_rep), repeat_kv_heads(v, n_rep)
        with sdpa_kernel([chosen]):
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=bool(c.get("causal")), scale=c.get("softmax_scale"), **gqa
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


def _now() -> float:
    """A time stamp after the GPU finished what was queued (a race's timings are wall clock)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter()


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"


class Race:
    """One race on one call's own inputs, in two steps so that its cost can be judged before most
    of it is spent: :meth:`probe` runs the requested kernel (a warm-up, then one timed run, from
    which :meth:`projected_s` projects the timed rounds); :meth:`run` runs the rest — each other
    candidate's warm-up (its outputs, and gradients when the call trains, compared with the
    requested kernel's right away), then :data:`REPS` interleaved timed rounds. A candidate that
    raises loses. ``warm_up_s`` (every candidate's first run on these inputs: a process's first
    run of a kernel also pays its start-up) and ``timed_s`` (the probe and the timed rounds) say
    what the race took."""

    def __init__(
        self,
        impls: dict[str, Impl],
        params: tuple[str, ...],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        call: Call,
    ) -> None:
        self.impls = impls
        self.call = call
        self.inputs = _Inputs(params, args, kwargs, call)
        self.grad_out: Tensor | None = None
        self.steps: dict[str, Callable[[], Any]] = {}
        self.errors: dict[str, str] = {}
        self.diffs: dict[str, tuple[float, float | None]] = {REQUESTED: (0.0, None)}
        self.ref: tuple[Tensor, list[Tensor] | None] | None = None
        self.warm_up_s = 0.0
        self.timed_s = 0.0
        self.probe_s = math.inf

    def probe(self) -> float:
        """Seconds of one warm run of the requested kernel. Raises what the kernel raises."""
        with warnings.catch_warnings():
            # a candidate's refusal ("Flash attention kernel not used because ...") is
            # measured, not printed: the program's stderr stays as it was
            warnings.simplefilter("ignore")
            t0 = _now()
            requested = self.impls[REQUESTED]
            if self.call.grad:  # one fixed random gradient of the output, the same for all
                with torch.no_grad():
                    out = _first(requested(*self.inputs.fresh()[:2]))
                g = torch.Generator(device=out.device).manual_seed(0)
                self.grad_out = torch.randn(out.shape, generator=g, device=out.device)
                self.grad_out = self.grad_out.to(out.dtype)
            a, k, leaves = self.inputs.fresh()
            step = _stepper(requested, a, k, leaves, self.grad_out)
            out, grads = step()
            t1 = _now()
            step()
            t2 = _now()
        self.warm_up_s += t1 - t0
        self.probe_s = t2 - t1
        self.timed_s += self.probe_s
        self.ref = (_first(out).detach(), [g.detach() for g in grads] if grads else None)
        self.steps[REQUESTED] = step
        return self.probe_s

    def projected_s(self) -> float:
        """What the timed rounds still to run should take (the warm-ups are not projected)."""
        return self.probe_s * REPS * len(self.impls)

    def run(self) -> dict[str, Measured]:
        """Every candidate measured (after :meth:`probe`)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, impl in self.impls.items():
                if name != REQUESTED:
                    self._warm_up(name, impl)
            times = self._rounds()
        out: dict[str, Measured] = {}
        for name in self.impls:
            if name in self.errors:
                out[name] = Measured(error=self.errors[name])
            else:
                out_diff, grad_diff = self.diffs[name]
                rounds = tuple(times[name])
                out[name] = Measured(statistics.median(rounds), out_diff, grad_diff, rounds=rounds)
        return out

    def _warm_up(self, name: str, impl: Impl) -> None:
        a, k, leaves = self.inputs.fresh()
        step = _stepper(impl, a, k, leaves, self.grad_out)
        t0 = _now()
        try:
            out, grads = step()
        except Exception as exc:  # a candidate that cannot take the call loses
            self.errors[name] = error_text(exc)
            return
        finally:
            self.warm_up_s += _now() - t0
        assert self.ref is not None
        ref_out, ref_grads = self.ref
        got = _first(out)
        out_diff = _rel_diff(got, ref_out) if got.shape == ref_out.shape else math.inf
        grad_diff = None
        if grads is not None and ref_grads is not None:
            grad_diff = max(_rel_diff(x, y) for x, y in zip(grads, ref_grads, strict=True))
        self.diffs[name] = (out_diff, grad_diff)  # the outputs themselves are not kept
        self.steps[name] = step

    def _rounds(self) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {name: [] for name in self.steps}
        order = list(self.steps)
        for rep in range(REPS):
            for name in order[rep % len(order) :] + order[: rep % len(order)]:
                t = _now()
                self.steps[name]()
                elapsed = _now() - t
                times[name].append(elapsed * 1e3)
                self.timed_s += elapsed
        return times
