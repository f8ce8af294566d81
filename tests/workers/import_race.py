"""Two threads import at once, in a fresh interpreter, for tests/test_import_threads.py.

    python import_race.py ENTRY FIRST SECOND OFFSET_MS

ENTRY is how attnguard is on: ``hook`` (the ``ATTNGUARD=1`` start-up hook, set by the caller),
``import`` (``import attnguard`` before anything else) or ``plain`` (no attnguard: the reference).
The main thread imports FIRST; a worker thread imports SECOND, started OFFSET_MS milliseconds
after the main thread began (a negative offset: the worker starts first and the main thread
begins that much later). Prints one JSON line: what each thread got, and whether attnguard is
active and patched what was imported. A hang is what the caller's timeout catches; before that,
faulthandler prints every thread's stack and ends the process (``IMPORT_RACE_HANG_S``, default
100 s), so a failure shows where it hung.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time

entry, first, second, offset_ms = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
faulthandler.dump_traceback_later(float(os.environ.get("IMPORT_RACE_HANG_S", "100")), exit=True)

if entry == "import":
    import attnguard  # noqa: F401  (active from here, settings from the environment)

results: dict[str, str] = {}


def imp(name: str) -> None:
    try:
        __import__(name)
        results[name] = "ok"
    except BaseException as exc:  # what it raised is part of the answer, never a hang
        import traceback

        where = traceback.extract_tb(exc.__traceback__)[-3:]  # where, should it ever happen
        at = " <- ".join(f"{f.filename}:{f.lineno}" for f in reversed(where))
        results[name] = f"{type(exc).__name__}: {exc} (at {at})"


worker = threading.Thread(target=imp, args=(second,), daemon=True)
delay = abs(offset_ms) / 1000.0
if offset_ms < 0:
    worker.start()
    time.sleep(delay)
    imp(first)
else:
    starter = threading.Timer(delay, worker.start)
    starter.start()
    imp(first)
    starter.join()
worker.join()

report: dict[str, object] = {"imports": results}
if entry != "plain":
    from attnguard import runtime

    report["active"] = runtime.is_active()
    report["patched"] = sorted(part for _, part in runtime.patched_parts())
print(json.dumps(report))
