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
        usable: bool | None
        try:
            check(key)
            usable, reason = True, ""
        except Exception as exc:
            usable, reason = False, (str(exc).strip().splitlines() or [""])[0][:160]
        if usable and hub.is_hub(module, name):  # diffusers checks the package, not the kernel
            usable, reason = _hub_kernel_here(module, name)
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


def _hub_kernel_here(module: Any, name: str) -> tuple[bool | None, str]:
    """Whether backend ``name``'s hub kernel can load here, from what this machine has without
    network (nothing is fetched): True where it loaded in this process or a build is in the cache
    or LOCAL_KERNELS; False where it did not load, or offline with no build here; None where it
    would be downloaded when chosen."""
    from ...facts import hub as hub_facts

    repo = shape.hub_configs(module)[name].repo_id
    found = hub_facts.outcome(repo)
    if found is not None:
        return found.loaded, "loaded in this process" if found.loaded else found.reason
    if any(k.repo == repo for k in hub_facts.cached()):
        return True, f"a build of {repo} is on this machine (cache or LOCAL_KERNELS)"
    if hub_facts.offline():
        return False, (
            f"offline (HF_HUB_OFFLINE) and no build of {repo} in the cache or LOCAL_KERNELS: "
            "it cannot load here"
        )
    return None, f"no build of {repo} on this machine: diffusers downloads it when chosen"


def _under_attnguard(name: str, usable: bool | None, module: Any) -> str:
    if hub.is_hub(module, name):
        return hub.describe(module, name, usable is not False)
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
        "and, for a *_hub backend, its hub kernel loaded or a build of it is on this machine "
        "(cache, LOCAL_KERNELS); fetch: a *_hub kernel diffusers would download when chosen "
        "(the reasons in doctor --json)"
    ]
    rows = data["backends"]
    widths = [max(len(str(r[k])) for r in rows) for k in ("name", "package")]
    for r in rows:
        usable = {True: "yes  ", False: "no   ", None: "fetch"}[r["usable"]]
        out.append(
            f"  {r['name']:<{widths[0]}}  {r['package']:<{widths[1]}}  usable {usable}  "
            f"-> {r['under_attnguard']}"
        )
    return out
