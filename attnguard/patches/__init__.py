"""One module per patched library, each a ``patch(module)`` / ``unpatch()`` pair with a ledger.

Each patch module is imported only when its library is imported (a post-import hook on the
target module below), so activating attnguard imports neither torch nor any patched library.
An integration may have several parts, each a patch module with its own trigger: transformers'
availability checks are patched as soon as ``transformers.utils.import_utils`` exists, before
``transformers.utils`` binds their names and long before ``transformers.modeling_utils`` (whose
import runs those checks on 4.49-4.54) triggers the rest.

Each integration declares once the versions of its library it supports (the ones CI tests, see
README "Compatibility"); outside them it does not patch and one ``observed`` event
(``version_unsupported``) says why: no guessing on internals never tested.
"""

from __future__ import annotations

import re

from ..integrations import diffusers as _diffusers  # its facts stay in its package

# integration name (as in ATTNGUARD_DISABLE) -> its parts, in patch order:
# (patch module, import that triggers its patch)
INTEGRATIONS: dict[str, tuple[tuple[str, str], ...]] = {
    "transformers": (
        ("attnguard.patches.transformers_availability", "transformers.utils.import_utils"),
        ("attnguard.patches.transformers", "transformers.modeling_utils"),
    ),
    "flash_attn": (("attnguard.patches.flash_attn", "flash_attn"),),
    "xformers": (("attnguard.patches.xformers", "xformers.ops"),),
    # its own package (attnguard.integrations.diffusers); after flash_attn and xformers, whose
    # guarded functions it binds where diffusers imported the originals
    "diffusers": ((_diffusers.PATCH_MODULE, _diffusers.TRIGGER),),
}

# integration name -> (distribution, lowest supported version, first unsupported version)
SUPPORTED = {
    "transformers": ("transformers", (4, 49), (6,)),
    "flash_attn": ("flash-attn", (2, 6), (3,)),
    "xformers": ("xformers", (0, 0, 27), (0, 1)),
    "diffusers": _diffusers.SUPPORTED,
}


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version string: ``"5.0.0.dev0"`` -> (5, 0, 0), ``"2.8.3.post2"``
    -> (2, 8, 3). A pre-release counts as its release (6.0.0rc1 is 6.0: unsupported)."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def minor_release(dist: str) -> tuple[int, int] | None:
    """(major, minor) of an installed distribution, from its metadata; None when unknown."""
    from importlib import metadata

    try:
        numbers = release(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return None
    return (numbers + (0,))[:2] if numbers else None


def spelled(numbers: tuple[int, ...]) -> str:
    return ".".join(map(str, numbers))


def unsupported(name: str, version: str | None) -> str | None:
    """Why ``name`` at ``version`` is outside what the integration supports, or None when it is
    supported. An unknown version (no metadata, unparsable) is not guessed at: unsupported."""
    dist, low, high = SUPPORTED[name]
    window = f">={spelled(low)},<{spelled(high)}"
    numbers = release(version or "")
    if not numbers:
        return f"{dist} has no readable version ({version!r}); this integration supports {window}"
    if low <= numbers < high:
        return None
    return f"{dist} {version} is outside the versions this integration supports ({window})"
