"""Does a kernel's output match its reference? The tolerance, and the three measures.

The tolerance of one call, for the call's dtype with unit roundoff ``u`` (bfloat16 2^-8,
float16 2^-11, float32 2^-17 — or 2^-11 on a CUDA device where float32 matmuls may run in TF32 —,
float64 2^-40), its largest value magnitude ``V = max |v|`` and ``L`` keys per query (the
accumulation length)::

    bound(e) = atol + rtol * |ref(e)| + allowance(e)
    atol     = V * (4u + 4 * sqrt(L) * 2^-24)       rtol = 4u

``4u`` covers the two roundings every fused kernel makes (the probabilities rounded to the dtype
before they meet ``v``: at most ``u * V``; the output rounded: ``u * |o|``) with a factor of 2 to
spare; ``sqrt(L) * 2^-24`` the float32 accumulation over ``L`` keys; ``allowance`` is the explicit
reference's measure of a kernel that rounds the scores themselves (:mod:`.explicit`; 0 where the
reference is a twin: flash-attn's and xformers' kernels keep scores in float32). A call matches
when all three hold:

* **element-wise**: ``|out - ref| <= bound`` for every element (``ratio``, the largest
  ``|out - ref| / bound``, at most 1); an element the reference leaves undefined (a row SDPA masks
  entirely) is not compared, a non-finite output where the reference is finite fails;
* **relative norm of the difference**: ``||out - ref|| / ||ref|| <= ||bound|| / (2 ||ref||)``
  (a kernel's rounding errors are spread, so their norm stays well inside the bound's, while a
  wrong kernel's errors fill it);
* **correlation** (Pearson, of the centred outputs) ``>= 0.99``, asked only where the reference
  varies well above the tolerance (``rms(bound) <= 0.1 * std(ref)``): it catches an output that
  passes loose element-wise checks around a large common offset yet carries none of the
  reference's variation (a kernel "correlating 0.13").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor

UNIT_ROUNDOFF = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
    torch.float32: 2.0**-17,
    torch.float64: 2.0**-40,
}
TF32_ROUNDOFF = 2.0**-11
MIN_CORRELATION = 0.99


def unit_roundoff(dtype: torch.dtype, device: torch.device) -> float:
    """``u`` of the call's dtype (float32 on a CUDA device where TF32 matmuls are allowed: TF32's)."""
    u = UNIT_ROUNDOFF.get(dtype, 2.0**-8)
    if dtype is torch.float32 and device.type == "cuda" and tf32_allowed():
        return TF32_ROUNDOFF
    return u


def tf32_allowed() -> bool:
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32) or (
            torch.get_float32_matmul_precision() != "highest"
        )
    except Exception:
        return True


@dataclass(frozen=True)
class Outcome:
    """The measures of one comparison (plain floats: they go into an event)."""

    ok: bool
    failed: tuple[str, ...]  # which of "elementwise", "rel_norm", "correlation" failed
    max_error: float
    mean_error: float
    ratio: float  # the largest |out - ref| / bound
    rel_norm: float
    rel_norm_tol: float
    correlation: float | None  # None: the reference does not vary enough to ask
    atol: float
    rtol: float
    compared: int  # elements compared

    def fields(self) -> dict[str, object]:
        return {
            "max_error": _round(self.max_error),
            "mean_error": _round(self.mean_error),
            "rel_norm": _round(self.rel_norm),
            "correlation": None if self.correlation is None else _round(self.correlation),
            "tolerance": {
                "atol": _round(self.atol),
                "rtol": _round(self.rtol),
                "rel_norm": _round(self.rel_norm_tol),
                "correlation": MIN_CORRELATION,
                "worst_element_ratio": _round(self.ratio),
            },
            "failed": list(self.failed),
        }


def _round(x: float) -> float:
    return float(f"{x:.4g}") if math.isfinite(x) else x


CHUNK = 1 << 22  # elements compared at once: float64 temporaries of 32 MiB each


def compare(
    out: Tensor, ref: Tensor, allowance: Tensor | None, *, u: float, vmax: float, keys: int
) -> Outcome:
    """Compare ``out`` (the kernel's) with ``ref`` within the tolerance, a chunk at a time."""
    if out.shape != ref.shape:
        raise ValueError(
            f"output shape {tuple(out.shape)} is not the reference's {tuple(ref.shape)}"
        )
    o_all, r_all = out.detach().reshape(-1), ref.detach().reshape(-1)
    a_all = allowance.detach().reshape(-1) if allowance is not None else None
    atol = vmax * (4 * u + 4 * math.sqrt(max(keys, 1)) * 2.0**-24)
    rtol = 4 * u
    total = o_all.numel()
    n = 0
    ratio = max_error = err_sum = 0.0
    sq = {"diff": 0.0, "ref": 0.0, "bound": 0.0}
    sums = [0.0, 0.0]  # of ref and out where defined: the means the correlation centres on
    for c0 in range(0, total, CHUNK):
        o, r, bound, defined = _chunk(o_all, r_all, a_all, c0, atol, rtol)
        diff = torch.where(torch.isfinite(o), (o - r).abs(), torch.inf)
        diff = torch.where(defined, diff, 0.0)
        n += int(defined.sum())
        ratio = max(ratio, float((diff / bound).amax()))
        max_error = max(max_error, float(diff.amax()))
        err_sum += float(diff.sum())
        r0 = torch.where(defined, r, 0.0)
        sq["diff"] += float((diff * diff).sum())
        sq["ref"] += float((r0 * r0).sum())
        sq["bound"] += float(torch.where(defined, bound * bound, 0.0).sum())
        sums[0] += float(r0.sum())
        sums[1] += float(torch.where(defined & torch.isfinite(o), o, 0.0).sum())
    ref_norm, diff_norm, bound_norm = (math.sqrt(sq[k]) for k in ("ref", "diff", "bound"))
    rel_norm = diff_norm / ref_norm if ref_norm > 0 else (0.0 if diff_norm == 0 else math.inf)
    rel_norm_tol = bound_norm / (2 * ref_norm) if ref_norm > 0 else math.inf
    correlation = None
    if n > 1 and math.isfinite(max_error):
        correlation = _correlation(o_all, r_all, a_all, atol, rtol, sums, n, bound_norm)
    failed = []
    if not ratio <= 1.0:
        failed.append("elementwise")
    if not rel_norm <= rel_norm_tol:
        failed.append("rel_norm")
    if correlation is not None and not correlation >= MIN_CORRELATION:
        failed.append("correlation")
    return Outcome(
        ok=not failed,
        failed=tuple(failed),
        max_error=max_error,
        mean_error=err_sum / n if n else 0.0,
        ratio=ratio,
        rel_norm=rel_norm,
        rel_norm_tol=rel_norm_tol,
        correlation=correlation,
        atol=atol,
        rtol=rtol,
        compared=n,
    )


def _chunk(
    o_all: Tensor, r_all: Tensor, a_all: Tensor | None, c0: int, atol: float, rtol: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One chunk in float64: (out, ref, bound, where the reference is defined)."""
    o = o_all[c0 : c0 + CHUNK].to(torch.float64)
    r = r_all[c0 : c0 + CHUNK].to(torch.float64)
    bound = atol + rtol * r.abs()
    if a_all is not None:
        bound = bound + a_all[c0 : c0 + CHUNK].to(torch.float64)
    return o, r, bound.clamp_min(1e-300), torch.isfinite(r)


def _correlation(
    o_all: Tensor,
    r_all: Tensor,
    a_all: Tensor | None,
    atol: float,
    rtol: float,
    sums: list[float],
    n: int,
    bound_norm: float,
) -> float | None:
    """Pearson's correlation of the defined elements (a second, centred pass), or None where the
    reference does not vary well above the tolerance."""
    mean_r, mean_o = sums[0] / n, sums[1] / n
    rr = oo = ro = 0.0
    for c0 in range(0, o_all.numel(), CHUNK):
        o, r, _, defined = _chunk(o_all, r_all, a_all, c0, atol, rtol)
        rc = torch.where(defined, r - mean_r, 0.0)
        oc = torch.where(defined & torch.isfinite(o), o - mean_o, 0.0)
        rr += float((rc * rc).sum())
        oo += float((oc * oc).sum())
        ro += float((rc * oc).sum())
    std = math.sqrt(rr / n)
    if std <= 0 or bound_norm / math.sqrt(n) > 0.1 * std:
        return None
    return ro / math.sqrt(rr * oo) if rr > 0 and oo > 0 else 0.0
