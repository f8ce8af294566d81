"""The job's key-value store as the exit summary uses it: which store, kept past the end of the
process group, every call bounded in time, and the rolls ranks enrol in.

Which store:

* the default process group's while it is up, and once the script destroys it
  (``dist.destroy_process_group()``, the ending of accelerate, verl, torchtitan and most training
  scripts) the same store object, kept by :func:`keep_default_store` (called by
  :mod:`attnguard.integrations.torch_distributed.process_group` when the group is made and just before it is
  destroyed). Keeping the object keeps its connection (and, where rank 0 hosts the store's
  server, as under ``mp.spawn`` or a plain ``env://`` start, the server) open until this process
  exits;
* else, under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``: the workers' process groups use
  the launcher's store), the launcher's store, at ``MASTER_ADDR:MASTER_PORT``, seen as the
  default process group sees it (its ``default_pg`` prefix): the same keys as through a group's
  store, so ranks that made a group and ranks that did not (yet) meet. Its server is the agent of
  the first node, alive until every rank of every node has ended (the agents wait for each other
  at exit). A rank connects once, when it first needs the store and has no group's.

Nothing here is a collective: a rank only writes its own keys and rank 0 only reads, so no rank
ever waits for another through this module.

Bounded: a store call that does not answer within :data:`CALL_TIMEOUT_S` (a stopped or
unreachable server: c10d's own calls then block until the connection times out, minutes) is
given up, and every later call fails at once. The calls run on one daemon thread started when a
store is first kept or used (Python 3.12 starts no thread at exit); without one they run inline.

Keys (under ``attnguard/summary/v3/<restart>/``, the restart count keeping a restarted job's
keys apart from its previous attempt's): ``rank/<r>`` a rank's record; the rolls ``joined``,
``announced`` and ``posted`` (``<roll>/n`` a counter, ``<roll>/<i>`` the rank enrolled i-th),
which rank 0 reads in order: each enrolment is read once, whatever the number of ranks.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

PREFIX = "attnguard/summary/v3/"
CALL_TIMEOUT_S = 15.0  # far above a store's answer on a loaded host (milliseconds)
CONNECT_TIMEOUT_S = 30.0
T = TypeVar("T")


class StoreUnavailable(Exception):
    """The job's store failed or did not answer in time (the text says which)."""


def live_group() -> Any:
    """torch.distributed's module when a default process group of several ranks is up (never
    imports torch)."""
    if "torch.distributed" not in sys.modules:
        return None
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return dist
    except Exception:
        pass
    return None


# --- bounded calls -------------------------------------------------------------------------------


