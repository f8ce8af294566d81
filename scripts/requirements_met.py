"""Exit 0 when a requirement and everything it needs (with its own extras, if it names any) are
installed on ``sys.path``;
else exit 1 and name what is missing. ``scripts/testenv.py`` calls :func:`unmet` to decide whether
an environment already holds what the test command would install (and then installs nothing).

    PYTHONPATH=.test-deps/deepspeed-0.19.8-py311-... python scripts/requirements_met.py deepspeed==0.19.8
"""

from __future__ import annotations

import sys
from importlib import metadata

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv (the test command's first run): pip's own copy
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]


def unmet(root: str, path: list[str] | None = None) -> list[str]:
    """What is missing for ``root`` along ``path`` (default ``sys.path``): its requirements and
    theirs, with the root's extras (the requirements' own extras are not followed)."""
    first = Requirement(root)
    todo, seen, missing = [first], set(), []
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        extras = sorted(req.extras) if req is first else []
        dist = next(iter(metadata.distributions(name=req.name, path=path or sys.path)), None)
        if dist is None:
            missing.append(str(req))
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            missing.append(f"{req} (found {dist.version})")
            continue
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(
                dep.marker.evaluate({"extra": extra}) for extra in ["", *extras]
            ):
                todo.append(dep)
    return missing


if __name__ == "__main__":
    missing = unmet(sys.argv[1])
    for item in missing:
        print(f"not installed: {item}")
    sys.exit(1 if missing else 0)
