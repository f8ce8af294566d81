"""Never hang: threads import concurrently in real programs (a worker thread importing asyncio
while the main thread imports transformers; two threads importing transformers and one of its
submodules), and attnguard must not turn that into a deadlock, under the ``ATTNGUARD=1``
start-up hook or after ``import attnguard``. Python holds its global import lock while it asks
a finder for a spec; attnguard's finder imports nothing, activates nothing and waits for no lock
there (attnguard/importhooks.py).

Each case is a fresh interpreter (tests/workers/import_race.py) with the installed package and
its start-up hook, at many timing offsets in both orders (which import starts first); a hang is
a failure, caught by faulthandler in the worker and by the subprocess timeout here. Each import
must succeed, as it does without attnguard, and the guard must be active with its patches in
place. (Pairs that Python itself does not import reliably in two threads, such as
``transformers`` and ``transformers.utils.import_utils``, which fails with "partially
initialized module" unguarded too, are not used.)
"""

from __future__ import annotations

import builtins
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers.hook import env_for, needs_hook
from helpers.processes import PY

from attnguard import importhooks

WORKER = Path(__file__).resolve().parent / "workers" / "import_race.py"
HANG_S = 100  # a run that has not ended by then hung: imports here take seconds

# Milliseconds between the two imports; negative: the worker thread's import starts first.
OFFSETS = (-40, -10, -2, 0, 2, 5, 10, 20, 40)


def race(entry: str, first: str, second: str, offset_ms: float) -> dict:
    switch = "1" if entry == "hook" else "0"
    env = env_for(ATTNGUARD=switch, ATTNGUARD_LOG="none", IMPORT_RACE_HANG_S=str(HANG_S))
    if entry in ("import", "late"):
        env.pop("ATTNGUARD")  # import attnguard means on
    try:
        res = subprocess.run(
            [PY, str(WORKER), entry, first, second, str(offset_ms)],
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_S + 30,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"{entry}: {first} + {second} at {offset_ms} ms hung (no end in time)")
    where = f"{entry}: {first} (main) + {second} (thread) at {offset_ms} ms"
    assert "Timeout (" not in res.stderr, f"{where} hung:\n{res.stderr[-6000:]}"
    assert res.returncode == 0, f"{where}: exit {res.returncode}\n{res.stderr[-4000:]}"
    return json.loads(res.stdout.splitlines()[-1])


def sweep(entry: str, first: str, second: str, offsets: tuple[float, ...]) -> list[dict]:
    """Every offset, one fresh interpreter each; stops at the first failure."""
    return [race(entry, first, second, ms) for ms in offsets]


@needs_hook
def test_a_thread_importing_asyncio_while_the_hook_activates() -> None:
    """The start-up hook activates attnguard at the first import of transformers; a worker
    thread imports asyncio meanwhile (10 of 10 runs hung when activation ran inside the
    finder)."""
    for got in sweep("hook", "transformers", "asyncio", OFFSETS):
        assert got["imports"] == {"transformers": "ok", "asyncio": "ok"}
        assert got["active"] is True
        assert "attnguard.integrations.transformers.availability" in got["patched"]


@needs_hook
def test_a_thread_importing_concurrent_futures_while_the_hook_activates() -> None:
    for got in sweep("hook", "transformers", "concurrent.futures.thread", (-8, -5, -3, -1, 0, 2)):
        assert got["imports"] == {"transformers": "ok", "concurrent.futures.thread": "ok"}
        assert got["active"] is True


@pytest.fixture(scope="module")
def unguarded_imports() -> dict:
    """The two imports of the next test without attnguard (both succeed where torch is
    installed)."""
    return race("plain", "transformers", "transformers.modeling_utils", 10)["imports"]


@needs_hook
@pytest.mark.parametrize("entry", ["hook", "import"])
def test_two_threads_importing_transformers_and_modeling_utils(
    entry: str, unguarded_imports: dict
) -> None:
    """As users' programs do: ``import transformers`` in one thread, ``import
    transformers.modeling_utils`` in another (4 of 4 runs hung, with the hook and with a plain
    ``import attnguard``); both orders. Both integrations' parts end up patched."""
    target = "transformers.modeling_utils"
    assert unguarded_imports["transformers"] == "ok"
    patched = ["attnguard.integrations.transformers.availability"]
    if unguarded_imports[target] == "ok":  # not without torch (a Python torch has no build for)
        patched.append("attnguard.integrations.transformers.modeling")
    patched.sort()  # as the worker reports them
    for got in sweep(entry, "transformers", target, (-20, 5, 30)):
        assert got["imports"] == unguarded_imports
        assert got["active"] is True
        assert got["patched"] == patched


