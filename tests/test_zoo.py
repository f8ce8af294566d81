"""The model zoo: every architecture the installed transformers ships that declares flash
support, guarded ``flash_attention_2`` where flash-attn is missing (this CPU machine, float32).

Enumerated at run time (tests/workers/zoo.py: one class per model type, the causal LM first,
then the base model, then encoders, vision, audio and encoder-decoder heads), each built tiny from
its config class's own defaults, saved, and loaded the way users load it. Each must end one of two
ways (tests/workers/zoo_check.py):

* **exact**: on a plain, a left-padded and a packed batch (those the model takes), its logits are
  what transformers' flash path computes -- the same path run with float64 reference kernels
  written from flash-attn's semantics (attention sinks included, drawn at random so they matter)
  -- within fp32 rounding; or a batch fails inside transformers' flash path exactly as it does
  with the reference kernels (transformers' own error, whatever the kernel);
* **aside**: the load fails with the error it fails with unguarded, and where attnguard stepped
  aside one event says why (a load transformers refuses itself after attnguard's decision, as
  for a prefix-LM config it will not run on flash, fails the same way).

Where transformers' flash path itself computes other numbers than its eager path (a decoder it
runs bidirectionally, a bidirectional window one key narrower, padding it drops), the flash
path's numbers are the ones kept: docs/how-it-works.md says so and docs/zoo.md lists the models.

``TEST_ZOO=all`` (CI's newest lane) checks the whole zoo and that most of its models are built
(BUILT_SHARE; docs/zoo.md names the rest and why); otherwise a sample of models whose features
differ (windows, softcap, sinks, encoders, encoder-decoders, vision, audio, modules that import
the flash path themselves).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from workers import zoo, zoo_check

WHOLE = os.environ.get("TEST_ZOO", "").strip().lower() == "all"
SAMPLE = (
    "llama",
    "mistral",
    "gemma2",
    "qwen2",
    "qwen2_5_vl",
    "gpt_oss",
    "granite_swa",
    "falcon",
    "gpt_neo",
    "gpt2",
    "bert",
    "modernbert",
    "bart",
    "pegasus_x",
    "whisper",
    "vit",
)
WATCHDOG_S = 300  # one model: build, save, two loads, three batches

# a chosen part of the zoo (tests/test_zoo_hub.py: the models transformers routes to hub kernels)
CHOSEN = [t for t in os.environ.get("TEST_ZOO_SELECT", "").split(",") if t]
# only what is tested is enumerated (the whole zoo's enumeration imports every model's module)
ONLY = CHOSEN or (None if WHOLE else SAMPLE)
ENTRIES = {e.model_type: e for e in zoo.entries(ONLY)}
# model types whose module does not import in this environment (one that needs torchvision, say):
# a user here cannot load them either; each is a skip that names the import error
UNIMPORTABLE = zoo.unimportable(ONLY)
SELECTED = sorted(ENTRIES) if ONLY is None else [t for t in ONLY if t in ENTRIES]
RESULTS: dict[str, zoo_check.Record] = {}
DOC = Path(__file__).resolve().parent.parent / "docs" / "zoo.md"


@contextlib.contextmanager
def watchdog(seconds: int, what: str) -> Iterator[None]:
    def expired(*_: Any) -> None:
        raise TimeoutError(f"{what} took over {seconds}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    import transformers

    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CI gives each stream one core
    yield tmp_path_factory.mktemp("zoo")
    torch.set_num_threads(threads)
    transformers.utils.logging.enable_progress_bar()
    transformers.utils.logging.set_verbosity(verbosity)


def _summary(record: zoo_check.Record) -> str:
    events = [(e["event"], e.get("rule"), e["reason_code"]) for e in record.events]
    return (
        f"{record.entry.cls_name}: {record.outcome}; errors {record.errors}; "
        f"{record.detail} events {events}"
    )


@pytest.mark.parametrize("model_type", SELECTED)
def test_zoo_model(root: Path, guard: Any, model_type: str) -> None:
    entry = ENTRIES[model_type]
    with watchdog(WATCHDOG_S, entry.cls_name):
        record = zoo_check.check(entry, root, eager=False)  # (docs/zoo.md: with eager)
    RESULTS[model_type] = record
    if record.outcome == "not_built":
        pytest.skip(f"not built from its config's defaults (docs/zoo.md): {record.detail[:300]}")
    assert record.outcome in ("exact", "aside"), _summary(record)
    said = [e for e in record.events if e["event"] != "observed" or record.outcome == "aside"]
    if record.outcome == "aside":  # the unguarded load's own error (checked in zoo_check)
        stepped = [e for e in record.events if e["event"] == "observed"]
        assert len(stepped) <= 1, "one event saying why, at most: " + _summary(record)
        return
    for event in said:  # "same semantics" only where the twins compute the flash path (the
        # requested kernel's, or that of the hub kernel transformers loads for it)
        if "same semantics" in event["reason"]:
            assert event.get("rule") in ("flash-on-sdpa", "hub-on-sdpa"), _summary(record)
    checked = {k for k in record.errors} | set(record.path_errors)
    assert "plain" in checked, "at least the plain batch ran: " + _summary(record)


if UNIMPORTABLE:  # (no test where every module imports)

    @pytest.mark.parametrize("model_type", sorted(UNIMPORTABLE))
    def test_zoo_model_that_does_not_import_here(model_type: str) -> None:
        pytest.skip(f"its module does not import in this environment: {UNIMPORTABLE[model_type]}")


# Share of the zoo's model types that must build from their config's defaults: a floor under
# what builds today (on 5.24.0 nine in ten), so that a release that breaks much more of the zoo
# fails here. docs/zoo.md names every model not built and why (video trackers that need an
# inference session, models with timm vision towers, configs whose validators tie fields the
# shrink does not know, defaults that leave a field the model needs empty).
BUILT_SHARE = 0.85


def test_the_zoo_builds_most_and_names_the_rest() -> None:
    """Whole zoo: at least BUILT_SHARE of the model types that declare flash support are built
    and checked; on the release docs/zoo.md was made for, the rest are the ones it names."""
    if not WHOLE:
        pytest.skip("the whole zoo runs with TEST_ZOO=all (CI's newest lane)")
    missing = sorted(set(ENTRIES) - set(RESULTS))
    if missing:
        pytest.skip(f"only part of the zoo ran here (not: {', '.join(missing[:5])}, ...)")
    not_built = sorted(t for t, r in RESULTS.items() if r.outcome == "not_built")
    built = len(ENTRIES) - len(not_built)
    assert built >= BUILT_SHARE * len(ENTRIES), f"built {built} of {len(ENTRIES)}: {not_built}"
    import transformers

    text = DOC.read_text(encoding="utf-8")
    made_for = re.search(r"transformers (\d+\.\d+\.\d+)", text)
    if made_for and made_for.group(1) == transformers.__version__:
        listed = set(re.findall(r"^\| `([^`]+)` \| .* \| not built", text, flags=re.M))
        assert listed == set(not_built), "docs/zoo.md names the models not built"
