"""A fallback computes what the requested kernel would have computed.

flash_attention_2 is requested on this CPU machine, where flash-attn cannot run: attnguard keeps
transformers' flash code path and computes its kernel calls with the SDPA twins. These tests load
real tiny Llama, Qwen2, Mistral (sliding window) and Gemma 2 (softcap, alternating windows)
checkpoints that way and compare with what flash computes for the same inputs:

* each sequence of a packed (padding-free) row run alone, with and without the cache;
* an explicit float64 reference with flash's mask semantics: the same weights in float64 through
  transformers' eager attention, whose causal mask, softcap and scaling are flash's, with the
  sliding window widened to flash's on releases where transformers hands flash a window one key
  wider than its eager mask (``window_size=(w, w)`` before 4.56, ``(w - 1, w - 1)`` after);
* padded batches and ``generate`` with a cache (flash's bottom-right causal alignment).

The same comparisons against the real kernel on a GPU are in tests/gpu/test_semantics_gpu.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers
from workers.semantics_worker import (  # the GPU comparison's checkpoints
    FAMILIES,
    WINDOW,
    flash_window_left,
    make,
)

from attnguard.observability import events

FLASH = "flash_attention_2"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("semantics")
    make(root)  # the same seeded checkpoints the GPU comparison uses
    return {family: root / family for family in FAMILIES}


def load_flash(path: Any) -> Any:
    with events.capture() as seen:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation=FLASH)
    assert model.config._attn_implementation == FLASH, "flash's code path is kept"
    (fallback,) = [e for e in seen if e["event"] == "backend_fallback"]
    assert fallback["rule"] == "flash-on-sdpa" and fallback["selected"] == "sdpa_twin"
    return model.eval()


def load_reference(path: Any) -> Any:
    """float64, eager attention, flash's window: what flash computes, spelled out."""
    cfg = transformers.AutoConfig.from_pretrained(path)
    if getattr(cfg, "sliding_window", None):
        cfg.sliding_window = flash_window_left(cfg.sliding_window) + 1
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path, config=cfg, attn_implementation="eager", torch_dtype=torch.float64
    )
    return model.eval()


def logits(model: Any, **inputs: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits.double()


LENGTHS = (7, 12, 5)


def packed_row(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (1, sum(LENGTHS)), generator=g)
    pos = torch.cat([torch.arange(n) for n in LENGTHS]).unsqueeze(0)
    return ids, pos


def segments(ids: torch.Tensor) -> list[torch.Tensor]:
    out, start = [], 0
    for n in LENGTHS:
        out.append(ids[:, start : start + n])
        start += n
    return out


@pytest.mark.smoke
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_rows_stay_apart(guard: Any, checkpoints: Any, family: str, use_cache: bool) -> None:
    """DataCollatorWithFlattening / TRL padding_free: sequences of lengths 7/12/5 in one row,
    position_ids restarting at 0, no attention mask. Each sequence's logits equal the sequence run
    alone (flash holds them apart), with the cache too (eval and generate default to it)."""
    flash = load_flash(checkpoints[family])
    ref = load_reference(checkpoints[family])
    ids, pos = packed_row()
    got = logits(flash, input_ids=ids, position_ids=pos, use_cache=use_cache)
    start = 0
    for seg in segments(ids):
        n = seg.shape[1]
        alone = logits(flash, input_ids=seg, use_cache=use_cache)
        want = logits(ref, input_ids=seg, use_cache=False)
        torch.testing.assert_close(got[:, start : start + n], alone, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got[:, start : start + n], want, atol=2e-4, rtol=1e-4)
        start += n


def padded_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left and right padding in one batch, sequences longer than the window."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 128, (3, 14), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding
    mask[2, :2] = 0
    mask[1, -3:] = 0  # right padding
    ids[mask == 0] = 0
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_padded_batch_matches_the_float64_reference(
    guard: Any, checkpoints: Any, family: str
) -> None:
    """Every real token's logits equal the float64 reference with flash's masks, computed for
    each sequence alone at the same positions (transformers' float64 eager path turns padding
    rows into NaN, so the reference is never given padding)."""
    flash = load_flash(checkpoints[family])
    ref = load_reference(checkpoints[family])
    ids, mask = padded_batch(1)
    # (no cache: with one, transformers' flash path refuses right padding on some releases)
    got = logits(flash, input_ids=ids, attention_mask=mask, use_cache=False)
    assert not torch.isnan(got[mask.bool()]).any()
    positions = torch.arange(ids.shape[1])
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        want = logits(ref, input_ids=ids[row, real][None], position_ids=positions[real][None])
        torch.testing.assert_close(got[row, real][None], want, atol=2e-4, rtol=1e-4)


# Before 4.56 the sliding-window families keep `sliding_window` keys in their generation cache
# while flash is handed a window one key wider: what flash computes there depends on that cache,
# which a reference with the widened window does not reproduce (tests/gpu compares those with the
# real kernel). Their windows are covered above by the packed and padded comparisons.
GENERATE_FAMILIES = FAMILIES if flash_window_left(WINDOW) < WINDOW else ("llama", "qwen2")


@pytest.mark.parametrize("family", GENERATE_FAMILIES)
def test_generate_with_a_cache_matches_the_reference(
    guard: Any, checkpoints: Any, family: str
) -> None:
    """Greedy generate from a left-padded batch with the cache: each new query sits bottom-right
    of its keys, as in flash. Each row's tokens equal the float64 reference's for that prompt
    alone, and so do its scores at every step."""
    flash = load_flash(checkpoints[family])
    ref = load_reference(checkpoints[family])
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 128, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[mask == 0] = 0
    kw = dict(
        max_new_tokens=8,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_scores=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        got = flash.generate(input_ids=ids, attention_mask=mask, **kw)
        for row in range(ids.shape[0]):
            prompt = ids[row, mask[row].bool()][None]
            want = ref.generate(input_ids=prompt, **kw)
            new = got.sequences[row, ids.shape[1] :]
            assert torch.equal(new, want.sequences[0, prompt.shape[1] :])
            for step_got, step_want in zip(got.scores, want.scores, strict=True):
                torch.testing.assert_close(
                    step_got[row].double(), step_want[0].double(), atol=2e-4, rtol=1e-4
                )


def test_the_window_is_the_one_flash_gets_here(guard: Any, checkpoints: Any) -> None:
    """Mistral with a window of 4 on 14 tokens: the reference without the window differs, so
    the window really is applied (and is flash's width, per the float64 comparisons above)."""
    flash = load_flash(checkpoints["mistral"])
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 128, (1, 14), generator=g)
    no_window = transformers.AutoConfig.from_pretrained(checkpoints["mistral"])
    no_window.sliding_window = None
    wide = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoints["mistral"], config=no_window, attn_implementation="eager"
    ).eval()
    got, full = logits(flash, input_ids=ids), logits(wide, input_ids=ids)
    left = flash_window_left(WINDOW)
    torch.testing.assert_close(got[:, : left + 1], full[:, : left + 1], atol=2e-5, rtol=1e-4)
    assert (got[:, left + 1 :] - full[:, left + 1 :]).abs().max() > 1e-3
