"""A hub kernel that cannot load, in each mode and with the remedy switched off, in this process
(no `kernels` package here, as on most machines): ``attn_implementation="kernels-community/
flash-attn2"`` fails unguarded with transformers' ImportError.

* fix: the twins compute the hub kernel's flash-attn 2 functions; logits equal eager's;
* warn: the unguarded error, and one event saying what fix mode would have done;
* strict: AttnGuardError naming why the hub kernel cannot load;
* ``ATTNGUARD_DISABLE=fallback``: the unguarded error, and one ``observed`` event.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import transformers

import attnguard
from attnguard.errors import AttnGuardError
from attnguard.observability import events

HUB = "kernels-community/flash-attn2"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("kernels") is not None,
        reason="the kernels package is installed in this process (its cache would be asked)",
    ),
    pytest.mark.skipif(
        not hasattr(transformers.PreTrainedModel, "_check_and_adjust_attn_implementation"),
        reason="this transformers release loads no flash attention from the kernel hub",
    ),
]


@pytest.fixture(scope="module")
def llama(tiny_checkpoint: Any) -> Any:
    return tiny_checkpoint("llama")


def _load(path: Any) -> Any:
    return transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation=HUB)


def _unguarded(path: Any) -> BaseException:
    with pytest.raises(Exception) as err:
        _load(path)
    return err.value


def _said(seen: list[dict[str, Any]]) -> list[tuple[str, str, Any]]:
    return [
        (e["event"], e["reason_code"], e.get("applied")) for e in seen if e["event"] != "activated"
    ]


def test_fix_mode_computes_the_hub_kernel_on_the_twins(llama: Any) -> None:
    assert isinstance(_unguarded(llama), ImportError)
    attnguard.activate(log="none")
    with events.capture() as seen:
        model = _load(llama)
    assert model.config._attn_implementation == HUB
    assert _said(seen) == [("backend_fallback", "hub_package_missing", True)]
    eager = transformers.LlamaForCausalLM.from_pretrained(llama, attn_implementation="eager")
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits[mask.bool()]
        want = eager(input_ids=ids, attention_mask=mask).logits[mask.bool()]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_warn_mode_leaves_the_error_and_says_what_fix_mode_would_do(llama: Any) -> None:
    plain = _unguarded(llama)
    attnguard.activate(log="none", mode="warn")
    with events.capture() as seen, pytest.raises(type(plain)) as guarded:
        _load(llama)
    assert str(guarded.value) == str(plain)
    assert _said(seen) == [("backend_fallback", "hub_package_missing", False)]


def test_strict_mode_raises_attnguards_error(llama: Any) -> None:
    attnguard.activate(log="none", mode="strict")
    with pytest.raises(AttnGuardError) as err:
        _load(llama)
    assert err.value.reason_code == "hub_package_missing" and HUB in err.value.reason


def test_the_remedy_switched_off_leaves_the_error_and_says_so(llama: Any) -> None:
    plain = _unguarded(llama)
    attnguard.activate(log="none", disable=["fallback"])
    with events.capture() as seen, pytest.raises(type(plain)) as guarded:
        _load(llama)
    assert str(guarded.value) == str(plain)
    assert _said(seen) == [("observed", "hub_package_missing", None)]
    assert "ATTNGUARD_DISABLE" in [e for e in seen if e["event"] == "observed"][0]["reason"]
