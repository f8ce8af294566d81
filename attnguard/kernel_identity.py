"""What a kernel is: its source, its family and that family's rules, never a piece of its name.

A *family* is a documented set of semantics that attnguard computes the same way with its twins
(:mod:`attnguard.fallback`): flash-attn 2's functions, flash-attn 3's, flash-attn 4's,
xformers' ``memory_efficient_attention``. A kernel whose semantics attnguard does not know
(``family`` None: a hub kernel that ships its own attention function, a repo attnguard has never
seen, one function picked by ``"org/repo:function"``, a user's registered function) is never
computed by the twins: where it cannot run, its own error stands.

How a kernel is known:

* a request by implementation name (``"flash_attention_2"``, ``"sdpa"``): the library's own names,
  each the whole name (:data:`IMPLEMENTATIONS`);
* a hub kernel that did not load: only its repository, matched whole against the repositories
  whose builds are flash-attn's own functions (:data:`HUB_REPOS`);
* a hub kernel that loaded: the functions its module exports and their signatures
  (:func:`of_hub_module`), whatever its repository is called;
* a function in transformers' attention registry: the object itself (the integration compares
  it with transformers' own functions).
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class Family(StrEnum):
    """Semantics attnguard knows; the words events and docs use."""

    FA2 = "flash-attn 2"
    FA3 = "flash-attn 3"
    FA4 = "flash-attn 4"
    XFORMERS = "xformers"
    SDPA = "sdpa"  # the library's sdpa implementation (transformers', diffusers' native)
    EAGER = "eager"
    FLEX = "flex_attention"
    PAGED = "paged"  # transformers' paged entries: they update the cache inside (never re-run)


FLASH_FAMILIES = frozenset({Family.FA2, Family.FA3, Family.FA4})
# families whose functions take dropout (flash-attn 3 and 4 have no dropout_p: transformers
# never hands them dropout, and neither do their twins)
DROPOUT_FAMILIES = frozenset({Family.FA2, Family.XFORMERS, Family.SDPA, Family.EAGER})


class Source(StrEnum):
    PACKAGE = "package"  # a pip package: flash-attn, flash-attn 3 / 4, xformers
    HUB = "hub"  # a repository of the Hugging Face kernel hub, loaded by the `kernels` package
    LIBRARY = "library"  # the library's own implementation (transformers' sdpa / eager / flex)
    USER = "user"  # a function someone registered, or anything attnguard did not recognise
    TWIN = "twin"  # attnguard's twin of a family


@dataclass(frozen=True)
class KernelId:
    """What a kernel is. ``name``: as requested or registered (``"flash_attention_2"``,
    ``"kernels-community/flash-attn2"``); ``family`` None: semantics attnguard does not know;
    ``sinks``: its functions take per-head attention-sink logits (``s_aux``)."""

    name: str
    source: Source
    family: Family | None
    sinks: bool = False

    @property
    def computable(self) -> bool:
        """attnguard's twins compute this kernel's semantics."""
        return self.family in FLASH_FAMILIES or self.family is Family.XFORMERS

    @property
    def flash(self) -> bool:
        """Its functions are one of flash-attn's families."""
        return self.family in FLASH_FAMILIES

    @property
    def major(self) -> int | None:
        """flash-attn's major version whose functions it has (2, 3, 4), else None."""
        return _MAJOR.get(self.family) if self.family is not None else None

    def describe(self) -> str:
        if self.family is None:
            return f"{self.name} (its own semantics, unknown to attnguard)"
        return f"{self.name} ({self.family.value})"


_MAJOR = {Family.FA2: 2, Family.FA3: 3, Family.FA4: 4}

# transformers' implementation names, each whole (a ``"paged|..."`` prefix is transformers' paged
# variant of the one after it)
IMPLEMENTATIONS: dict[str, tuple[Source, Family]] = {
    "flash_attention_2": (Source.PACKAGE, Family.FA2),
    "flash_attention_3": (Source.PACKAGE, Family.FA3),
    "flash_attention_4": (Source.PACKAGE, Family.FA4),
    "sdpa": (Source.LIBRARY, Family.SDPA),
    "eager": (Source.LIBRARY, Family.EAGER),
    "flex_attention": (Source.LIBRARY, Family.FLEX),
}

