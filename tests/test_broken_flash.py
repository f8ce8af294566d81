"""A flash-attn that is installed but whose import raises never takes transformers down.

The broken build is the real flash-attn 2.8.3 built without its CUDA extension
($TEST_BROKEN_FLASH_ATTN_DIR, made by scripts/test.sh): metadata present, ``import flash_attn``
raising ``No module named 'flash_attn_2_cuda'`` as an "undefined symbol" build does. transformers
4.49-4.57 import flash-attn at module import wherever their metadata-only availability check says
yes, which on a CPU machine it never does: the programs here make their process look like a CUDA
machine to that check (tests/workers/broken_flash_worker.py ``--standin-cuda``). transformers 5.x
imports a flash_attn that has no metadata (a source tree on PYTHONPATH) on any machine.

Each program is a fresh interpreter (tests/workers/broken_flash_worker.py) loading the seeded
Llama, Qwen2, Mistral, Gemma 2 and ModernBERT checkpoints with sdpa, eager and flash_attention_2.
What a user
must get: guarded, everything exactly as with flash-attn not installed (same outcome, same
logits, same events but one ``observed`` naming the broken package); unguarded, what they get
today; no flash-attn import that transformers would not make; the program's own ``import
flash_attn`` failing as before.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers.packages import STANDINS
from helpers.processes import PY, REPO, subprocess_env

BROKEN = os.environ.get("TEST_BROKEN_FLASH_ATTN_DIR")
WORKER = REPO / "tests" / "workers" / "broken_flash_worker.py"
IMPLS = ("sdpa", "eager", "flash_attention_2")
FLASH = "flash_attention_2"
AVAILABILITY = "transformers.availability.flash_attn"
BROKEN_IMPORT = "ModuleNotFoundError: No module named 'flash_attn_2_cuda'"
# transformers' flash check (4.x): its words for flash-attn not installed, and installed but unusable
NOT_INSTALLED = "the package flash_attn seems to be not installed."
INSTALLED_UNUSABLE = "Flash Attention 2 is not available."

pytestmark = pytest.mark.skipif(
    BROKEN is None, reason="needs the broken flash-attn build of scripts/test.sh"
)


def _minor() -> tuple[int, int]:
    import transformers

    major, minor = transformers.__version__.split(".")[:2]
    return int(major), int(minor)


MINOR = _minor()
# Where transformers imports flash-attn at module import (docs/broken-flash-attn.md): 4.49-4.52
# when a model is imported (modeling_flash_attention_utils); 4.53-4.54 already in `import
# transformers.modeling_utils` (integrations/flash_paged.py); 4.55-4.57 there too, inside a try
# that swallows the error (ModernBERT's model file imports flash-attn's layers bare up to 5.0);
# 5.x lazily, at the first flash call.
RELEASE_KIND = (
    "model-import"
    if MINOR <= (4, 52)
    else "modeling_utils-import"
    if MINOR <= (4, 54)
    else "swallowed-import"
    if MINOR <= (4, 57)
    else "lazy-import"
)
IMPORTS_AT_MODULE_IMPORT = MINOR <= (4, 57)
FAILS_EVERY_MODEL = MINOR <= (4, 54)
# 5.0 is the one release where a bare module-level import (ModernBERT's) meets no other import of
# flash-attn at module import: attnguard does not add one there (docs/broken-flash-attn.md)
KNOWN_GAP = {("modernbert", (5, 0))}
FAMILIES = "llama,qwen2,mistral,gemma2,modernbert"


# --- the programs ---------------------------------------------------------------------------------


def _env(flash: Path | None, **extra: str) -> dict[str, str]:
    env = subprocess_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1", **extra)
    env.setdefault("ATTNGUARD_LOG", "none")
    if flash is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(flash), env["PYTHONPATH"]])
    return env


def _worker(args: list[str], env: dict[str, str]) -> None:
    res = subprocess.run(
        [PY, str(WORKER), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, f"broken_flash_worker {args[0]}:\n{res.stderr[-4000:]}"


def _both(*calls: Any) -> list[Any]:
    """Run the programs two at a time (CI has two cores; each is mostly interpreter start-up)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """program(flash, guarded=..., standin_cuda=True, impls=..., families=...) -> the worker's
    result; ``flash``: "broken", "absent", "standin" (the working CPU stand-in of tests/standins)
    or "source-tree" (the broken package's directory alone, no metadata). Cached per module."""
    import torch

    root = tmp_path_factory.mktemp("broken-flash")
    ckpt = root / "ckpt"
    _worker(["make", str(ckpt)], _env(None))
    tree = root / "source-tree"
    shutil.copytree(Path(BROKEN or "") / "flash_attn", tree / "flash_attn")
    where = {"broken": Path(BROKEN or ""), "absent": None, "standin": STANDINS, "source-tree": tree}
    cache: dict[tuple[Any, ...], dict[str, Any]] = {}
    numbers = itertools.count()  # run files, unique across the threads of _both

    def run(
        flash: str,
        *,
        guarded: bool,
        standin_cuda: bool = True,
        impls: str = ",".join(IMPLS),
        families: str = FAMILIES,
    ) -> dict[str, Any]:
        key = (flash, guarded, standin_cuda, impls, families)
        if key not in cache:
            out = root / f"run-{next(numbers)}.pt"
            args = ["run", str(ckpt), str(out), "--impls", impls, "--families", families]
            args += ["--guarded"] * guarded + ["--standin-cuda"] * standin_cuda
            _worker(args, _env(where[flash]))
            cache[key] = torch.load(out, weights_only=False)
        return cache[key]

    return run