class _Caller:
    """One daemon thread that runs store calls, so that a caller can stop waiting for one."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[tuple[Callable[[], Any], list[Any], threading.Event]] = (
            queue.SimpleQueue()
        )
        self.thread: threading.Thread | None = None
        self.stuck = False  # a call never answered: the thread is lost to it

    def start(self) -> None:
        if self.thread is None:
            try:
                thread = threading.Thread(target=self._run, name="attnguard-store", daemon=True)
                thread.start()
                self.thread = thread
            except RuntimeError:
                pass  # at interpreter shutdown: calls run inline

    def _run(self) -> None:
        while True:
            fn, out, done = self.jobs.get()
            try:
                out.append((True, fn()))
            except BaseException as exc:
                out.append((False, exc))
            done.set()

    def call(self, fn: Callable[[], T], timeout: float) -> T:
        if self.stuck:
            raise StoreUnavailable("the job's store did not answer an earlier call")
        if self.thread is None or not self.thread.is_alive():
            try:
                return fn()
            except Exception as exc:
                raise StoreUnavailable(f"the job's store failed ({type(exc).__name__})") from None
        out: list[Any] = []
        done = threading.Event()
        self.jobs.put((fn, out, done))
        if not done.wait(timeout):
            self.stuck = True
            raise StoreUnavailable(f"the job's store did not answer within {timeout:g} s")
        ok, value = out[0]
        if not ok:
            raise StoreUnavailable(f"the job's store failed ({type(value).__name__})")
        return value


_caller = _Caller()


# --- which store ---------------------------------------------------------------------------------


class _Kept:
    def __init__(self) -> None:
        self.store: Any = None
        self.rank = 0
        self.world = 1
        self.pid = 0


_kept = _Kept()


def keep_default_store() -> None:
    """Keep the default process group's store (and this rank's place in the group) for the exit
    summary, and start the thread store calls run on. Never raises."""
    dist = live_group()
    if dist is None:
        return
    try:
        from torch.distributed import distributed_c10d as c10d

        _kept.store = c10d._get_default_store()
        _kept.rank, _kept.world, _kept.pid = dist.get_rank(), dist.get_world_size(), os.getpid()
        _caller.start()
    except Exception:
        pass


def _after_fork_in_child() -> None:
    global _caller, _kept, _launcher
    _caller, _kept, _launcher = _Caller(), _Kept(), _Launcher()  # the parent's, not ours


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class JobStore:
    """The job's store seen by one rank: namespaced keys, bounded calls."""

    def __init__(self, store: Any, rank: int, world: int, how: str) -> None:
        self.store = store
        self.rank = rank
        self.world = world
        self.how = how  # "launcher_store", "process_group" (up) or "kept" (destroyed since)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.ns = f"{PREFIX}{restart}/"
        self.timeout = CALL_TIMEOUT_S
        self.calls = 0

    def _call(self, fn: Callable[[], T]) -> T:
        self.calls += 1
        return _caller.call(fn, self.timeout)

    def set(self, name: str, data: bytes | str) -> None:
        self._call(lambda: self.store.set(self.ns + name, data))

    def get(self, name: str) -> bytes | None:
        """The value, or None when the key is not there (never waits for one)."""
        key = self.ns + name
        return self._call(lambda: self.store.get(key) if self.store.check([key]) else None)

    def enrol(self, roll: str, rank: int) -> None:
        """Add ``rank`` to ``roll`` (a rank may enrol more than once)."""
        n = self._call(lambda: self.store.add(f"{self.ns}{roll}/n", 1))
        self.set(f"{roll}/{n}", str(rank))


class _Launcher:
    def __init__(self) -> None:
        self.key: tuple[int, str, int] | None = None  # (pid, host, port) connected to
        self.store: Any = None
        self.failed = False


_launcher = _Launcher()


def _launcher_store() -> JobStore | None:
    """torchrun's own store (see above), connected once; None where there is none to use."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "torch.distributed" not in sys.modules:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except (KeyError, ValueError):
        return None
    key = (os.getpid(), host, port)
    if world <= 1 or (_launcher.failed and _launcher.key == key):
        return None
    if _launcher.key != key or _launcher.store is None:
        _launcher.key, _launcher.store, _launcher.failed = key, None, False
        try:
            import datetime

            from torch.distributed import PrefixStore, TCPStore

            bound = datetime.timedelta(seconds=CONNECT_TIMEOUT_S)
            _caller.start()
            client = _caller.call(
                lambda: TCPStore(host, port, is_master=False, timeout=bound), CONNECT_TIMEOUT_S + 1
            )
            _launcher.store = PrefixStore("default_pg", client)  # as init_process_group sees it
        except Exception:
            _launcher.failed = True  # not tried again in this process
            return None
    return JobStore(_launcher.store, rank, world, "launcher_store")


def job_store() -> JobStore | None:
    """The job's store: the default process group's while it is up, else the one kept when it
    was destroyed (in this process), else torchrun's; None when there is none."""
    dist = live_group()
    if dist is not None:
        try:
            from torch.distributed import distributed_c10d as c10d

            store = c10d._get_default_store()
            _caller.start()  # bounded calls from now on (at exit on 3.12+: inline, as before)
            return JobStore(store, dist.get_rank(), dist.get_world_size(), "process_group")
        except Exception:
            return None
    if _kept.store is not None and _kept.pid == os.getpid():
        return JobStore(_kept.store, _kept.rank, _kept.world, "kept")
    return _launcher_store()


class Roll:
    """Rank 0's reader of one roll: each call returns the ranks enrolled since the last."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.next = 1

    def new(self, store: JobStore) -> list[int]:
        out: list[int] = []
        count = store._call(lambda: store.store.add(f"{store.ns}{self.name}/n", 0))
        while self.next <= count:
            raw = store.get(f"{self.name}/{self.next}")
            if raw is None:
                break  # counted, not yet written: read at the next look
            self.next += 1
            try:
                out.append(int(raw))
            except ValueError:
                continue
        return out