# Hub repositories whose builds are flash-attn's own functions (their names, arguments and
# numbers): the one thing known of a hub kernel that did not load. Matched whole.
HUB_REPOS: dict[str, KernelId] = {
    repo: KernelId(repo, Source.HUB, family, sinks)
    for repo, family, sinks in (
        ("kernels-community/flash-attn", Family.FA2, False),
        ("kernels-community/flash-attn2", Family.FA2, False),
        ("kernels-community/flash-attn3", Family.FA3, False),
        ("kernels-community/vllm-flash-attn3", Family.FA3, True),
        ("kernels-community/flash-attn4", Family.FA4, False),
    )
}

# transformers' own pattern of a hub kernel name: "org/repo", "org/repo@revision",
# "org/repo:function" (a "paged|" prefix names its paged variant)
_HUB_NAME = re.compile(r"^([^/:@|]+/[^/:@|]+)(?:@[^/:]+)?(?::([^/:]+))?$")


def bare(name: str) -> str:
    """``name`` without transformers' ``"paged|"`` prefix."""
    return name.strip().split("|", 1)[-1]


def hub_repo(name: object) -> str | None:
    """The hub repository a kernel name names (``"org/repo"``), or None when it is no hub
    kernel name (``"flash_attention_2"``, ``"sdpa"``, a dict)."""
    if not isinstance(name, str):
        return None
    found = _HUB_NAME.match(bare(name))
    return found.group(1) if found else None


def hub_function(name: str) -> str | None:
    """The single function a name picks from its repo (``"org/repo:function"``), else None."""
    found = _HUB_NAME.match(bare(name))
    return found.group(2) if found else None


def of_request(name: object) -> KernelId | None:
    """What a requested implementation is, from the whole name (None: not a name transformers
    or the kernel hub knows, e.g. a key a user registered: its function says what it is)."""
    if not isinstance(name, str):
        return None
    key = bare(name)
    paged = key != name.strip()
    known = IMPLEMENTATIONS.get(key)
    if known is not None:
        source, family = known
        return KernelId(name, source, Family.PAGED if paged else family)
    repo = hub_repo(key)
    if repo is None:
        return None
    if paged:
        return KernelId(name, Source.HUB, Family.PAGED)
    found = HUB_REPOS.get(repo)
    if found is None or hub_function(key) is not None:
        return KernelId(key, Source.HUB, None)  # its semantics: unknown until it loads
    return KernelId(key, Source.HUB, found.family, found.sinks)


def is_flash_request(name: object) -> bool:
    """A request whose kernel is one of flash-attn's families (``flash_attention_2/3/4``, a hub
    repo whose builds are flash-attn's functions); never a paged variant."""
    found = of_request(name)
    return found is not None and found.flash


def _parameters(fn: Any) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def of_hub_module(name: str, module: Any) -> KernelId:
    """What a hub kernel that loaded is, from the functions its module exports: flash-attn's
    ``flash_attn_varlen_func`` (flash-attn 2's takes ``dropout_p``; 3's takes ``qv`` /
    ``num_splits`` and no dropout; 4's takes neither: read from its signature, its repository
    confirming), or its own attention function (``flash_attn_forward``, a block-sparse
    ``sparse_atten_func``, one picked by ``:function``): semantics unknown to attnguard."""
    key = bare(name)
    varlen = getattr(module, "flash_attn_varlen_func", None)
    if hub_function(key) is not None or not callable(varlen):
        return KernelId(key, Source.HUB, None)
    params = _parameters(varlen)
    sinks = "s_aux" in params
    known = HUB_REPOS.get(hub_repo(key) or "")
    if "dropout_p" in params:
        family: Family | None = Family.FA2
    elif {"qv", "num_splits"} & params:
        family = Family.FA3
    elif known is not None and known.family is Family.FA4:
        family = Family.FA4
    else:
        family = None
    if known is not None and family is not None and known.family is not family:
        family = None  # the build and its repository disagree: trust neither
    return KernelId(key, Source.HUB, family, sinks)