def loads(run: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [(f, i, rec) for f, by_impl in run["loads"].items() for i, rec in by_impl.items()]


def availability_events(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in run["meta"]["events"] if str(e["site"]).startswith(AVAILABILITY)]


def load_events(rec: dict[str, Any]) -> list[dict[str, Any]]:
    """A load's events without the import-time one (it lands in whichever load came first)."""
    return [e for e in rec["events"] if not str(e["site"]).startswith(AVAILABILITY)]


def assert_same_as(got: dict[str, Any], want: dict[str, Any], *, reason_code: str | None) -> None:
    """Every load of ``got`` ends as in ``want``: the same error, or the same backend and the
    same logits bit for bit; with its events, ``package_missing`` read as ``reason_code``."""
    for family, impl, rec in loads(got):
        ref = want["loads"][family][impl]
        where = f"{family}/{impl}"
        error = rec.get("error")
        if reason_code == "extension_broken" and error is not None:
            # where the load is transformers' own (attnguard stepped aside), its check words an
            # installed flash-attn it cannot use so, and a missing one as "not installed"
            error = error.replace(INSTALLED_UNUSABLE, NOT_INSTALLED)
        assert error == ref.get("error"), where
        if "error" in rec:
            if reason_code is not None:
                assert _reasons(rec, reason_code) == _reasons(ref, reason_code), where
            continue
        assert rec["attn_implementation"] == ref["attn_implementation"], where
        assert rec["param_dtype"] == ref["param_dtype"], where
        for name in ("logits_padded", "logits_packed"):  # (an encoder has no packed row)
            assert (name in rec) == (name in ref), f"{where} {name}"
            assert name not in rec or rec[name].equal(ref[name]), f"{where} {name}"
        if reason_code is not None:
            expected = [
                {**e, "reason_code": reason_code} if e["reason_code"] == "package_missing" else e
                for e in load_events(ref)
            ]
            assert load_events(rec) == expected, where


def _reasons(rec: dict[str, Any], reason_code: str) -> list[tuple[str, str]]:
    """A failed load's events as (event, reason code), ``package_missing`` read as
    ``reason_code`` (their texts name the package's state, which differs)."""
    return [
        (e["event"], reason_code if e["reason_code"] == "package_missing" else e["reason_code"])
        for e in load_events(rec)
    ]


# --- every model, every backend ----------------------------------------------------------------


@pytest.mark.parametrize(
    # CI: each lane runs the kind its release is: the oldest release's full lane "model-import"
    # (4.50-4.52 import as 4.49 does), the smoke lanes of 4.53-4.57 theirs, the newest lane
    # "lazy-import" (5.x smoke lanes skip it)
    "kind",
    [
        "model-import",
        pytest.param("modeling_utils-import", marks=pytest.mark.smoke),
        pytest.param("swallowed-import", marks=pytest.mark.smoke),
        "lazy-import",
    ],
)
def test_every_model_imports_and_loads_next_to_a_broken_flash_attn(
    request: pytest.FixtureRequest, kind: str
) -> None:
    if kind != RELEASE_KIND:
        pytest.skip(f"transformers {'.'.join(map(str, MINOR))} is a {RELEASE_KIND} release")
    program = request.getfixturevalue("program")
    plain, guarded, absent, absent_plain = _both(
        lambda: program("broken", guarded=False),
        lambda: program("broken", guarded=True),
        # what attnguard does when flash-attn is not installed, and what transformers does then
        lambda: program("absent", guarded=True),
        lambda: program("absent", guarded=False),
    )

    # unguarded: as today. 4.49-4.54 fail every model import, sdpa and eager too, ModernBERT's up
    # to 5.0 (and only because of the broken build: without flash-attn the same loads work)
    for family, impl, rec in loads(plain):
        modernbert = family == "modernbert" and MINOR <= (5, 0)
        if FAILS_EVERY_MODEL or modernbert or impl == FLASH:
            assert "error" in rec, f"{family}/{impl} loaded unguarded"
        else:
            assert rec.get("error") == absent_plain["loads"][family][impl].get("error")
    assert any("error" not in rec for _, impl, rec in loads(absent_plain) if impl != FLASH)

    # guarded: exactly as with flash-attn not installed; flash requests on the fallback that
    # serves a missing flash-attn (the SDPA twins under transformers' flash code path)
    gap = {family for family, release in KNOWN_GAP if release == MINOR}
    for family in gap:  # documented: fails as it does unguarded
        for impl, rec in guarded["loads"][family].items():
            assert rec.get("error") == plain["loads"][family][impl].get("error") is not None
    rest = {**guarded, "loads": {f: v for f, v in guarded["loads"].items() if f not in gap}}
    assert_same_as(rest, absent, reason_code="extension_broken")
    for family, impl, rec in loads(rest):
        if impl == FLASH and family == "modernbert":
            # its model file uses flash-attn's own rotary layer: whatever a flash request does
            # with flash-attn not installed, it does here (checked above)
            continue
        if impl == FLASH:
            assert rec["attn_implementation"] == FLASH, rec.get("error")
            (fallback,) = [e for e in load_events(rec) if e["event"] == "backend_fallback"]
            assert (fallback["rule"], fallback["reason_code"]) == (
                "flash-on-sdpa",
                "extension_broken",
            )
        else:  # sdpa and eager: what transformers alone does without flash-attn
            ref = absent_plain["loads"][family][impl]
            assert rec.get("error") == ref.get("error"), f"{family}/{impl}"
            if "error" not in rec:
                assert rec["logits_padded"].equal(ref["logits_padded"]), f"{family}/{impl}"
            assert load_events(rec) == [], f"{family}/{impl}"

    # one event names the broken package, where transformers would have imported it
    found = availability_events(guarded)
    if IMPORTS_AT_MODULE_IMPORT:
        (event,) = found
        assert (event["event"], event["reason_code"]) == ("observed", "extension_broken")
        assert event["package"] == "flash_attn" and event["error"] == BROKEN_IMPORT
        assert "flash-attn 2.8.3" in event["reason"] and BROKEN_IMPORT in event["reason"]
    else:
        assert found == []
    # the program's own import fails as it does without attnguard
    assert guarded["meta"]["own_import"] == plain["meta"]["own_import"] == BROKEN_IMPORT
    assert_nothing_changes_where_nothing_is_broken(program)


def assert_nothing_changes_where_nothing_is_broken(program: Any) -> None:
    """The other side of the remedy: no flash-attn import that transformers would not make, and a
    working flash-attn imported and used exactly as without attnguard."""
    # a machine transformers does not count as a CUDA machine: it never imports flash-attn, and
    # guarded neither does attnguard (an sdpa program never needs flash-attn)
    kw: dict[str, Any] = dict(standin_cuda=False, impls="sdpa", families="llama")
    plain, guarded = _both(
        lambda: program("broken", guarded=False, **kw),
        lambda: program("broken", guarded=True, **kw),
    )
    assert plain["meta"]["flash_imports"] == guarded["meta"]["flash_imports"] == []
    assert_same_as(guarded, plain, reason_code=None)
    assert "error" not in guarded["loads"]["llama"]["sdpa"]
    assert availability_events(guarded) == []
    if not IMPORTS_AT_MODULE_IMPORT:
        return
    # the stand-in flash-attn (a working CPU package with metadata) where transformers imports
    # it: guarded, the same flash-attn modules are imported, and wherever the unguarded program
    # works the guarded one computes the same logits and says nothing about availability
    kw = dict(impls="sdpa,eager", families="llama,qwen2")
    plain, guarded = _both(
        lambda: program("standin", guarded=False, **kw),
        lambda: program("standin", guarded=True, **kw),
    )
    assert guarded["meta"]["flash_imports"] == plain["meta"]["flash_imports"]
    assert "flash_attn" in plain["meta"]["flash_imports"]  # transformers does import it
    if all("error" not in rec for _, _, rec in loads(plain)):
        assert_same_as(guarded, plain, reason_code=None)
        assert availability_events(guarded) == []
    else:  # 4.53 also imports flash-attn's rotary, which the stand-in lacks: that import fails
        (event,) = availability_events(guarded)
        assert all("error" not in rec for _, _, rec in loads(guarded))
        assert "flash_attn.layers" in event["error"]


@pytest.mark.skipif(MINOR < (5, 0), reason="transformers 5.x imports a package without metadata")
def test_a_flash_attn_source_tree_without_metadata(program: Any) -> None:
    """A flash_attn directory on PYTHONPATH (a source build, no dist-info): transformers 5.x
    imports it to read its version and fails every model import; guarded, it runs as if
    flash-attn were not installed (which, without metadata, is what transformers concludes)."""
    plain, guarded, absent = _both(  # (the CUDA stand-in changes nothing here: shared runs)
        lambda: program("source-tree", guarded=False),
        lambda: program("source-tree", guarded=True),
        lambda: program("absent", guarded=True),
    )
    assert all("error" in rec for _, _, rec in loads(plain))
    assert_same_as(guarded, absent, reason_code="package_missing")
    # every load works but what fails without flash-attn too (Gemma 2 asked for sdpa; ModernBERT
    # asked for flash: docs/broken-flash-attn.md)
    for family, impl, rec in loads(guarded):
        if "error" in rec:
            assert (family, impl) in {("gemma2", "sdpa"), ("modernbert", FLASH)}, rec["error"]
    (event,) = availability_events(guarded)
    assert event["error"] == BROKEN_IMPORT and "without metadata" in event["reason"]
    assert guarded["meta"]["own_import"] == plain["meta"]["own_import"] == BROKEN_IMPORT


# --- modes, switches, late activation (one small program) --------------------------------------

SMALL_PROGRAM = """
import json, sys
import torch
torch.cuda.is_available = lambda: True  # transformers' availability check sees a CUDA machine
torch.version.cuda = "13.0"
if sys.argv[1] == "before":
    import attnguard
import transformers
if sys.argv[1] == "after":
    import attnguard
try:
    model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[2], attn_implementation="sdpa")
    with torch.no_grad():
        out = model(torch.tensor([[1, 5, 9, 2]])).logits
    print("RESULT" + json.dumps({"ok": bool(torch.isfinite(out).all())}))
except Exception as exc:
    chain = []  # the error and what caused it: 4.53+ hide the cause behind their own message
    while exc is not None and len(chain) < 5:
        chain.append(type(exc).__name__ + ": " + (str(exc).strip().splitlines() or [""])[0])
        exc = exc.__cause__ or exc.__context__
    print("RESULT" + json.dumps({"error": chain}))
"""


def small(
    tmp_path: Path, checkpoint: Path, when: str, **settings: str
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    log = tmp_path / f"events-{when}-{len(list(tmp_path.iterdir()))}.jsonl"
    env = _env(Path(BROKEN or ""), ATTNGUARD_LOG=str(log), **settings)
    res = subprocess.run(
        [PY, "-c", textwrap.dedent(SMALL_PROGRAM), when, str(checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = [x for x in res.stdout.splitlines() if x.startswith("RESULT")]
    assert res.returncode == 0 and line, res.stderr[-3000:]
    evts = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return json.loads(line[0][len("RESULT") :]), [e for e in evts if e["site"] == AVAILABILITY]


needs_module_import = pytest.mark.skipif(
    not FAILS_EVERY_MODEL, reason="transformers 4.49-4.54 fail every model import"
)


@needs_module_import
def test_activated_after_transformers_was_imported(tmp_path: Path, tiny_checkpoint: Any) -> None:
    """``import transformers`` first, then ``import attnguard``: the names transformers.utils
    already bound are guarded too."""
    got, evts = small(tmp_path, tiny_checkpoint("llama"), "after")
    assert got == {"ok": True}
    assert [(e["event"], e["error"]) for e in evts] == [("observed", BROKEN_IMPORT)]


@needs_module_import
def test_warn_strict_and_a_disabled_flash_attn_integration_leave_transformers_answer(
    tmp_path: Path, tiny_checkpoint: Any
) -> None:
    """warn: transformers' answer stands (its import fails as unguarded), the event says what
    fix mode would do; strict: attnguard's refusal instead of transformers' import error;
    ``ATTNGUARD_DISABLE=flash_attn``: attnguard imports no flash-attn, transformers' answer
    stands, nothing is said."""
    path = tiny_checkpoint("llama")
    plain, _ = small(tmp_path, path, "never")
    assert "error" in plain
    warn, evts = small(tmp_path, path, "before", ATTNGUARD_MODE="warn")
    assert warn == plain  # the import transformers makes fails, as unguarded
    (event,) = evts
    assert event["applied"] is False and "warn mode: not applied" in event["reason"]
    strict, evts = small(tmp_path, path, "before", ATTNGUARD_MODE="strict")
    (refusal,) = [e for e in strict["error"] if e.startswith("AttnGuardError")]
    assert "[extension_broken]" in refusal and BROKEN_IMPORT in refusal
    assert len(evts) == 1
    disabled, evts = small(tmp_path, path, "before", ATTNGUARD_DISABLE="flash_attn")
    assert disabled == plain and evts == []


# --- in this process: what transformers binds, what it is told -----------------------------------


@pytest.fixture
def broken_on_path(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The broken build importable in this process (removed again after the test)."""
    import importlib

    monkeypatch.syspath_prepend(BROKEN or "")
    yield
    for name in [m for m in sys.modules if m.split(".")[0] == "flash_attn"]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.mark.smoke
def test_transformers_asks_the_guarded_helpers(
    guard: Any, captured: list, broken_on_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every module that bound transformers' flash-attn availability helper holds the guarded
    one; with a broken flash-attn on a CUDA machine it answers no, and yes again once attnguard
    is deactivated (the original). On 5.x nothing is wrapped: nothing imports flash-attn at
    module import there."""
    import torch
    import transformers.modeling_utils  # noqa: F401  (what binds the name: all of it)
    import transformers.utils as tu
    import transformers.utils.import_utils as iu

    import attnguard

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    wrapped = getattr(iu.is_flash_attn_2_available, "__attnguard_original__", None)
    if not IMPORTS_AT_MODULE_IMPORT:
        assert wrapped is None
        return
    holders = [  # every loaded transformers module that bound it by name
        m
        for name, m in list(sys.modules.items())
        if name.startswith("transformers") and "is_flash_attn_2_available" in vars(m)
    ]
    assert tu in holders and len(holders) > 2
    for holder in holders:
        assert holder.is_flash_attn_2_available is iu.is_flash_attn_2_available, holder
    version_check = tu.is_flash_attn_greater_or_equal
    version_check.cache_clear()  # lru_cache'd: answer from this test's flash-attn
    try:
        assert wrapped() is True  # transformers alone: metadata present, "CUDA" present
        assert version_check.__attnguard_original__("2.1.0") is True
        assert tu.is_flash_attn_2_available() is False
        assert version_check("2.1.0") is False  # follows the verdict of the import
        (event,) = [e for e in captured if e["site"] == AVAILABILITY]
        assert event["error"] == BROKEN_IMPORT
        attnguard.deactivate()
        assert tu.is_flash_attn_2_available is wrapped and tu.is_flash_attn_2_available() is True
    finally:
        version_check.cache_clear()


@pytest.mark.smoke
def test_a_package_without_metadata_is_not_available_instead_of_an_error(
    guard: Any, captured: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.x's ``_is_package_available`` imports a package without metadata to read
    its version; guarded, its import error becomes "not available"."""
    import importlib

    import transformers.utils.import_utils as iu

    import attnguard

    shutil.copytree(Path(BROKEN or "") / "flash_attn", tmp_path / "flash_attn")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        if MINOR < (5, 0):  # 4.x reads metadata only: no metadata, not available
            assert iu._is_package_available("flash_attn", return_version=True) == (False, "N/A")
            assert not hasattr(iu._is_package_available, "__attnguard_original__")
            return
        assert iu._is_package_available("flash_attn", return_version=True) == (False, "N/A")
        (event,) = [e for e in captured if e["site"] == AVAILABILITY]
        assert event["error"] == BROKEN_IMPORT
        assert iu._is_package_available("torch", True)[0] is True  # other packages as always
        attnguard.deactivate()
        with pytest.raises(ImportError, match="flash_attn_2_cuda"):
            iu._is_package_available("flash_attn", return_version=True)
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "flash_attn"]:
            del sys.modules[name]
        importlib.invalidate_caches()


def _check_that(import_name: str | None) -> Any:
    """A stand-in for transformers' ``_is_package_available`` whose import of ``import_name``
    fails (or, with None, that fails before any import)."""
    import importlib

    def _is_package_available(pkg_name: str, return_version: bool = False) -> Any:
        if import_name is None:
            raise KeyError("metadata mapping broke")
        importlib.import_module(import_name)

    return _is_package_available


def test_an_error_that_is_not_the_package_import_propagates_unchanged(guard: Any) -> None:
    """Only the failure of transformers' own import of the package is answered; any other error
    of the check is transformers' and propagates as it is."""
    from attnguard.integrations.transformers import availability as ta

    try:
        check = ta._wrap_package_check(_check_that(None))
        with pytest.raises(KeyError, match="metadata mapping broke"):
            check("flash_attn", return_version=True)
        check = ta._wrap_package_check(_check_that("attnguard_no_such_package_of_this_test"))
        assert check("flash_attn", True) == (False, "N/A")  # its import failed: not available
        with pytest.raises(ImportError):
            check("some_other_package", True)  # not a flash-attn package: untouched
    finally:
        ta._import_errors.clear()
