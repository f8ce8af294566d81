"""pytest's hooks and the shared fixtures. Every test starts and ends with attnguard
deactivated, counts, latches and the workload record cleared.

``import attnguard`` activates from the environment; the test session imports it once with
ATTNGUARD_LOG=none so pytest's own output stays clean, then each test switches it on as needed.
What tests share besides fixtures is in tests/helpers (tests/README.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
for _var in [v for v in os.environ if v.startswith("ATTNGUARD")]:
    del os.environ[_var]  # a developer's shell settings must not leak into tests
os.environ["ATTNGUARD_LOG"] = "none"

from helpers.models import save_tiny  # noqa: E402
from helpers.packages import STANDINS, purge_flash_attn  # noqa: E402

import attnguard  # noqa: E402
from attnguard import callguard  # noqa: E402
from attnguard.observability import events, workload  # noqa: E402

attnguard.deactivate()

# Test files whose subject does not depend on the transformers release (the job story across
# ranks and nodes, its delivery at exit to OpenTelemetry and a log shipper, the benchmarks' smoke
# runs, diffusers' hub-kernel backends, the map of the tests; the releases after the newest, which
# only the newest predicts): marked `once`; CI runs them in its newest lane (its torch lanes the smoke ones among
# them) and deselects them in the pinned transformers lanes. The README's test commands run them.
ONCE = {
    "test_bench_smoke.py",
    "test_diffusers_hub.py",
    "test_exit_wait.py",
    "test_job_nodes.py",
    "test_job_scale.py",
    "test_log_shipper.py",
    "test_otel_exit.py",
    "test_readme_numbers.py",
    "test_tests_map.py",
    "test_unknown_release.py",
}


# Test files whose subject is what differs between torch releases (SDPA's arguments, torch's flash
# kernel, what torch.compile can trace): marked `torch`; CI's torch lanes (the newest torch, the
# floor, one between) run them with the smoke suite (`-m "smoke or torch"`).
TORCH = {
    "test_attention_sinks.py",
    "test_compile.py",
    "test_fallback.py",
    "test_fallback_varlen.py",
    "test_fallback_xformers.py",
    "test_kvcache_twin.py",
    "test_torch_releases.py",
    "test_twin_determinism.py",
    "test_twin_routes.py",
    "test_varlen_packed.py",
}


def pytest_sessionstart(session: pytest.Session) -> None:
    session.config._attnguard_started = time.monotonic()  # type: ignore[attr-defined]


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    """The README's test commands record their counts and minutes (tests/run_record.py)."""
    import run_record

    kind = run_record.run_kind(config)
    started = getattr(config, "_attnguard_started", None)
    if kind is None or started is None or exitstatus not in (0, 1):
        return
    path = run_record.record(kind, terminalreporter.stats, time.monotonic() - started)
    terminalreporter.write_line(f"{kind} run recorded in {path} (README checks its numbers)")


# the seconds each test file took, where TEST_FILE_TIMES names a file for them: .ci/run splits its
# next run's full-suite parts by them (scripts/ci_parts.py)
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if os.environ.get("TEST_FILE_TIMES"):
        path = report.nodeid.split("::")[0]
        _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    where = os.environ.get("TEST_FILE_TIMES")
    if where and _FILE_SECONDS:
        import json

        Path(where).write_text(json.dumps({k: round(v, 2) for k, v in _FILE_SECONDS.items()}))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in ONCE:
            item.add_marker(pytest.mark.once)
        if item.path.name in TORCH:
            item.add_marker(pytest.mark.torch)


@pytest.fixture(autouse=True)
def _clean_guard() -> Iterator[None]:
    attnguard.deactivate()
    events.reset_counts()
    callguard.reset_latches()  # a call site one test latched stays unlatched for the next
    workload.reset()  # what reached the twins: the summary's advice reads it
    yield
    attnguard.deactivate()
    events.reset_counts()
    callguard.reset_latches()
    workload.reset()


@pytest.fixture
def captured() -> Iterator[list[dict[str, Any]]]:
    """Every event emitted during the test (attnguard's own capture helper)."""
    with events.capture() as got:
        yield got


@pytest.fixture
def guard(captured: list[dict[str, Any]]) -> Iterator[Any]:
    """attnguard active in fix mode with no stream output; returns a re-activation function."""

    def _activate(**overrides: Any) -> attnguard.Settings:
        return attnguard.activate(**{"log": "none", **overrides})

    _activate()
    yield _activate


@pytest.fixture
def launcher_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Rank 1 of 2, so rank fields are visibly taken from the environment (not the defaults)."""
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    return {"rank": 1, "local_rank": 1, "world_size": 2}


@pytest.fixture
def logger_levels() -> Iterator[None]:
    """Tests change the root and "attnguard" logger levels; put them back afterwards."""
    import logging

    root, ours = logging.getLogger(), logging.getLogger("attnguard")
    saved = (root.level, ours.level, ours.propagate)
    yield
    root.setLevel(saved[0])
    ours.setLevel(saved[1])
    ours.propagate = saved[2]


@pytest.fixture
def flash_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The flash-attn stand-in (tests/standins) imported fresh, then attnguard activated (patching
    it); forgotten afterwards: other tests must not see flash_attn installed."""
    attnguard.deactivate()
    monkeypatch.syspath_prepend(str(STANDINS))
    purge_flash_attn()
    import flash_attn

    assert flash_attn.IS_ATTNGUARD_STANDIN
    attnguard.activate(log="none")
    events.reset_counts()
    yield flash_attn
    attnguard.deactivate()
    purge_flash_attn()


