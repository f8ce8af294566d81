"""The exit summary reaches an OpenTelemetry exporter in every order of set-up.

Real opentelemetry-sdk in fresh interpreters: a ``LoggerProvider`` with a
``BatchLogRecordProcessor`` exporting to a file (the SDK's ``ConsoleLogRecordExporter`` writing
one JSON record per line), a ``LoggingHandler`` on the ``"attnguard"`` logger, set up before or
after ``import attnguard`` (imports at the top, telemetry set up in ``main()``: the common
order), with or without the program's own ``provider.shutdown()`` (then, as
docs/observability.md says, after ``attnguard.finish()``). The OpenTelemetry provider registers
its own shutdown at exit when it is made; atexit runs the last registered first.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import PY, subprocess_env

pytest.importorskip("opentelemetry.sdk._logs")

PROGRAM = """
import logging, os, sys

order, shutdown, out_path, checkpoint = sys.argv[1:5]


def telemetry():
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor

    try:
        from opentelemetry.sdk._logs.export import ConsoleLogRecordExporter as Exporter
    except ImportError:  # before opentelemetry-sdk 1.39
        from opentelemetry.sdk._logs.export import ConsoleLogExporter as Exporter
    try:
        from opentelemetry.instrumentation.logging.handler import LoggingHandler
    except ImportError:
        from opentelemetry.sdk._logs import LoggingHandler

    out = open(out_path.replace("{rank}", os.environ.get("RANK", "0")), "w")
    exporter = Exporter(out=out, formatter=lambda record: record.to_json(indent=None) + "\\n")
    provider = LoggerProvider()
    provider.add_log_record_processor(BatchLogRecordProcessor(exporter))
    logger = logging.getLogger("attnguard")
    logger.addHandler(LoggingHandler(logger_provider=provider))
    logger.setLevel(logging.INFO)
    return provider


if order == "before":
    provider = telemetry()

import attnguard
import torch
import transformers


def main():
    global provider
    if order == "after":
        provider = telemetry()
    if os.environ.get("WORLD_SIZE", "1") != "1":
        import torch.distributed as dist

        dist.init_process_group("gloo")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, attn_implementation="flash_attention_2"
    )
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    if os.environ.get("WORLD_SIZE", "1") != "1":
        dist.barrier()
        dist.destroy_process_group()
    if shutdown == "explicit":
        attnguard.finish()  # the recipe: the summary first, then the provider's shutdown
        provider.shutdown()


main()
"""


def exported(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summary_records(path: Path) -> list[dict[str, Any]]:
    return [r for r in exported(path) if r["attributes"].get("event") == "summary"]


@pytest.mark.parametrize("shutdown", ["at_exit", "explicit"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_the_summary_reaches_the_exporter(
    tiny_checkpoint: Any, tmp_path: Path, order: str, shutdown: str
) -> None:
    checkpoint = tiny_checkpoint("llama")
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    out = tmp_path / "otel.jsonl"
    env = subprocess_env(ATTNGUARD_LOG="none", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    res = subprocess.run(
        [PY, str(script), order, shutdown, str(out), str(checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    records = exported(out)
    assert any(r["attributes"].get("event") == "backend_fallback" for r in records)
    (summary,) = summary_records(out)
    assert summary["attributes"]["site"] == "process"
    assert summary["attributes"]["applied"] >= 1
    assert summary["severity_text"] == "WARN"
    assert summary["body"].startswith("summary: ")


def test_the_job_summary_reaches_rank_0s_exporter_after_destroy(
    tiny_checkpoint: Any, tmp_path: Path
) -> None:
    """torchrun x2 (gloo), telemetry set up in ``main()`` after the imports, group destroyed,
    no explicit shutdown: rank 0's exporter gets the job's summary over both ranks."""
    checkpoint = tiny_checkpoint("llama")
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = subprocess_env(ATTNGUARD_LOG="none", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    out = tmp_path / "otel-{rank}.jsonl"
    res = subprocess.run(
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
        + ["after", "at_exit", str(out), str(checkpoint)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert summary_records(tmp_path / "otel-1.jsonl") == []  # rank 1's story is rank 0's
    (summary,) = summary_records(tmp_path / "otel-0.jsonl")
    attrs = summary["attributes"]
    assert attrs["site"] == "job" and attrs["ranks"] == [0, 1]
    assert attrs["missing_ranks"] == []


THREADED = """
import threading, time
import attnguard
from attnguard.observability import events


def late_work():
    time.sleep(1.0)  # still running when the main thread ends
    events.emit("tensors_aligned", site="rotary:LlamaRotaryEmbedding",
                reason_code="rotary_device_mismatch", reason="moved position_ids", applied=True)


events.emit("backend_fallback", site="transformers.load", reason_code="package_missing",
            reason="flash-attn is not installed", applied=True)
threading.Thread(target=late_work).start()  # a non-daemon thread: the interpreter waits for it
"""


def test_a_thread_still_running_at_the_end_of_main_is_counted(tmp_path: Path) -> None:
    """The summary comes before the atexit handlers only where nothing else runs; a program
    whose non-daemon thread still works when its main thread ends gets the summary after that
    thread's events."""
    script = tmp_path / "threaded.py"
    script.write_text(THREADED)
    log = tmp_path / "events.jsonl"
    res = subprocess.run(
        [PY, str(script)],
        env=subprocess_env(ATTNGUARD_LOG=str(log)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    (summary,) = [r for r in lines if r["event"] == "summary"]
    assert summary["applied"] == 2
    assert summary["events"] == {"backend_fallback": 1, "tensors_aligned": 1}
