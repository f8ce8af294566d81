"""A signal handler runs in the main thread between any two bytecodes, also while attnguard's
code there holds a lock. A handler that imports a watched module (``import torch.distributed``
in a SIGTERM handler) or leads to an event (``attnguard.finish()`` before a preempted job
ends) took the same lock again and hung the program for ever. Fresh interpreters under a
watchdog: a timer signal every millisecond for a few seconds while the main thread works in
those sections; each must end, having done all its work.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers.processes import PY, subprocess_env

HANG_S = 60

COMMON = """
import faulthandler, signal, sys, time
faulthandler.dump_traceback_later({hang}, exit=True)
busy = [False]
def every_ms(work):
    def handler(signum, frame):
        if busy[0]:
            return  # one handler at a time, as a real one would be
        busy[0] = True
        try:
            work()
        finally:
            busy[0] = False
    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
def stop():
    signal.setitimer(signal.ITIMER_REAL, 0)
"""

IMPORTS = """
sys.path.insert(0, sys.argv[1])
from attnguard import importhooks
names = [f"ag_sig_{{i}}" for i in range({n})]
hooked = []
for name in names:
    importhooks.register_post_import_hook(hooked.append, name)
left = list(names)
every_ms(lambda: left and __import__(left.pop()))
def cb():
    pass
end = time.time() + 20
while left and time.time() < end:  # registration and cancellation, under the lock each time
    importhooks.call_before(["ag_sig_never"], cb)
    importhooks.cancel_before(cb)
stop()
print("imported", {n} - len(left), "hooked", len(hooked))
"""

EMITS = """
import attnguard
from attnguard.observability import events
attnguard.activate(log=sys.argv[1])
def from_handler():
    events.emit("observed", site="handler", reason_code="version_unsupported", reason="x")
every_ms(from_handler)
end = time.time() + 3
calls = 0
while time.time() < end:
    events.emit("tensors_aligned", site="main", reason_code="rotary_device_mismatch",
                reason="moved", applied=True)
    calls += 1
stop()
attnguard.finish()
print("main", events.counts()[("tensors_aligned", "main", "rotary_device_mismatch")] == calls)
"""


def run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(
        [PY, "-c", COMMON.format(hang=HANG_S) + code, *args],
        env=subprocess_env(ATTNGUARD_LOG="none"),
        capture_output=True,
        text=True,
        timeout=HANG_S + 30,
    )
    assert "Timeout (" not in res.stderr, f"hung:\n{res.stderr[-4000:]}"
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def test_a_handler_importing_watched_modules_while_the_lock_is_held(tmp_path: Path) -> None:
    n = 400
    for i in range(n):
        (tmp_path / f"ag_sig_{i}.py").write_text(f"X = {i}\n")
    res = run(IMPORTS.format(n=n), str(tmp_path))
    assert res.stdout == f"imported {n} hooked {n}\n"


@pytest.mark.parametrize("log", ["none", "file"])
def test_a_handler_emitting_while_the_main_thread_emits(tmp_path: Path, log: str) -> None:
    res = run(EMITS, "none" if log == "none" else str(tmp_path / "events.jsonl"))
    assert res.stdout == "main True\n"
