"""A kernel is known by what it is — its source, its family and that family's functions — never
by a piece of its name; a failed hub load is tried again whenever the library tries again.

Direct (no subprocess, any release): what :mod:`attnguard.kernel_identity` makes of requests, hub
kernel modules and registry functions, and :func:`attnguard.kernels.verdict`'s table. End to end
(fresh interpreters with the real ``kernels`` package and stand-in hub kernels served through
``LOCAL_KERNELS``, where this transformers accepts a ``kernels`` release that loads them): a hub
kernel named like a flash kernel that ships its own attention function gives its own numbers
guarded as unguarded; a hub kernel that could not load and then can is served by the kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from helpers.packages import hub_standin, local_kernels_unservable
from helpers.processes import PY, REPO, subprocess_env

from attnguard import kernel_identity as kid
from attnguard import kernels
from attnguard.kernel_identity import Family, KernelId, Source

WORKER = REPO / "tests" / "workers" / "hub_identity_worker.py"
KERNELS = os.environ.get("TEST_KERNELS_DIR")


# --- what a request is -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "source", "family", "flash"),
    [
        ("flash_attention_2", Source.PACKAGE, Family.FA2, True),
        ("flash_attention_3", Source.PACKAGE, Family.FA3, True),
        ("flash_attention_4", Source.PACKAGE, Family.FA4, True),
        ("paged|flash_attention_2", Source.PACKAGE, Family.PAGED, False),
        ("sdpa", Source.LIBRARY, Family.SDPA, False),
        ("kernels-community/flash-attn2", Source.HUB, Family.FA2, True),
        ("kernels-community/flash-attn2@v3", Source.HUB, Family.FA2, True),
        ("kernels-community/vllm-flash-attn3", Source.HUB, Family.FA3, True),
        ("kernels-community/flash-attn4", Source.HUB, Family.FA4, True),
        # named like a flash kernel, but nothing says what it computes
        ("kernels-community/flash-local", Source.HUB, None, False),
        ("acme/flash-attn2", Source.HUB, None, False),
        ("kernels-community/flash-attn2:flash_attn_func", Source.HUB, None, False),
    ],
)
def test_a_request_is_known_by_its_whole_name(name, source, family, flash) -> None:
    found = kid.of_request(name)
    assert found is not None
    assert (found.source, found.family, found.flash) == (source, family, flash)
    assert kid.is_flash_request(name) is flash


def test_names_nobody_defined_are_nothing() -> None:
    assert kid.of_request("my_flash_attention") is None  # a user's key: its function says
    assert kid.of_request(None) is None


def _module(**functions: Any) -> SimpleNamespace:
    return SimpleNamespace(**functions)


def _fa2_varlen(q, k, v, cu_q, cu_k, mq, mk, dropout_p=0.0, softmax_scale=None, causal=False):
    raise AssertionError


def _fa3_varlen(q, k, v, cu_q, cu_k, mq, mk, seqused_q=None, softmax_scale=None, qv=None):
    raise AssertionError


def _own_forward(module, query, key, value, attention_mask, **kwargs):
    raise AssertionError


@pytest.mark.parametrize(
    ("name", "module", "family"),
    [
        # known by the functions it exports, its repository confirming
        ("kernels-community/flash-attn2", _module(flash_attn_varlen_func=_fa2_varlen), Family.FA2),
        ("kernels-community/flash-attn3", _module(flash_attn_varlen_func=_fa3_varlen), Family.FA3),
        ("acme/any-name", _module(flash_attn_varlen_func=_fa2_varlen), Family.FA2),
        # its own attention function: semantics unknown, whatever the repository is called
        (
            "kernels-community/flash-attn2",
            _module(flash_attn_forward=_own_forward, supports_flash_attn=True),
            None,
        ),
        ("kernels-community/flash-local", _module(flash_attn_forward=_own_forward), None),
        # a build that contradicts its repository: trusted for nothing
        ("kernels-community/flash-attn3", _module(flash_attn_varlen_func=_fa2_varlen), None),
    ],
)
def test_a_loaded_hub_kernel_is_known_by_what_it_exports(name, module, family) -> None:
    assert kid.of_hub_module(name, module).family is family


# --- the registry: by the function an entry holds -------------------------------------------------


def test_registry_entries_are_judged_by_the_function_they_hold() -> None:
    pytest.importorskip("transformers")
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from attnguard.integrations.transformers import attention
    from attnguard.kernels import EntryKind

    kind = attention.registry_kind
    assert kind("flash_attention_2", flash_attention_forward) == EntryKind.REGISTRY_FLASH
    assert (
        kind("kernels-community/flash-attn2", flash_attention_forward) == EntryKind.REGISTRY_FLASH
    )
    assert kind("sdpa", sdpa_attention_forward) == EntryKind.REGISTRY_SDPA
    # a hub kernel's own attention function, named like a flash kernel: untouched
    assert kind("kernels-community/flash-local", _own_forward) is None
    # transformers' flash path over a hub kernel attnguard knows nothing of: untouched
    assert kind("acme/flash-attn2", flash_attention_forward) is None
    # a user's function under a flash-like key: dtypes and devices only, never the flash twin
    assert kind("my_flash_attention", _own_forward) == EntryKind.REGISTRY_OTHER
    assert kind("paged|flash_attention_2", flash_attention_forward) == EntryKind.REGISTRY_PAGED


# --- the verdict, table-driven ----------------------------------------------------------------------

FA2_HUB = kid.of_request("kernels-community/flash-attn2")
OWN_HUB = KernelId("kernels-community/flash-local", Source.HUB, None)
FLASH_BACKEND = KernelId("flash", Source.PACKAGE, Family.FA2)
CANNOT = ("hub_kernel_unavailable", "offline without a cached build")


@pytest.mark.parametrize(
    ("kernel", "cannot", "extra", "twins", "rule", "code"),
    [
        (FA2_HUB, None, {}, False, "hub-kernel-tried", "ok"),
        (OWN_HUB, None, {}, False, "hub-kernel-tried", "ok"),
        (FA2_HUB, CANNOT, {}, True, "hub-on-sdpa", "hub_kernel_unavailable"),
        (OWN_HUB, CANNOT, {}, False, "hub-aside", "hub_kernel_unavailable"),
        (FA2_HUB, CANNOT, {"path_problem": "x"}, False, "hub-aside", "flash_path_unrecognised"),
        (
            FA2_HUB,
            CANNOT,
            {"uncomputed": ("s_aux",)},
            False,
            "hub-aside",
            "flash_argument_uncomputed",
        ),
        (
            FLASH_BACKEND,
            ("backend_package_unusable", "missing"),
            {"library": "diffusers", "function": "flash_attn_func"},
            True,
            "package-on-sdpa",
            "backend_package_unusable",
        ),
        (
            FLASH_BACKEND,
            ("backend_package_unusable", "missing"),
            {"library": "diffusers"},
            False,
            "no-twin",
            "backend_package_unusable",
        ),
    ],
)
def test_the_verdict(kernel, cannot, extra, twins, rule, code) -> None:
    assert kernel is not None
    found = kernels.verdict(kernel, cannot, **extra)
    assert (found.twins, found.rule, found.reason_code) == (twins, rule, code)
    assert found.event == ("" if cannot is None else "backend_fallback" if twins else "observed")
    if not twins and cannot is not None:
        assert "stands" in found.reason  # its own error: said so
    if twins and kernel.source is Source.HUB:
        assert kernel.family is not None and kernel.family.value in found.reason
    elif twins:  # a library's backend: the function its code calls
        assert extra["function"] in found.reason


def test_every_rule_the_verdict_gives_is_in_the_table() -> None:
    assert {r[0] for r in kernels.RULES} >= {
        kernels.SERVES,
        kernels.HUB_TWINS,
        kernels.HUB_ASIDE,
        kernels.PACKAGE_TWINS,
        kernels.NO_TWIN,
    }


# --- end to end: the stand-ins, guarded and unguarded -------------------------------------------------


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    why = local_kernels_unservable()
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("hub-identity")
    env = subprocess_env(HF_HUB_OFFLINE="1", TQDM_DISABLE="1")
    subprocess.run([PY, str(WORKER), "make", str(root)], env=env, check=True, timeout=300)
    return root


def _program(root: Path, mode: str, scenario: str, local: str, **extra: str) -> dict[str, Any]:
    calls = root / f"calls-{mode}-{scenario}"
    calls.unlink(missing_ok=True)
    env = subprocess_env(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TQDM_DISABLE="1",
        HF_HOME=str(root / "hf-home"),  # empty: nothing cached
        HUB_STANDIN_CALLS=str(calls),
        LOCAL_KERNELS=local,
        ATTNGUARD_LOG="none",
        **extra,
    )
    env["PYTHONPATH"] = os.pathsep.join([str(KERNELS), env["PYTHONPATH"]])
    args = [PY, str(WORKER), "run", mode, str(root), str(root), scenario]
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.splitlines()[-1])


def _registers_own_functions() -> bool:
    """Does this transformers' loader register a hub kernel's own attention function
    (``flash_attn_forward`` with ``supports_flash_attn``)? Read from the loader's code: releases
    before it have no such branch (their loader fails on such a kernel, guarded or not)."""
    import transformers.integrations.hub_kernels as hub_kernels

    loader = getattr(hub_kernels, "load_and_register_attn_kernel", None)
    names = getattr(getattr(loader, "__code__", None), "co_names", ())
    return "supports_flash_attn" in names and "flash_attn_forward" in names


@pytest.mark.smoke
def test_a_hub_kernel_with_its_own_attention_function_gives_its_own_numbers(root: Path) -> None:
    """Named like a flash kernel, shipping its own attention function: it computes every call,
    padded and packed ones included, guarded exactly as unguarded (attnguard used to reroute each
    padded call to its flash twin: 0.13 off for a local-window kernel)."""
    if not _registers_own_functions():
        pytest.skip("this transformers' loader registers no hub kernel's own attention function")
    repo = hub_standin().write_repo(root / "flash-local", name="flash-local", interface="own")
    local = f"kernels-community/flash-local={repo}"
    plain = _program(root, "plain", "own", local)
    guarded = _program(root, "guarded", "own", local)
    assert plain["loads"][0].get("error") is None, plain
    assert guarded["loads"] == plain["loads"]  # same implementation, same calls into the kernel
    assert plain["loads"][0]["calls"] == ["flash_attn_forward"]
    want = torch.load(root / "plain-own.pt")
    got = torch.load(root / "guarded-own.pt")
    for batch in ("plain", "padded", "packed"):
        assert torch.equal(got[batch], want[batch]), batch
    assert guarded["events"] == []  # nothing wrong, nothing said


@pytest.mark.smoke
def test_a_hub_kernel_that_loads_on_a_later_try_serves(root: Path) -> None:
    """The first load finds no build (an air-gapped blip): the twins compute it, one event says
    so. Once the build is there, transformers' loader is called again (as transformers 5.23 and
    later call it at the next load): it loads the kernel — attnguard used to answer with its twins
    without letting the loader try — and the kernel computes the next model's calls, its numbers
    those of a program that had the build from the start."""
    repo = root / "retry-guarded"
    local = f"kernels-community/flash-attn2={repo}"
    guarded = _program(root, "guarded", "retry", local, RETRY_REPO=str(repo))
    first, second = guarded["loads"]
    assert first.get("error") is None and first["calls"] == []  # the twins computed it
    assert [(e["event"], e["rule"]) for e in guarded["events"]] == [
        ("backend_fallback", "hub-on-sdpa")
    ]
    assert second.get("loader_returned") is True, second  # the hub kernel itself
    assert second.get("error") is None and second["calls"], second
    fresh_repo = root / "fresh"
    fresh = _program(
        root,
        "plain",
        "fresh",
        f"kernels-community/flash-attn2={fresh_repo}",
        RETRY_REPO=str(fresh_repo),
    )
    assert fresh["loads"][0]["calls"] == second["calls"]
    want = torch.load(root / "plain-fresh.pt")
    got = torch.load(root / "guarded-retry.pt")
    for batch in ("plain", "padded", "packed"):
        assert torch.equal(got[batch], want[batch]), batch
