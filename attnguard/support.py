"""What attnguard supports and what it is tested with: the one table.

README "Compatibility" says this table in words, and ``tests/test_package.py`` checks it against
the README, ``pyproject.toml`` (requires-python, Python classifiers, dependency floors, the
``flash`` / ``xformers`` extras), ``scripts/test.sh`` and ``.ci/run`` (the versions they install).
The windows inside which an integration patches its library are not repeated here: they are
each integration's own declaration (:data:`attnguard.integrations.REGISTRY`), read from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from .integrations import by_name


@dataclass(frozen=True)
class Component:
    name: str  # as on PyPI ("python" for the interpreter)
    supported: str  # the version specifier attnguard declares
    tested: tuple[str, ...]  # exact versions a test run used
    how: str  # what ran on those versions


def window(integration: str) -> str:
    """An integration's window as a specifier: ``">=2.6,<3"``."""
    return by_name(integration).window()  # type: ignore[attr-defined, no-any-return]


# transformers releases CI runs (.ci/run): the full suite, the smoke suite, the version gate
TRANSFORMERS_FULL = ("4.49.0",)
TRANSFORMERS_SMOKE = (
    *("4.50.3", "4.51.3", "4.52.4", "4.53.3", "4.54.1", "4.55.4", "4.56.2", "4.57.6"),
    *("5.0.0", "5.1.0", "5.2.0", "5.3.0", "5.4.0", "5.5.4", "5.6.2", "5.7.0", "5.8.1", "5.9.0"),
    *("5.10.4", "5.11.0", "5.12.1", "5.13.1", "5.14.1", "5.15.1", "5.16.1", "5.17.0", "5.18.0"),
    *("5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0"),
)
# CI also runs the full suite on the newest release at CI time, unpinned; this is the one it
# resolved to when this table was last updated (the date is README's)
TRANSFORMERS_NEWEST = "5.24.0"
TRANSFORMERS_BELOW = "4.45.2"  # below the window: CI checks that it is not patched
TRANSFORMERS_GPU = "5.17.0"  # the GPU suite (scripts/gpu_suite.sh, docs/gpu-results.md)

DEEPSPEED = "0.19.8"  # tests/test_ranks.py's ZeRO-3 run (observed, never patched)

DIFFUSERS_CI = "0.42.1"  # scripts/test.sh
DIFFUSERS_BY_HAND = ("0.35.2", "0.37.1")  # tests/test_diffusers.py with these on the path

TORCH_CI = "2.13.0"  # CPU build: the transformers lanes (scripts/test.sh installs it where none is)
TORCH_GPU = "2.11.0"  # +cu130, the GPU image
# CI's torch lanes (.ci/run), each with the transformers it runs (the smoke suite and the tests of
# what differs between torch releases): the newest torch at CI time (unpinned; this is the one it
# resolved to when this table was last updated, with the newest transformers), the declared floor
# with the newest transformers that runs on it (5.24 refuses torch < 2.6; 5.14 is broken on 2.4),
# and one release between
TORCH_NEWEST = "2.15.0"
TORCH_LANES = (("2.4.0", "5.13.1"), ("2.8.0", "5.24.0"))
# the xformers each torch lane's test command picks (the newest release up to 0.0.35 that installs
# beside that torch: each pins the torch it was built for)
XFORMERS_FOR_OLDER_TORCH = ("0.0.27.post2", "0.0.32.post2")

MATRIX: tuple[Component, ...] = (
    # The floor is the oldest Python a test run uses: 3.10 reached its end of life in October
    # 2026, and no CPU build of the pinned torch exists for it where CI runs.
    Component("python", ">=3.11", ("3.11", "3.12"), "CI on 3.11 (CPU); the GPU suite on 3.12"),
    Component(
        "torch",
        ">=2.4",
        (TORCH_CI, TORCH_NEWEST, *(t for t, _ in TORCH_LANES), TORCH_GPU),
        "CI: 2.13.0 (CPU) in every transformers lane; the newest torch at CI time (unpinned) "
        "with the newest transformers, the floor 2.4.0 with transformers 5.13.1 and 2.8.0 with "
        "5.24.0: the smoke suite and the tests of what differs between torch releases; the GPU "
        "suite on 2.11.0",
    ),
    Component(
        "transformers",
        window("transformers"),
        (TRANSFORMERS_NEWEST, *TRANSFORMERS_FULL, *TRANSFORMERS_SMOKE),
        "CI: the full suite on 4.49.0 and on the newest release at CI time "
        "(unpinned), and the smoke suite on the newest patch of every other minor; the GPU suite "
        "on 5.17.0",
    ),
    Component(
        "flash-attn",
        window("flash_attn"),
        ("2.8.3",),
        "CI: 2.8.3 built without its CUDA extension (the broken-install case); the GPU suite: the "
        "real 2.8.3 (sm90 build)",
    ),
    Component(
        "xformers",
        window("xformers"),
        ("0.0.35", *XFORMERS_FOR_OLDER_TORCH),
        "CI: the PyPI wheel, whose ops do not run on a CPU (the unusable case); 0.0.35 needs "
        "torch >= 2.10: 0.0.27.post2 with torch 2.4.0, 0.0.32.post2 with 2.8.0",
    ),
    Component(
        "diffusers",
        window("diffusers"),
        (DIFFUSERS_CI, *DIFFUSERS_BY_HAND),
        f"CI: {DIFFUSERS_CI} with the newer transformers lanes (diffusers needs huggingface-hub "
        ">=1.32, which transformers 4.x excludes, and torch >= 2.6: its tests skip there); "
        f"{', '.join(DIFFUSERS_BY_HAND)}: the in-process diffusers tests, by hand; the GPU suite: "
        f"{DIFFUSERS_CI} where it is carried",
    ),
)

# the `kernels` package (the Hugging Face kernel hub's loader): not a dependency; scripts/test.sh
# installs, per transformers lane, the newest release that release accepts (its own bounds), else
# the newest there is; these are the versions that gave (the GPU suite: 0.16.2 for 5.17)
KERNELS_TESTED = ("0.17.2", "0.16.2", "0.15.2", "0.11.7")
MATRIX += (
    Component(
        "kernels",
        "as transformers / diffusers accept",
        KERNELS_TESTED,
        "CI: in each transformers lane with a loader of attention hub kernels (4.56 and later) "
        "the newest release that transformers accepts (its own bounds: 0.15.2 on 5.13-5.14, "
        "0.16.2 on 5.15-5.17, 0.17.2 on 5.18-5.22), else the newest there is (0.17.2 on 5.23 and "
        "5.24, which accept only 0.18.2 to 0.19: the version skew a user meets); 5.0-5.12 name "
        "only a floor and 0.17.2 breaks their import, 4.56-4.57 get 0.12.3 (huggingface-hub "
        "below 1.0), which loads no kernel from a local folder: the hub tests skip there, saying "
        "why; 0.11.7, a release diffusers refuses; the GPU suite: 0.16.2 "
        "(transformers 5.17)",
    ),
)

COMPONENTS: dict[str, Component] = {c.name: c for c in MATRIX}
