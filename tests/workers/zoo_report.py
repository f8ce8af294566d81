"""Run the whole model zoo and write what it found (docs/zoo.md is made with this).

    python tests/workers/zoo_report.py [--markdown docs/zoo.md] [--jsonl out.jsonl] [TYPE ...]

Each model type of the installed transformers that declares flash support is checked as
tests/test_zoo.py checks it (tests/workers/zoo_check.py), with attnguard active; one line per
model is printed as it goes (outcome, time, errors per batch, events). ``--markdown`` writes the
counts, the models not built (and why), the models whose load attnguard leaves to transformers,
and the models where transformers' own flash path computes other numbers than its eager path.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for `workers`

import torch  # noqa: E402
import transformers  # noqa: E402
from workers import zoo, zoo_check  # noqa: E402

import attnguard  # noqa: E402


def _line(record: zoo_check.Record, seconds: float) -> str:
    errs = " ".join(f"{k}={v:.1e}" for k, v in record.errors.items())
    if record.eager_differs:
        errs += " eager!=" + ",".join(f"{k}={v:.1e}" for k, v in record.eager_differs.items())
    if record.path_errors:
        errs += " path_error=" + ";".join(f"{k}:{v[:80]}" for k, v in record.path_errors.items())
    events = ";".join(f"{e['event']}/{e['reason_code']}" for e in record.events)
    detail = record.detail[:200] if record.outcome != "not_built" else ""
    return (
        f"{record.entry.model_type:32s} {record.entry.cls_name:40s} {seconds:6.2f} "
        f"{record.outcome:9s} {errs} [{events}] {detail}"
    )


# What the first error says about why a model is not built, recognised by its text
_REASONS = (
    ("requires the PIL library", "a timm vision tower (timm and pillow are no test dependency)"),
    ("requires the timm library", "a timm model (timm is no test dependency)"),
    ("inference_session", "a video tracker: it runs on an inference session, not on a batch"),
    ("validate_architecture", "its config's validator ties fields the shrink does not know"),
    ("Config' object has no attribute", "its model reads a field its default config lacks"),
    ("ignore_mismatched_sizes", "its config does not round-trip through save / load"),
    ("M parameters", "too large when shrunk (parts its fields do not reach)"),
)


def _why(detail: str) -> str:
    """The first profile's error, shortened for a table cell, with why where it says so."""
    first = detail.split(" | ")[0]
    first = first.split(": ", 1)[-1] if first.startswith(tuple("twhmb")) else first
    error = first.replace("|", "/").replace("\n", " ")[:150]
    reason = next((why for text, why in _REASONS if text in first), None)
    return f"{reason}: {error}" if reason else error


def markdown(records: list[zoo_check.Record], seconds: float) -> str:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    built = len(records) - counts.get("not_built", 0)
    lines = [
        "# The model zoo",
        "",
        "What `tests/test_zoo.py` (`TEST_ZOO=all`) finds on transformers "
        f"{transformers.__version__} (torch {torch.__version__.split('+')[0]}, CPU, float32, "
        "flash-attn not installed): every model type whose classes declare flash support, one "
        "class each (the causal LM, else the base model, else the first other head), built tiny "
        "from its config class's own defaults and loaded with "
        '`attn_implementation="flash_attention_2"`. Made with '
        "`python tests/workers/zoo_report.py --markdown docs/zoo.md`.",
        "",
        f"{len(records)} model types: **{counts.get('exact', 0)} exact**, "
        f"**{counts.get('aside', 0)} aside**, {counts.get('wrong', 0)} wrong, "
        f"{counts.get('harm', 0)} harm, {counts.get('not_built', 0)} not built "
        f"({built / max(len(records), 1):.0%} built and checked; {seconds:.0f} s).",
        "",
        "*exact*: on each batch the model takes (plain, left-padded, packed), the logits are "
        "what transformers' flash path computes with flash-attn's semantics, within fp32 "
        "rounding. *aside*: the load fails with its error without attnguard, plus one event.",
        "",
        "## Where transformers' flash path computes other numbers than eager",
        "",
        "attnguard computes the flash path's numbers (docs/how-it-works.md says why); these "
        "models' eager path differs from it (largest relative logit difference per batch):",
        "",
        "| model type | class | batch: difference |",
        "|---|---|---|",
    ]
    for r in records:
        if r.eager_differs:
            diffs = ", ".join(f"{k}: {v:.1e}" for k, v in r.eager_differs.items())
            lines.append(f"| `{r.entry.model_type}` | {r.entry.cls_name} | {diffs} |")
    lines += [
        "",
        "## Batches that fail inside transformers' flash path",
        "",
        "The same error with any kernel (the reference kernels too): transformers' own.",
        "",
        "| model type | class | batch: error |",
        "|---|---|---|",
    ]
    for r in records:
        if r.path_errors:
            errs = "; ".join(f"{k}: {v[:120]}" for k, v in r.path_errors.items())
            lines.append(f"| `{r.entry.model_type}` | {r.entry.cls_name} | {errs} |")
    lines += ["", "## Left to transformers (aside)", "", "| model type | class | error |"]
    lines.append("|---|---|---|")
    for r in records:
        if r.outcome == "aside":
            lines.append(f"| `{r.entry.model_type}` | {r.entry.cls_name} | {r.detail[:160]} |")
    lines += [
        "",
        "## Not built",
        "",
        "Built from the config class's defaults, shrunk (tests/workers/zoo.py); these did not "
        "build or did not run a batch on eager, with the first error (and why, where it "
        "says so). (Classes whose forward is torch's unimplemented one, generation-only wrappers "
        "such as `BarkModel`, take no forward call and are not in the zoo.)",
        "",
        "| model type | class | outcome | why |",
        "|---|---|---|---|",
    ]
    for r in records:
        if r.outcome == "not_built":
            row = f"| `{r.entry.model_type}` | {r.entry.cls_name} | not built | {_why(r.detail)} |"
            lines.append(row)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("types", nargs="*")
    parser.add_argument("--markdown")
    parser.add_argument("--jsonl")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CI: one core)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    attnguard.activate(log="none")
    root = Path(tempfile.mkdtemp(prefix="zoo-"))
    start = time.monotonic()
    records: list[zoo_check.Record] = []
    for entry in zoo.entries():
        if args.types and entry.model_type not in args.types:
            continue
        t = time.monotonic()
        try:
            record = zoo_check.check(entry, root)
        except Exception as exc:  # the harness itself: reported, not hidden
            record = zoo_check.Record(entry, "harm", f"zoo harness: {exc!r}"[:300])
        records.append(record)
        print(_line(record, time.monotonic() - t), flush=True)
    seconds = time.monotonic() - start
    counts: dict[str, Any] = {}
    for r in records:
        counts[r.outcome] = counts.get(r.outcome, 0) + 1
    print("total", round(seconds), counts)
    if args.markdown:
        Path(args.markdown).write_text(markdown(records, seconds), encoding="utf-8")
    if args.jsonl:
        with open(args.jsonl, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps({"model_type": r.entry.model_type, "cls": r.entry.cls_name,
                                    "outcome": r.outcome, "errors": r.errors,
                                    "eager_differs": r.eager_differs,
                                    "path_errors": r.path_errors,
                                    "detail": r.detail}) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
