"""``attnguard doctor``'s view of diffusers: each attention backend, whether diffusers can use it
here, and what computes its calls under attnguard."""

from __future__ import annotations

import importlib
from typing import Any

from . import INTEGRATION, hub, shape


def describe() -> dict[str, Any]:
    """``{"version", "supported", "recognised", "backends": [{name, package, usable, why,
    under_attnguard}]}``; ``{"installed": False}`` without diffusers."""
    from importlib import metadata

    try:
        version = metadata.version("diffusers")
    except metadata.PackageNotFoundError:
        return {"installed": False}
    out: dict[str, Any] = {"installed": True, "version": version}
    out["outside_window"] = INTEGRATION.supports(version)
    try:
        module = importlib.import_module("diffusers.models.attention_dispatch")
    except Exception as exc:  # diffusers itself does not import here
        out["import_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return out
    why = shape.unrecognised(module)
    out["recognised"] = why is None
    if why is not None:
        out["why"] = why
        return out
    check = module._check_attention_backend_requirements
    check = getattr(check, "__attnguard_original__", check)
    rows = []
    for name, key in sorted(shape.backends(module).items()):
        try:
            check(key)
            usable, reason = True, ""
        except Exception as exc:
            usable, reason = False, (str(exc).strip().splitlines() or [""])[0][:160]
        rows.append(
            {
                "name": name,
                "package": shape.PACKAGES.get(name, "torch"),
                "usable": usable,
                "why": reason,
                "under_attnguard": _under_attnguard(name, usable, module),
            }
        )
    out["backends"] = rows
    return out


def _under_attnguard(name: str, usable: bool, module: Any) -> str:
    if hub.is_hub(module, name):
        return hub.describe(module, name, usable)
    if usable:
        if name in shape.GUARDED:
            return "as requested; per call: dtypes, devices, known kernel errors"
        return "as requested (not guarded per call)"
    twinned = shape.TWINNED.get(name)
    if twinned is not None:
        return f"attnguard's twin of {twinned.function} (torch SDPA)"
    return "diffusers' own error (no twin)"


def lines(data: dict[str, Any]) -> list[str]:
    """The doctor's text for :func:`describe`'s answer."""
    window = INTEGRATION.window()
    if not data.get("installed"):
        return [f"  diffusers not installed (attnguard guards diffusers {window})"]
    head = f"  diffusers {data['version']}"
    if data.get("outside_window"):
        return [f"{head}: {data['outside_window']}; not guarded"]
    if "import_error" in data:
        return [f"{head}: its attention dispatch does not import ({data['import_error']})"]
    if not data.get("recognised"):
        return [f"{head}: dispatch not recognised ({data['why']}); not guarded"]
    out = [
        f"{head} (attnguard guards {window}); usable: diffusers' requirements check passes "
        "(its message in doctor --json)"
    ]
    rows = data["backends"]
    widths = [max(len(str(r[k])) for r in rows) for k in ("name", "package")]
    for r in rows:
        usable = "yes" if r["usable"] else "no "
        out.append(
            f"  {r['name']:<{widths[0]}}  {r['package']:<{widths[1]}}  usable {usable}  "
            f"-> {r['under_attnguard']}"
        )
    return out
