"""A transformers release that does not exist yet, simulated from the installed one, for
tests/test_unknown_release.py.

    python release_sim.py SIMULATION {guard|plain} ROOT

Before anything imports them, the installed ``transformers/modeling_flash_attention_utils.py``
(and ``integrations/flash_attention.py`` where a simulation changes it too) is rewritten as
:data:`SIMULATIONS` says — a private helper renamed, a signature changed, a different window
convention, ... — written to a temporary file and installed as that module, so transformers and
attnguard see only the "new release". ``version_5_99`` changes nothing but the version number
every reader sees. Then a tiny Llama (a packed row: two sequences, position_ids restarting at 0,
no mask) and a tiny Mistral (sliding window 4, a 10-token sequence) are loaded from checkpoints
in ROOT with ``attn_implementation="flash_attention_2"`` (flash-attn is not installed), run, and
one JSON line says what happened: the load error, or the largest logit error of the packed row's
second sequence against that sequence run alone, and of the windowed sequence against a float64
eager reference with the window the simulated release's flash path gives flash-attn (``window``
in the JSON: (w - 1, w - 1) or (w, w)), plus attnguard's events (guard mode).

Exit 3: the simulation does not apply to this release (its text is not there).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers
from helpers.processes import first_line  # noqa: E402

FLASH = "flash_attention_2"
UTILS = "transformers.modeling_flash_attention_utils"
ENTRY = "transformers.integrations.flash_attention"
WINDOW = 4

# simulation -> {module: [(regex, replacement), ...]}: every regex must match at least once
_MINUS_ONE = r"\(sliding_window - 1, sliding_window - 1\)"
SIMULATIONS: dict[str, dict[str, list[tuple[str, str]]]] = {
    # a release nobody has tested: only the number changes
    "version_5_99": {},
    # the lazy kernel resolver renamed (every use of it)
    "lazy_renamed": {UTILS: [(r"\b_lazy_imports\b", "_resolve_flash_kernels")]},
    # _flash_attention_forward renamed in the module and at its one caller
    "forward_renamed": {
        UTILS: [(r"\b_flash_attention_forward\b", "_flash_attention_impl")],
        ENTRY: [(r"\b_flash_attention_forward\b", "_flash_attention_impl")],
    },
    # _flash_attention_forward's implementation parameter renamed (and passed by the new name)
    "forward_signature": {
        UTILS: [
            (r"attn_implementation: str \| None = None,", "kernel_name: str | None = None,"),
            (
                r"lazy_import_flash_attention\(attn_implementation\)",
                "lazy_import_flash_attention(kernel_name)",
            ),
        ],
        ENTRY: [(r"attn_implementation=module\.config", "kernel_name=module.config")],
    },
    # _lazy_imports grows a keyword-only parameter
    "lazy_extra_param": {
        UTILS: [
            (
                r"allow_all_kernels: bool = False\n\) -> tuple",
                "allow_all_kernels: bool = False, *, prefer_local: bool = True\n) -> tuple",
            )
        ],
    },
    # _lazy_imports takes a new first parameter: the implementation moves
    "lazy_param_order": {
        UTILS: [
            (
                r"def _lazy_imports\(\n    implementation",
                "def _lazy_imports(\n    kernel_source: str | None, implementation",
            ),
            (
                r"= _lazy_imports\(\n            implementation",
                "= _lazy_imports(\n            None, implementation",
            ),
        ],
    },
    # the tuple's order changes, consistently on both sides
    "return_order": {
        UTILS: [
            (
                r"return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input",
                "return flash_attn_varlen_func, flash_attn_func, flash_attn_with_kvcache, unpad_input, pad_input",
            ),
            (
                r"_flash_fn, _flash_varlen_fn, _flash_with_kvcache_fn, _pad_fn, _unpad_fn = _lazy_imports",
                "_flash_varlen_fn, _flash_fn, _flash_with_kvcache_fn, _unpad_fn, _pad_fn = _lazy_imports",
            ),
        ],
    },
    # a new kernel function attnguard has no twin for
    "new_role": {
        UTILS: [
            (
                r"return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input",
                "return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad_input, unpad_input, flash_attn_func",
            ),
            (
                r"_flash_fn, _flash_varlen_fn, _flash_with_kvcache_fn, _pad_fn, _unpad_fn = _lazy_imports",
                "_flash_fn, _flash_varlen_fn, _flash_with_kvcache_fn, _pad_fn, _unpad_fn, _flash_fp8_fn = _lazy_imports",
            ),
        ],
    },
    # flash gets window_size (w, w) for sliding_window=w, as before 4.56
    "window_convention": {UTILS: [(_MINUS_ONE, "(sliding_window, sliding_window)")]},
    # a kernel global / returned function under a name attnguard does not know
    "kernel_renamed": {UTILS: [(r"\bflash_attn_varlen_func\b", "flash_attn_varlen_kernel")]},
    # packed rows no longer detected from position_ids
    "packing_changed": {
        UTILS: [(r"if _is_packed_sequence\(position_ids, batch_size\):", "if False:")],
    },
}
# the window_size a simulation's flash path gives flash-attn for sliding_window=w, as w + offset,
# where it changes the installed release's
WINDOW_OFFSET = {"window_convention": 0}


def _install(module: str, rules: list[tuple[str, str]], tmp: Path) -> None:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    for pattern, replacement in rules:
        source, n = re.subn(pattern, replacement, source)
        if n == 0:
            print(json.dumps({"not_applicable": f"{module}: {pattern!r} not found"}))
            sys.exit(3)
    path = tmp / (module.replace(".", "_") + ".py")
    path.write_text(source)
    new = importlib.util.spec_from_file_location(module, path)
    assert new is not None and new.loader is not None
    mod = importlib.util.module_from_spec(new)
    sys.modules[module] = mod
    new.loader.exec_module(mod)


def _fake_version(version: str) -> None:
    real = importlib.metadata.version

    def version_of(name: str) -> str:
        return version if name.lower() == "transformers" else real(name)

    importlib.metadata.version = version_of  # type: ignore[assignment]


def main() -> None:
    sys.path.insert(0, str(Path(__file__).parent))  # semantics_worker beside this file
    name, mode, root = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    os.environ["HF_HUB_OFFLINE"] = "1"
    rules = SIMULATIONS[name]
    if name == "version_5_99":
        _fake_version("5.99.0")
    stack = contextlib.ExitStack()
    captured: list[dict[str, Any]] = []
    if mode == "guard":
        import attnguard
        from attnguard.observability import events

        attnguard.activate(log="none")
        captured = stack.enter_context(events.capture())
    import torch
    import transformers
    from semantics_worker import flash_window_left

    # this release's own window convention (read before the version number is changed)
    base_offset = flash_window_left(WINDOW) - WINDOW
    if name == "version_5_99":
        transformers.__version__ = "5.99.0"
    tmp = Path(tempfile.mkdtemp())
    for module in (UTILS, ENTRY):  # the flash utils first: the entry imports from it
        if module in rules:
            _install(module, rules[module], tmp)
    import transformers.modeling_utils  # noqa: F401  (attnguard patches here, seeing the release)

    result: dict[str, Any] = {"transformers": transformers.__version__}
    offset = WINDOW_OFFSET.get(name, base_offset)
    result["window"] = [WINDOW + offset, WINDOW + offset]
    try:
        llama = transformers.AutoModelForCausalLM.from_pretrained(
            root / "llama", attn_implementation=FLASH
        ).eval()
        mistral = transformers.AutoModelForCausalLM.from_pretrained(
            root / "mistral", attn_implementation=FLASH
        ).eval()
    except Exception as exc:
        result["error"] = first_line(exc)
    else:
        result["attn"] = llama.config._attn_implementation
        g = torch.Generator().manual_seed(0)
        a, b = (
            torch.randint(3, 128, (1, 9), generator=g),
            torch.randint(3, 128, (1, 13), generator=g),
        )
        ids = torch.cat([a, b], 1)
        pos = torch.cat([torch.arange(9), torch.arange(13)]).unsqueeze(0)
        seq = torch.randint(3, 128, (1, 10), generator=g)
        with torch.no_grad():
            packed = llama(input_ids=ids, position_ids=pos).logits
            alone = llama(input_ids=b).logits
            windowed = mistral(input_ids=seq, use_cache=False).logits.double()
            # the reference with this release's window, and with the other convention (the check
            # can tell them apart only if these two differ)
            for key, left in (
                ("window_err", WINDOW + offset),
                ("window_err_other", WINDOW - 1 - offset),
            ):
                want = _eager_reference(transformers, torch, root / "mistral", left)(
                    input_ids=seq, use_cache=False
                ).logits
                result[key] = float((windowed - want).abs().max())
        result["packed_err"] = float((packed[:, 9:] - alone).abs().max())
    seen = len(captured)
    result["registry"] = _registry_call(transformers, torch)  # after the loads: what they said
    result["registry_events"] = [[e["event"], e["reason_code"]] for e in captured[seen:]]
    stack.close()
    result["events"] = [  # what the loads said
        {k: e.get(k) for k in ("event", "reason_code", "rule", "reason")} for e in captured[:seen]
    ]
    print(json.dumps(result))


def _registry_call(transformers: Any, torch: Any) -> dict[str, Any]:
    """A direct call of the registry's flash entry, as custom attention code makes it."""
    fn = transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS["flash_attention_2"]
    module = torch.nn.Module()
    module.is_causal, module.layer_idx = True, 0
    module.config = transformers.LlamaConfig()
    module.config._attn_implementation = FLASH
    q = torch.randn(1, 4, 6, 16, dtype=torch.bfloat16)
    k = v = torch.randn(1, 2, 6, 16, dtype=torch.bfloat16)
    try:
        out, _ = fn(module, q, k, v, None, scaling=None)
    except Exception as exc:
        return {"error": first_line(exc)}
    return {"shape": list(out.shape)}


def _eager_reference(transformers: Any, torch: Any, path: Path, left: int) -> Any:
    """float64 eager attention with flash's window_size (left, left): eager keeps i - j < w."""
    cfg = transformers.AutoConfig.from_pretrained(path)
    cfg.sliding_window = left + 1
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, config=cfg, attn_implementation="eager", torch_dtype=torch.float64
    ).eval()


def make(root: Path) -> None:
    """The two checkpoints (the semantics tests' seeded configs)."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from semantics_worker import config

    for family in ("llama", "mistral"):
        torch.manual_seed(0)
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(config(family))
        model.save_pretrained(root / family)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(Path(sys.argv[2]))
    else:
        main()
