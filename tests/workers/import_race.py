"""Two threads import at once, in a fresh interpreter, for tests/test_import_threads.py.

    python import_race.py ENTRY FIRST SECOND OFFSET_MS

ENTRY is how attnguard is on: ``hook`` (the ``ATTNGUARD=1`` start-up hook, set by the caller),
``import`` (``import attnguard`` before anything else) or ``plain`` (no attnguard: the reference).
The main thread imports FIRST; a worker thread imports SECOND, started OFFSET_MS milliseconds
after the main thread began (a negative offset: the worker starts first and the main thread
begins that much later). ENTRY ``late``: the worker thread imports SECOND first, and the main
thread runs ``import attnguard`` (FIRST) OFFSET_MS milliseconds after SECOND appeared in
``sys.modules``, while its code is still running; then, both done, a tiny Llama is built with
``attn_implementation="flash_attention_2"`` (``load`` in the report: "ok" or the error). Prints one JSON line: what each thread got, and whether attnguard is
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
late = entry == "late"

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
if late:
    worker.start()
    while second not in sys.modules and worker.is_alive():
        time.sleep(0.0005)
    time.sleep(delay)
    spec = getattr(sys.modules.get(second), "__spec__", None)
    racing = bool(getattr(spec, "_initializing", False))  # its code still runs
    imp(first)
elif offset_ms < 0:
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
if late:
    report["racing"] = racing
if entry != "plain":
    from attnguard import runtime

    report["active"] = runtime.is_active()
    report["patched"] = sorted(part for _, part in runtime.patched_parts())
if late:
    try:
        import transformers

        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from helpers.models import tiny_config  # the race is over: tests/ on the path now

        config = tiny_config("llama", num_hidden_layers=1)
        transformers.AutoModelForCausalLM.from_config(
            config, attn_implementation="flash_attention_2"
        )
        report["load"] = "ok"
    except Exception as exc:
        report["load"] = f"{type(exc).__name__}: {str(exc)[:200]}"
print(json.dumps(report))