@pytest.fixture
def dynamo_reset() -> Iterator[None]:
    """torch.compile's caches cleared before and after the test."""
    import torch

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def emulated(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """torch's flash kernel 'available' on CPU, computed by its float64 emulation
    (tests/helpers/torch_flash.py); the calls it received are recorded."""
    from helpers.torch_flash import fake_flash_op

    from attnguard.fallback import torch_flash

    calls: list[dict[str, Any]] = []

    def op(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return fake_flash_op(*args, **kwargs)

    monkeypatch.setattr(torch_flash, "_OP", op)
    monkeypatch.setattr(torch_flash, "can_run", lambda *a, **k: True)
    return calls


# --- kernel selection (ATTNGUARD_KERNEL=fastest) stood in on a CPU: tests/helpers/selection.py --


@pytest.fixture
def disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, captured: list[dict[str, Any]]) -> Any:
    """The kernel-decision cache under tmp_path, for one causal call's bucket: its ``call``,
    ``path``, folder (``dir``, ``cache``) and the ``events`` emitted."""
    from helpers.selection import FP, dense

    from attnguard.selection import cache, decisions

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    decisions.reset()
    monkeypatch.setattr(cache, "fingerprint", lambda version: FP)
    attnguard.activate(log="none")
    call = dense(causal=True)
    folder = cache.Disk(cache.cache_root(), FP)
    path = os.path.join(folder.path, cache.bucket_id(call.bucket) + ".json")
    yield SimpleNamespace(call=call, path=path, events=captured, dir=folder.path, cache=folder)
    decisions.reset()


@pytest.fixture
def stand_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, captured: list[dict[str, Any]]
) -> Any:
    """The fingerprint and the race stood in on CPU (each race "measures" ``sdpa`` faster and is
    counted); ``serve`` answers with the kernel name that computes a call."""
    from helpers.selection import ENTRY, FP, FakeCuda, served_name

    from attnguard.selection import buckets, cache, decisions
    from attnguard.selection.buckets import REQUESTED

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    decisions.reset()
    monkeypatch.setattr(cache, "fingerprint", lambda version: FP)
    raced = []

    def fake_race(*args: Any, **kwargs: Any) -> Any:
        raced.append(args)
        return decisions.Decision("sdpa", {"sdpa": "1.50x"}, {"sdpa": {"ms": 1.0}})

    monkeypatch.setattr(decisions, "_race", fake_race)
    attnguard.activate(log="none")

    def serve(opts: Any = None, **call: Any) -> str:
        args = {"q": FakeCuda(4, 4096, 32, 128), "k": FakeCuda(4, 4096, 8, 128), **call}
        impl = decisions.serve(ENTRY, (), args, opts or decisions.Options(version="0"))
        return REQUESTED if impl is None else served_name(impl)

    def disk_has(winner: str, **call: Any) -> Any:
        args = {"q": FakeCuda(4, 4096, 32, 128), "k": FakeCuda(4, 4096, 8, 128), **call}
        described = buckets.describe("flash_attn_func", args)
        decision = decisions.Decision(winner, {winner: "1.50x"}, {winner: {"ms": 1.0}})
        disk = cache.Disk(cache.cache_root(), FP)
        assert disk.write_first(described, decision).winner == winner
        return described

    yield SimpleNamespace(serve=serve, disk_has=disk_has, raced=raced, events=captured)
    decisions.reset()


# --- a second local user and a directory everyone may write to (file safety) ---------------------


@pytest.fixture
def other_user() -> Iterator[tuple[int, int]]:
    """(uid, gid) of a throw-away local user; skipped unless the tests run as root."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("cross-user tests need root and useradd (CI runs as root)")
    import pwd

    name = f"agtest{os.getpid() % 100000}"
    subprocess.run(["useradd", "--no-create-home", name], check=True, capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory every user may write to, sticky like /tmp."""
    path = Path(tempfile.mkdtemp(prefix="ag-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """tiny_checkpoint(family, dtype="float32") -> a saved random checkpoint (cached per
    session)."""
    cache: dict[tuple[str, str], Path] = {}

    def make(family: str, dtype: str = "float32") -> Path:
        key = (family, dtype)
        if key not in cache:
            import torch

            # default attention: nothing for attnguard to decide, even when it is active
            path = tmp_path_factory.mktemp(f"{family}-{dtype}")
            cache[key] = save_tiny(path, family, dtype=getattr(torch, dtype))
        return cache[key]

    return make
