"""A settings change is atomic for running code.

``configure(...)`` / ``activate(...)`` while other threads run forwards of a model loaded under
the guard: patches read the settings at every call, so a change of log level or of mode (fix,
warn, strict) keeps every patch in place and no forward ever meets transformers' unguarded flash
path (here, with flash-attn absent, that path fails at once).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import transformers
from helpers.models import tiny_inputs

import attnguard
from attnguard import facts, runtime

FORWARDS_PER_THREAD = 40
THREADS = 3


def test_settings_changes_under_load_fail_no_forward(
    tiny_checkpoint: Any, guard: Any, captured: list[dict[str, Any]]
) -> None:
    if facts.current().backend("flash_attention_2").usable:
        pytest.skip("flash-attn runs here: the unguarded path would not fail")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint("llama"), attn_implementation="flash_attention_2"
    ).eval()
    inputs = tiny_inputs("llama")
    with torch.no_grad():
        expected = model(**inputs).logits
    patched = runtime.patched_integrations()
    assert "transformers" in patched

    failures: list[BaseException] = []
    mismatches: list[float] = []
    done = threading.Event()

    def forwards() -> None:
        for _ in range(FORWARDS_PER_THREAD):
            try:
                with torch.no_grad():
                    got = model(**inputs).logits
                if not torch.equal(got, expected):
                    mismatches.append(float((got - expected).abs().max()))
            except BaseException as exc:  # noqa: BLE001 - every failure counts
                failures.append(exc)

    changes = [0]
    unpatched: list[frozenset[str]] = []

    def change_settings() -> None:
        levels, modes = ("info", "warning", "error", "auto"), ("warn", "strict", "fix")
        while not done.is_set():
            i = changes[0]
            attnguard.configure(log="none", log_level=levels[i % len(levels)])
            attnguard.activate(log="none", mode=modes[i % len(modes)])
            if runtime.patched_integrations() != patched:
                unpatched.append(runtime.patched_integrations())
            changes[0] += 1

    workers = [threading.Thread(target=forwards) for _ in range(THREADS)]
    changer = threading.Thread(target=change_settings)
    changer.start()
    for t in workers:
        t.start()
    for t in workers:
        t.join(timeout=600)
    done.set()
    changer.join(timeout=60)
    assert changes[0] > 0
    assert unpatched == []  # nothing was unpatched, ever
    assert failures == [], f"{len(failures)} failed forwards, first: {failures[0]!r}"
    assert mismatches == []
    assert runtime.patched_integrations() == patched


def test_an_integration_disabled_and_enabled_again_is_unpatched_and_patched(guard: Any) -> None:
    """Only a change of what is allowed patches or unpatches, and only that integration."""
    import transformers.modeling_utils  # noqa: F401  (the hook patches it)

    assert "transformers" in runtime.patched_integrations()
    attnguard.configure(log="none", disable="transformers")
    assert "transformers" not in runtime.patched_integrations()
    attnguard.configure(log="none", disable="")
    assert "transformers" in runtime.patched_integrations()
