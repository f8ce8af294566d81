"""The load-time planner's table (as in tests/test_plan.py) where flash-attn itself is the question:
missing, broken, too old or failing; a transformers release whose flash path attnguard does not
recognise; a flash request transformers routes to another kernel; VLM per-sub-config requests."""

from __future__ import annotations

import pytest
from helpers.plans import (
    ASIDE,
    CAST_H100,
    FLASH,
    PLACE,
    TW,
    S,
    check_case,
    machine,
    req,
    twins,
    unusable,
)

from attnguard import facts as F
from attnguard.config import Settings
from attnguard.plan import LoadRequest

# (id, facts, request, settings, expected actions as (rule, event, reason_code), load with)
# "load with" = (attn_implementation, kernels, dtype to inject, device to place on)
CASES: list[tuple[str, F.Facts, LoadRequest, Settings, list[tuple[str, str, str]], tuple]] = [
    # --- a transformers release whose flash path attnguard does not recognise ---------------------
    (
        "CPU, flash-attn missing, flash path unrecognised: no backend changed",
        machine(None),
        req(flash_path_on_twins=False, flash_path_unrecognised="no _lazy_imports"),
        S,
        [ASIDE],
        (FLASH, None, None, None),
    ),
    (
        "V100, flash path unrecognised: the backend stays (placement and dtype as flash would need)",
        machine("V100"),
        req(flash_path_on_twins=False, flash_path_unrecognised="no _lazy_imports"),
        S,
        [ASIDE, PLACE, ("fp32-cast", "model_cast", "flash_needs_half")],
        (FLASH, None, "float16", "cuda:0"),
    ),
    # --- a model whose flash request transformers routes to another kernel --------------------------
    (
        "CPU, routed to a sinks kernel the twins compute: twins, naming it",
        machine(None),
        req(flash_routed_to="kernels-community/vllm-flash-attn3"),
        S,
        [twins("no_cuda")],
        (FLASH, TW, None, None),
    ),
    (
        "CPU, routed, and its attention passes what the twins do not compute",
        machine(None),
        req(flash_routed_to="MiniMaxAI/msa", flash_uncomputed=("block_indices",)),
        S,
        [("flash-args-uncomputed", "observed", "flash_argument_uncomputed")],
        (FLASH, None, None, None),
    ),
    # --- flash missing / broken / old / failing ---------------------------------------------------
    (
        "no GPU, flash-attn missing: nothing cast on a CPU machine",
        machine(None, flash=None),
        req(),
        S,
        [twins("package_missing")],
        (FLASH, TW, None, None),
    ),
    (
        "no GPU, flash-attn installed",
        machine(None),
        req(),
        S,
        [twins("no_cuda")],
        (FLASH, TW, None, None),
    ),
    (
        "H100, flash-attn extension broken: the run flash would have had",
        machine(
            "H100",
            flash=F.PackageState(
                True, "2.8.3", import_error="ImportError: undefined symbol: _ZN3c10"
            ),
        ),
        req(),
        S,
        [twins("extension_broken"), PLACE, CAST_H100],
        (FLASH, TW, "bfloat16", "cuda:0"),
    ),
    (
        "H100, flash-attn missing: the run flash would have had",
        machine("H100", flash=None),
        req(),
        S,
        [twins("package_missing"), PLACE, CAST_H100],
        (FLASH, TW, "bfloat16", "cuda:0"),
    ),
    (
        "H100, flash-attn too old",
        machine("H100", flash="2.0.9"),
        req(dtype="bfloat16"),
        S,
        [twins("version_too_old"), PLACE],
        (FLASH, TW, None, "cuda:0"),
    ),
    (
        "H100, tiny flash call fails",
        machine("H100", flash=F.PackageState(True, "2.8.3", probe_error="RuntimeError: no kernel")),
        req(dtype="bfloat16"),
        S,
        [twins("probe_failed"), PLACE],
        (FLASH, TW, None, "cuda:0"),
    ),
    (
        "A100, flash_attention_4 below its sm90 floor: its own path, on flash-attn 4's twins",
        machine("A100", flash=None, installed_extra={"flash_attention_4": "4.0.0b1"}),
        req(attn_implementation="flash_attention_4", dtype="bfloat16"),
        S,
        [twins("capability_too_low"), PLACE],
        ("flash_attention_4", TW, None, "cuda:0"),
    ),
    (
        "paged| prefix keeps its path",
        machine(None, flash=None),
        req(attn_implementation="paged|flash_attention_2"),
        S,
        [twins("package_missing")],
        ("paged|flash_attention_2", TW, None, None),
    ),
    (
        "V100, twins do not cover this transformers: sdpa, left where its caller puts it (nothing "
        "of the request needs a GPU any more: no placement, and no cast of a model on the CPU)",
        machine("V100"),
        req(flash_path_on_twins=False),
        S,
        [unusable("capability_too_low")],
        ("sdpa", None, None, None),
    ),
    (
        "H100 bf16, the model class has no flash support: sdpa, not placed",
        machine("H100"),
        req(dtype="bfloat16", supports_flash=False),
        S,
        [("flash-unsupported", "backend_fallback", "model_unsupported")],
        ("sdpa", None, None, None),
    ),
    (
        "twins do not cover this transformers: transformers' sdpa",
        machine(None, flash=None),
        req(flash_path_on_twins=False),
        S,
        [unusable("package_missing")],
        ("sdpa", None, None, None),
    ),
    (
        "twins do not cover it and the model has no sdpa (Gemma 2 on 5.x): eager",
        machine(None, flash=None),
        req(flash_path_on_twins=False, supports_sdpa=False),
        S,
        [unusable("package_missing")],
        ("eager", None, None, None),
    ),
    (
        "Gemma 2 on 5.x (no sdpa) with the twins: flash's own path",
        machine(None, flash=None),
        req(supports_sdpa=False),
        S,
        [twins("package_missing")],
        (FLASH, TW, None, None),
    ),
    (
        "ATTNGUARD_FALLBACK=eager first",
        machine(None, flash=None),
        req(),
        Settings(fallback=("eager", "sdpa")),
        [unusable("package_missing")],
        ("eager", None, None, None),
    ),
    (
        "model class without flash support",
        machine("H100"),
        req(dtype="bfloat16", device_map={"": 0}, supports_flash=False),
        S,
        [("flash-unsupported", "backend_fallback", "model_unsupported")],
        ("sdpa", None, None, None),
    ),
    (
        "no usable fallback backend",
        machine(None, installed_extra={"flex_attention": F.PackageState(True, import_error="x")}),
        req(),
        Settings(fallback=("flex_attention",)),
        [("no-fallback", "observed", "no_fallback_usable")],
        (FLASH, None, None, None),
    ),
    (
        "fallback list skips an unusable entry",
        machine(None, installed_extra={"flex_attention": F.PackageState(True, import_error="x")}),
        req(),
        Settings(fallback=("flex_attention", "eager")),
        [unusable("no_cuda")],
        ("eager", None, None, None),
    ),
    # --- VLM per-sub-config requests -----------------------------------------------------------------
    (
        "dict: the flash sub-config keeps flash's path on the twins",
        machine(None, flash=None),
        req(attn_implementation={"text_config": FLASH, "vision_config": "sdpa"}),
        S,
        [twins("package_missing")],
        ({"text_config": FLASH, "vision_config": "sdpa"}, TW, None, None),
    ),
    (
        "dict without twins: only the flash sub-config falls back",
        machine(None, flash=None),
        req(
            attn_implementation={"text_config": FLASH, "vision_config": "sdpa"},
            flash_path_on_twins=False,
        ),
        S,
        [unusable("package_missing")],
        ({"text_config": "sdpa", "vision_config": "sdpa"}, None, None, None),
    ),
    (
        "dict: two flash sub-configs, two decisions",
        machine(None, flash=None),
        req(
            attn_implementation={"": FLASH, "vision_config": FLASH, "text_config": "eager"},
            flash_path_on_twins=False,
        ),
        S,
        [unusable("package_missing")] * 2,
        ({"": "sdpa", "vision_config": "sdpa", "text_config": "eager"}, None, None, None),
    ),
    (
        "dict on H100: the flash text tower makes the model half",
        machine("H100"),
        req(attn_implementation={"text_config": FLASH, "vision_config": "sdpa"}),
        S,
        [PLACE, CAST_H100],
        ({"text_config": FLASH, "vision_config": "sdpa"}, None, "bfloat16", "cuda:0"),
    ),
    (
        "dict on H100, fp32_policy=fallback: only the flash entry changes",
        machine("H100"),
        req(attn_implementation={"text_config": FLASH, "vision_config": "eager"}),
        Settings(fp32_policy="fallback"),
        [PLACE, ("fp32-fallback", "backend_fallback", "flash_needs_half")],
        ({"text_config": "sdpa", "vision_config": "eager"}, None, None, "cuda:0"),
    ),
]


@pytest.mark.smoke
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_decision_table(case: tuple) -> None:
    check_case(case)