def test_import_attnguard_while_a_thread_still_imports_modeling_utils() -> None:
    """A worker thread is running ``transformers.modeling_utils``' code when the main thread
    runs ``import attnguard``: the guard said it was active with both transformers parts
    patched, yet the part was patched on a module not yet whole (no ``PreTrainedModel``), so a
    flash_attention_2 load with flash-attn absent failed with transformers' own ImportError and
    no event. Now the part is patched when that import ends (in the importing thread, before
    any other thread gets the module; nobody waits): the load goes to the twins."""
    patched = [
        "attnguard.integrations.transformers.availability",
        "attnguard.integrations.transformers.modeling",
    ]
    got = sweep("late", "attnguard", "transformers.modeling_utils", (0, 1, 5, 20, 100, 400))
    assert sum(g["racing"] for g in got) >= 3, got  # the race was run, not missed
    for g in got:
        assert g["imports"] == {"attnguard": "ok", "transformers.modeling_utils": "ok"}
        assert g["active"] is True and g["patched"] == patched
        assert g["load"] == "ok", g


def test_a_module_whose_import_cannot_be_followed_is_said_not_patched(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other way out: a module still being imported whose spec cannot be followed (here a
    stand-in whose class cannot be switched) gets ``cannot_follow``, not its hook, now; the
    hook runs at a later import of it."""
    import types

    class Frozen:  # a spec kind whose instances' class cannot be switched
        __slots__ = ("_initializing", "name")

    spec = Frozen()
    spec._initializing, spec.name = True, "ag_half_imported"
    half = types.ModuleType("ag_half_imported")
    half.__spec__ = spec  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "ag_half_imported", half)
    fired: list[Any] = []
    said: list[Any] = []
    importhooks.register_post_import_hook(fired.append, "ag_half_imported", said.append)
    assert fired == [] and said == [half]
    assert fired.append in importhooks._after.pop("ag_half_imported")


def test_not_followed_is_one_observed_event(captured: list[dict[str, Any]]) -> None:
    import types

    from attnguard import runtime
    from attnguard.integrations.transformers import INTEGRATION

    runtime._not_followed(
        INTEGRATION, INTEGRATION.parts[1].module, types.ModuleType("transformers.modeling_utils")
    )
    (event,) = captured
    assert event["event"] == "observed" and event["reason_code"] == "import_in_progress"
    assert "attnguard.integrations.transformers.modeling is not patched" in event["reason"]


def test_the_finder_imports_nothing_and_waits_for_no_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rule itself, on a package of this test's own: asked for a watched module while
    attnguard's lock is held by another thread, the finder answers at once, having imported
    nothing; the import then runs the hook, and the module names its real loader."""
    (tmp_path / "ag_watched_pkg").mkdir()
    (tmp_path / "ag_watched_pkg" / "__init__.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ag_watched_pkg", raising=False)
    fired: list[Any] = []
    importhooks.register_post_import_hook(fired.append, "ag_watched_pkg")
    finder = next(f for f in sys.meta_path if isinstance(f, importhooks.ImportWatcher))
    imported: list[str] = []
    real_import = builtins.__import__

    def spy(name: str, *args: Any, **kwargs: Any) -> Any:
        imported.append(name)
        return real_import(name, *args, **kwargs)

    answer: dict[str, Any] = {}
    with importhooks._lock:  # held elsewhere: a finder that waited for it would not return
        builtins.__import__ = spy
        try:
            asking = threading.Thread(
                target=lambda: answer.update(spec=finder.find_spec("ag_watched_pkg", None))
            )
            asking.start()
            asking.join(30)
        finally:
            builtins.__import__ = real_import
    assert not asking.is_alive(), "find_spec waited for a lock"
    assert imported == [] and answer["spec"].name == "ag_watched_pkg"
    import ag_watched_pkg  # type: ignore[import-not-found]

    assert fired == [ag_watched_pkg] and ag_watched_pkg.VALUE == 1
    assert type(ag_watched_pkg.__loader__).__name__ == "SourceFileLoader"
    assert ag_watched_pkg.__spec__.loader is ag_watched_pkg.__loader__
