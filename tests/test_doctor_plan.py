"""``attnguard doctor`` prints the load-time planner's answer for a sample request on this
machine's facts, the decision table and the facts, as text, as JSON and from the command line."""

from __future__ import annotations

import json
from typing import Any

from attnguard import doctor
from attnguard import facts as F
from attnguard.plan import TABLE, plan_load

# --- attnguard doctor: the same planner, on this machine -----------------------------------------


def test_doctor_json_plans_with_the_guard_planner() -> None:
    """The plan doctor shows is the planner's for the request it names, on this machine's facts
    with the settings a guarded run here would use (built here from the public pieces, not from
    doctor's own helpers)."""
    from attnguard import config
    from attnguard.plan import flash_fp32_request

    data = json.loads(doctor.render(as_json=True))
    here = F.current()
    path = data["flash_path"]
    request = flash_fp32_request(
        flash_path_on_twins=path["kept_on_twins"], flash_path_unrecognised=path["why"]
    )
    expected = plan_load(request, here, config.load()).as_dict()
    assert data["sample_request"] == "flash_attention_2 + float32 + no device_map"
    assert data["sample_plan"] == json.loads(json.dumps(expected, default=str))
    assert [r["id"] for r in data["decision_table"]] == [r.id for r in TABLE]
    assert set(data["facts"]["backends"]) == set(F.BACKENDS)
    assert data["facts"]["cuda"] == here.cuda


def test_doctor_text_lists_facts_table_and_plan() -> None:
    text = doctor.render(as_json=False)
    for row in TABLE:
        assert row.id in text
    for name in F.BACKENDS:
        assert name in text
    assert "Plan for flash_attention_2 + float32 + no device_map" in text
    for action in json.loads(doctor.render(as_json=True))["sample_plan"]["actions"]:
        assert action["reason"] in text
    # which kernel computes a call, and why: the questions in the order they are asked
    from attnguard.kernels import QUESTIONS

    at = [text.index(question) for _, question, _ in QUESTIONS]
    assert at == sorted(at)


def test_doctor_cli(capsys: Any) -> None:
    from attnguard.cli import main

    assert main(["doctor", "--json"]) == 0
    assert "sample_plan" in json.loads(capsys.readouterr().out)
