"""Flash attention from the Hugging Face kernel hub: a hub kernel that works is kept, one that
cannot load is computed by the twins where its functions are flash-attn's, any other steps aside.

Real parts: the real ``kernels`` package from pip at the newest release the installed
transformers accepts (its own bounds; where none exists, the newest there is: the version skew a
user of that transformers meets), put on the programs' path by scripts/test.sh
($TEST_KERNELS_DIR); stand-in hub kernels in kernels' own layout (tests/standins/hub_kernel.py)
served without network through ``LOCAL_KERNELS``, counting their calls. Each machine is a set of
fresh interpreters (tests/workers/hub_worker.py), unguarded and guarded, loading a seeded Llama
(and GPT-OSS, whose flash request transformers routes to a hub kernel with sinks) as users do:
``attn_implementation="flash_attention_2"`` (transformers' own hub fallback),
``"kernels-community/flash-attn2"``, ``set_attn_implementation(...)``, a hub kernel attnguard
does not know, and ``"org/repo:function"``.

* the hub kernel loads: guarded == unguarded (same implementation, bit-equal logits, the same
  calls into the hub kernel), no event;
* it cannot (kernels absent, a version transformers refuses, air-gapped with an empty cache, no
  build for this device, a build whose import fails): the twins compute it, logits equal eager's
  on plain, padded and packed batches (fp32, <= 1e-5), one event naming the kernel and the cause;
* a hub kernel attnguard does not know: exactly the unguarded error, one event.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers.packages import hub_standin
from helpers.processes import PY, REPO, subprocess_env

standin = hub_standin()
write_repo = standin.write_repo

WORKER = REPO / "tests" / "workers" / "hub_worker.py"
KERNELS = os.environ.get("TEST_KERNELS_DIR")
ABSENT = os.environ.get("TEST_KERNELS_ABSENT", "")
HUB = "kernels-community/flash-attn2"
SINKS_HUB = "kernels-community/vllm-flash-attn3"
TWINS = ("fallback", "explicit", "switch", "gpt_oss")  # computed by the twins where it cannot load
ASIDE = ("unknown", "function")  # hub kernels attnguard does not know
# the unguarded program, one scenario after another; a failed hub load leaves transformers' state
# changed for the next load of the same kernel, so the ones compared to the guarded program
# exactly come first
PLAIN_ORDER = "function,unknown,flash3,gpt_oss,explicit,switch,fallback"
TOL = 1e-5


def _kernels_version() -> str:
    """The version of the kernels package scripts/test.sh provides ("?" where none)."""
    from importlib import metadata

    dist = next(metadata.distributions(path=[KERNELS], name="kernels"), None) if KERNELS else None
    return dist.version if dist is not None else "?"


KERNELS_VERSION = _kernels_version()


def _accepted() -> tuple[bool, str]:
    """Does the installed transformers accept the kernels package scripts/test.sh provides?"""
    if not KERNELS:
        return False, ABSENT or "no kernels package provided (run scripts/test.sh)"
    from packaging.specifiers import SpecifierSet

    version = KERNELS_VERSION
    import transformers.utils.import_utils as utils

    low = getattr(utils, "KERNELS_MIN_VERSION", None)
    high = getattr(utils, "KERNELS_MAX_VERSION", None)
    window = ",".join(f"{op}{v}" for op, v in ((">=", low), ("<", high)) if v)
    ok = version in SpecifierSet(window) if window else True
    return ok, f"kernels {version}, transformers accepts kernels{window or ' (any)'}"


ACCEPTED, WHY = _accepted()


def _loader() -> str | None:
    """transformers' loader of attention hub kernels (what attnguard wraps), or None where this
    release has none (before 4.52 a hub kernel's name is no attention implementation; 4.52-4.55
    load it without one: attnguard leaves those releases' hub requests as they are)."""
    import importlib

    from attnguard.integrations.transformers import hub

    try:
        module = importlib.import_module(hub.MODULE)
    except ImportError:
        return None
    return next((a for a in hub.LOADERS if callable(getattr(module, a, None))), None)


LOADER = _loader()


def _serves_local() -> bool:
    """Does the kernels package provided load a kernel from a local folder (``LOCAL_KERNELS``,
    how the ``loadable`` and ``no_build`` machines get their stand-ins)? Older releases do not."""
    package = Path(KERNELS or "", "kernels")
    return package.is_dir() and any(
        "LOCAL_KERNELS" in f.read_text(encoding="utf-8", errors="replace")
        for f in package.rglob("*.py")
    )


SERVES_LOCAL = _serves_local()


def _program(mode: str, root: Path, env: dict[str, str], scenarios: str) -> dict[str, Any]:
    calls = root / f"calls-{mode}-{os.getpid()}-{env.get('HUB_ENV')}"
    args = [PY, str(WORKER), "run", mode, str(root), str(calls), "--scenarios", scenarios]
    res = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, f"hub_worker {mode}:\n{res.stderr[-4000:]}"
    return json.loads(res.stdout.splitlines()[-1])["scenarios"]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hub")
    res = subprocess.run(
        [PY, str(WORKER), "make", str(path)],
        env=subprocess_env(HF_HUB_OFFLINE="1", TQDM_DISABLE="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return path


def _machine(root: Path, name: str) -> dict[str, str]:
    """The environment of one machine: ``absent`` (no kernels), ``offline`` (kernels, an empty
    cache, HF_HUB_OFFLINE), ``loadable`` (stand-in hub kernels through LOCAL_KERNELS),
    ``no_build`` (a stand-in with a build for another backend only, and one whose import fails)."""
    env = subprocess_env(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TQDM_DISABLE="1",
        HF_HOME=str(root / f"hf-home-{name}"),  # empty: an air-gapped cluster
        HUB_ENV=name,
        ATTNGUARD_LOG="none",
    )
    env.pop("LOCAL_KERNELS", None)
    if name != "absent":
        assert KERNELS
        env["PYTHONPATH"] = os.pathsep.join([KERNELS, env["PYTHONPATH"]])
    if name == "loadable":
        flash = write_repo(root / "standins" / "flash-attn2")
        sinks = write_repo(
            root / "standins" / "vllm-flash-attn3", name="vllm-flash-attn3", sinks=True
        )
        env["LOCAL_KERNELS"] = f"{HUB}={flash}:{SINKS_HUB}={sinks}"
    if name == "no_build":
        other_only = write_repo(
            root / "standins" / "flash-attn2-other", backend=standin.other_backend()
        )
        broken = write_repo(
            root / "standins" / "vllm-broken", name="vllm-flash-attn3", sinks=True, broken=True
        )
        env["LOCAL_KERNELS"] = f"{HUB}={other_only}:{SINKS_HUB}={broken}"
    return env


@pytest.fixture(scope="module")
def machines(root: Path) -> Any:
    """machines(name) -> {"plain": ..., "guarded": ...}: one machine's programs, unguarded and
    guarded, run side by side (CI has two cores) the first time a test asks, then kept."""
    done: dict[str, dict[str, Any]] = {}

    def get(name: str) -> dict[str, Any]:
        if LOADER is None:
            pytest.skip("this transformers release has no loader of attention hub kernels")
        if name != "absent" and not KERNELS:
            pytest.skip(f"needs the kernels package: {ABSENT}")
        if name in ("loadable", "no_build") and not SERVES_LOCAL:
            why = f"kernels {KERNELS_VERSION} loads no kernel from a local folder (LOCAL_KERNELS)"
            pytest.skip(why)
        if name not in done:
            env = _machine(root, name)
            jobs = {"plain": PLAIN_ORDER, "guarded": ",".join((*TWINS, "flash3", *ASIDE))}
            with ThreadPoolExecutor(max_workers=2) as pool:
                futures = {m: pool.submit(_program, m, root, env, o) for m, o in jobs.items()}
                done[name] = {m: f.result() for m, f in futures.items()}
        return done[name]

    return get


def _changes(record: dict[str, Any]) -> list[tuple[str, str, str]]:
    return [(e["event"], e["reason_code"], e["rule"]) for e in record["events"]]


def _exact(record: dict[str, Any], scenario: str) -> None:
    assert "error" not in record, f"{scenario}: {record.get('error')}"
    for batch, err in record["errors"].items():
        assert err <= TOL, f"{scenario}, {batch} batch: {err} from eager"


# --- the hub kernel loads: nothing changes --------------------------------------------------------


@pytest.mark.smoke  # the one hub test of the smoke suite: where this transformers accepts the
# kernels package (in skew lanes and without kernels it skips before running anything)
def test_a_hub_kernel_that_loads_is_kept(machines: Any) -> None:
    if not KERNELS or not ACCEPTED:
        pytest.skip(f"no hub kernel can load beside this transformers: {WHY}")
    ran = machines("loadable")
    plain, guarded = ran["plain"], ran["guarded"]
    for scenario in ("fallback", "explicit", "switch", "gpt_oss"):
        p, g = plain[scenario], guarded[scenario]
        if "not_applicable" in p:
            continue
        assert "error" not in p, f"{scenario} unguarded: {p.get('error')}"
        assert "error" not in g, f"{scenario} guarded: {g.get('error')}"
        assert g["attn"] == p["attn"], scenario
        assert g["errors"] == p["errors"], f"{scenario}: the same numbers, bit for bit"
        assert g["calls"] and g["calls"] == p["calls"], f"{scenario}: the hub kernel still serves"
        assert g["events"] == [], f"{scenario}: nothing to say"
    if "not_applicable" not in plain["fallback"]:
        assert plain["fallback"]["attn"] == HUB, "transformers' own fallback serves the hub kernel"
    # beside it, a hub kernel this air-gapped machine does not have: computed by the twins
    p, g = plain["flash3"], guarded["flash3"]
    assert "error" in p, "unguarded, flash-attn3 is neither here nor fetched (offline)"
    _exact(g, "flash3")
    assert _changes(g) == [("backend_fallback", "hub_kernel_unavailable", "hub-on-sdpa")]
    assert "flash-attn 3" in g["events"][0]["reason"]


# --- it cannot load: the twins compute it -------------------------------------------------------


def _expected_code(machine: str, scenario: str) -> str:
    """Why the hub kernel did not load on ``machine``."""
    if machine == "absent":
        return "hub_package_missing"
    if not ACCEPTED:
        return "hub_package_refused"
    return "hub_kernel_unavailable"


@pytest.mark.parametrize("machine", ["absent", "offline", "no_build"])
def test_a_hub_kernel_that_cannot_load_is_computed_by_the_twins(
    machines: Any, machine: str
) -> None:
    ran = machines(machine)
    plain, guarded = ran["plain"], ran["guarded"]
    for scenario in TWINS:
        p, g = plain[scenario], guarded[scenario]
        if "not_applicable" in p:
            continue
        assert "error" in p, f"{scenario}: unguarded, the load fails here"
        _exact(g, scenario)
    # transformers' own fallback: where it would load the hub kernel, the hub kernel's name
    # stays the implementation; where it would not try (no kernels, a version it refuses), the
    # request itself, on the twins as before
    fallback = guarded["fallback"]
    if "not_applicable" in fallback:  # no fallback to the hub in this release
        first_hub = "explicit"
    elif machine == "absent" or not ACCEPTED:
        assert fallback["attn"] == "flash_attention_2"
        assert _changes(fallback) == [("backend_fallback", "package_missing", "flash-on-sdpa")]
        first_hub = "explicit"
    else:
        assert fallback["attn"] == HUB
        first_hub = "fallback"
    code = _expected_code(machine, first_hub)
    said = guarded[first_hub]["events"]
    assert _changes(guarded[first_hub]) == [("backend_fallback", code, "hub-on-sdpa")]
    assert said[0]["hub_kernel"] == HUB and HUB in said[0]["reason"]
    for later in ("explicit", "switch"):  # the same hub kernel: decided once, said once
        assert guarded[later]["attn"] == HUB
        if later != first_hub:
            assert guarded[later]["events"] == []
    oss = guarded["gpt_oss"]
    if "not_applicable" not in oss and oss["attn"] == SINKS_HUB:  # routed by transformers
        assert _changes(oss) == [("backend_fallback", code, "hub-on-sdpa")]
        assert oss["events"][0]["hub_kernel"] == SINKS_HUB


@pytest.mark.parametrize("machine", ["absent", "offline", "no_build", "loadable"])
def test_a_hub_kernel_attnguard_does_not_know_fails_as_unguarded(
    machines: Any, machine: str
) -> None:
    ran = machines(machine)
    plain, guarded = ran["plain"], ran["guarded"]
    for scenario in ASIDE:
        p, g = plain[scenario], guarded[scenario]
        assert g.get("error") == p.get("error"), f"{scenario}: the unguarded outcome"
        if "error" not in p:  # the stand-in loaded (``org/repo:function`` on the loadable box)
            assert g["events"] == [] and g["calls"] == p["calls"]
            continue
        assert [(e["event"], e["rule"]) for e in g["events"]] == [("observed", "hub-aside")]
        assert g["events"][0]["reason_code"].startswith("hub_")


def test_strict_mode_names_the_hub_kernel_where_transformers_falls_back_to_it(root: Path) -> None:
    """transformers turns a failed fallback load into its own flash-attn ImportError; in strict
    mode the user gets attnguard's error, naming the hub kernel, instead."""
    if LOADER is None or not KERNELS or not ACCEPTED:
        pytest.skip(f"transformers does not fall back to the hub here: {WHY}")
    env = _machine(root, "offline")
    env["ATTNGUARD_MODE"] = "strict"
    env["HUB_ENV"] = "offline-strict"
    ran = _program("guarded", root, env, "fallback")["fallback"]
    assert ran.get("error", "").startswith("AttnGuardError: [hub_kernel_unavailable]"), ran
    assert HUB in ran["error"]
