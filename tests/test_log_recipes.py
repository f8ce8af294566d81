"""docs/observability.md's structlog and syslog recipes (F and G), run as written: the block is
read from the document and executed, then attnguard emits, and what the app's structlog renderer
or a syslog listener receives is checked. (The rsyslog rules of recipe G run in
tests/test_log_shipper.py.)"""

from __future__ import annotations

import io
import json
import logging
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import attnguard
from attnguard.observability import events

DOC = Path(__file__).resolve().parent.parent / "docs" / "observability.md"


def recipe(name: str) -> str:
    match = re.search(rf"<!-- recipe: {name} -->\s*```python\n(.*?)```", DOC.read_text(), re.S)
    assert match, f"docs/observability.md lost its {name} recipe"
    return match.group(1)


@pytest.fixture
def attnguard_logger() -> Iterator[logging.Logger]:
    """The "attnguard" logger, its handlers and level restored after the test."""
    logger = logging.getLogger("attnguard")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    for handler in logger.handlers:
        if handler not in handlers:
            logger.removeHandler(handler)
            handler.close()
    logger.setLevel(level)


def _emit() -> None:
    attnguard.activate(log="none")
    events.emit(
        "backend_fallback",
        site="transformers.load",
        reason_code="package_missing",
        reason="flash_attention_2 requested: flash-attn is not installed",
        applied=True,
    )


def test_structlog_recipe_renders_every_field(attnguard_logger: logging.Logger) -> None:
    namespace: dict[str, Any] = {}
    exec(compile(recipe("structlog"), str(DOC), "exec"), namespace)
    stream = io.StringIO()
    namespace["handler"].setStream(stream)  # the recipe's handler writes to stderr
    _emit()
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    (fallback,) = [line for line in lines if line["event"] == "backend_fallback"]
    assert fallback["level"] == "warning" and fallback["reason_code"] == "package_missing"
    assert fallback["site"] == "transformers.load" and fallback["rank"] == 0
    assert fallback["reason"].startswith("flash_attention_2 requested")
    assert any(line["event"] == "activated" for line in lines)  # INFO, as the recipe says


def test_syslog_handler_recipe_sends_each_event(attnguard_logger: logging.Logger) -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(10)  # a watchdog
    code = recipe("syslog-handler")
    assert 'address="/dev/log"' in code
    code = code.replace('address="/dev/log"', f"address={listener.getsockname()!r}")
    try:
        exec(compile(code, str(DOC), "exec"), {})
        _emit()
        received = listener.recv(65536).decode()
    finally:
        listener.close()
    # <PRI> (facility user, severity warning), then the recipe's format
    assert received.startswith("<12>attnguard: WARNING backend_fallback package_missing rank=0 ")
