"""The Hugging Face kernel hub as a kernel source: the ``kernels`` package (installed? which
version? does the library that loads hub kernels accept it?), offline mode, the hub kernels this
machine has without network (the cache and ``LOCAL_KERNELS``), and what became of each hub
kernel a library tried to load in this process.

Whether a hub kernel loads is never guessed here and never asked of the network by attnguard:
the library that loads it (transformers, diffusers) tries, exactly as it would without attnguard,
and its integration records the outcome (:func:`record`). The decision that follows a failure —
compute it on the twins, or step aside — is :func:`attnguard.kernels.verdict`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ..observability import workload

# reason codes of a hub kernel that cannot load (observability.reasons says what each means)
HUB_PACKAGE_MISSING = "hub_package_missing"
HUB_PACKAGE_REFUSED = "hub_package_refused"
HUB_KERNEL_UNAVAILABLE = "hub_kernel_unavailable"

_TRUE = ("1", "ON", "YES", "TRUE")


def offline() -> bool:
    """huggingface_hub's offline mode (``HF_HUB_OFFLINE``, or the older
    ``TRANSFORMERS_OFFLINE``), read as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


@dataclass(frozen=True)
class HubPackage:
    """The ``kernels`` package as a library that loads hub kernels sees it."""

    version: str | None  # None: not installed
    accepted: str | None = None  # the versions that library accepts (its own bounds); None: any
    library: str = "transformers"

    def refusal(self) -> tuple[str, str] | None:
        """(reason code, why) when the library will not load hub kernels with this package."""
        if self.version is None:
            return HUB_PACKAGE_MISSING, "the `kernels` package is not installed"
        if self.accepted:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet
            from packaging.version import InvalidVersion, Version

            try:
                ok = Version(self.version) in SpecifierSet(self.accepted)
            except (InvalidSpecifier, InvalidVersion):
                return None
            if not ok:
                return (
                    HUB_PACKAGE_REFUSED,
                    f"`kernels` {self.version} is installed; {self.library} accepts only "
                    f"kernels{self.accepted}",
                )
        return None


def kernels_version() -> str | None:
    """The installed ``kernels`` package's version (metadata only, nothing imported)."""
    from .backends import dist_version

    return dist_version(("kernels",))


@dataclass(frozen=True)
class HubKernel:
    """What became of a hub kernel a library tried to load in this process."""

    repo: str
    loaded: bool
    reason_code: str = "ok"  # HUB_* when it did not load
    reason: str = ""  # why not (the library's or kernels' own error, first line)
    library: str = "transformers"


_lock = threading.Lock()
_outcomes: dict[str, HubKernel] = {}


def record(
    repo: str, error: BaseException | None, package: HubPackage, library: str = "transformers"
) -> HubKernel:
    """Remember the outcome of a library's attempt to load hub kernel ``repo``. A failure is
    classified by what kept it from loading: the package missing or refused, else the kernel
    itself (offline without a cached build, no build for this torch and device, its import)."""
    if error is None:
        outcome = HubKernel(repo, True, library=library)
    else:
        from .backends import first_line

        code, why = package.refusal() or (HUB_KERNEL_UNAVAILABLE, first_line(error))
        outcome = HubKernel(repo, False, code, why, library)
        # the exit summary's advice names the versions the library accepts
        workload.note_kernels(package.version, package.library, package.accepted)
    with _lock:
        _outcomes[repo] = outcome
    return outcome


def outcome(repo: str) -> HubKernel | None:
    """What became of ``repo`` in this process (None: nothing tried to load it yet)."""
    return _outcomes.get(repo)


def outcomes() -> tuple[HubKernel, ...]:
    with _lock:
        return tuple(_outcomes.values())


def reset(library: str | None = None) -> None:
    """Forget every outcome (tests; deactivation), or those of one ``library``'s attempts."""
    with _lock:
        for repo in [r for r, k in _outcomes.items() if library in (None, k.library)]:
            del _outcomes[repo]


@dataclass(frozen=True)
class CachedKernel:
    """A hub kernel this machine has without network: its repo and build variants (names as
    they can be shown: bytes that are no UTF-8 escaped, ``\\xff``)."""

    repo: str
    variants: tuple[str, ...]
    # "cache" (the Hugging Face cache, where `kernels` keeps its builds), "KERNELS_CACHE" (the
    # cache `kernels` uses instead when that variable is set) or "LOCAL_KERNELS"
    source: str


def _hub_cache() -> Path:
    """huggingface_hub's cache directory, found as huggingface_hub finds it."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = os.environ.get("HF_HOME")
    if home:
        return Path(home).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "huggingface" / "hub"


def kernels_cache() -> tuple[Path, str]:
    """Where the ``kernels`` package keeps the builds it downloads, as it finds it: the
    directory ``KERNELS_CACHE`` names, else the Hugging Face cache; and that source's name."""
    explicit = os.environ.get("KERNELS_CACHE")
    if explicit:
        return Path(explicit).expanduser(), "KERNELS_CACHE"
    return _hub_cache(), "cache"


def shown_name(name: str) -> str:
    """A file or variable name as text any output takes: bytes that are no UTF-8 (which Python
    holds as surrogates) escaped as ``\\xff``, so nothing fails with a codec error later."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that stands for no byte
        return name.encode("utf-8", "backslashreplace").decode("utf-8")


def _variants(root: Path) -> tuple[str, ...]:
    build = root / "build"
    try:
        return tuple(sorted(shown_name(p.name) for p in build.iterdir() if p.is_dir()))
    except OSError:
        return ()


# the cache folders of hub kernels: `kernels` >= 0.16 downloads them as repositories of type
# "kernel" (``kernels--org--name``); earlier releases as models (``models--org--name``), a layout
# later ones still read version tags from
_CACHE_LAYOUTS = ("kernels--", "models--")


def cached() -> tuple[CachedKernel, ...]:
    """The hub kernels this machine can load without network (``attnguard doctor``): each
    ``LOCAL_KERNELS`` entry, and each repository in the cache ``kernels`` uses
    (:func:`kernels_cache`) that holds builds (``snapshots/<revision>/build/<variant>``). Reads
    directory names only; a name that is no UTF-8 is escaped (:func:`shown_name`)."""
    found: list[CachedKernel] = []
    overrides = os.environ.get("LOCAL_KERNELS") or ""
    for entry in overrides.split(":"):
        repo, _, path = entry.partition("=")
        if repo and path:
            found.append(CachedKernel(shown_name(repo), _variants(Path(path)), "LOCAL_KERNELS"))
    root, source = kernels_cache()
    by_repo: dict[str, set[str]] = {}
    for layout in _CACHE_LAYOUTS:
        try:
            folders = sorted(root.glob(f"{layout}*--*"))
        except OSError:
            folders = []
        for folder in folders:
            try:
                snapshots = list((folder / "snapshots").iterdir())
            except OSError:
                continue
            variants: set[str] = set()
            for snapshot in snapshots:
                variants.update(_variants(snapshot))
            if variants:
                org, _, name = folder.name.removeprefix(layout).partition("--")
                by_repo.setdefault(shown_name(f"{org}/{name}"), set()).update(variants)
    for repo in sorted(by_repo):
        found.append(CachedKernel(repo, tuple(sorted(by_repo[repo])), source))
    return tuple(found)
