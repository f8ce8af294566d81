"""Exit 0 when a requirement and everything it needs (with its own extras, if it names any) are
installed on ``sys.path``;
else exit 1 and name what is missing. ``scripts/test.sh`` runs it with a ``.test-deps/``
directory on ``PYTHONPATH`` to decide whether that directory still completes this environment
(it holds only what the environment lacked when it was made).

    PYTHONPATH=.test-deps/deepspeed-0.19.8-py311 python scripts/requirements_met.py deepspeed==0.19.8
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement


def unmet(root: str) -> list[str]:
    """What is missing for ``root``: its requirements and theirs, with the root's extras (the
    requirements' own extras are not followed)."""
    first = Requirement(root)
    todo, seen, missing = [first], set(), []
    while todo:
        req = todo.pop()
        key = req.name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        extras = sorted(req.extras) if req is first else []
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            missing.append(str(req))
            continue
        if not req.specifier.contains(version, prereleases=True):
            missing.append(f"{req} (found {version})")
            continue
        for line in metadata.requires(req.name) or []:
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
