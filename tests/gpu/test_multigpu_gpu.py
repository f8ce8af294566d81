"""Family C on two GPUs: torchrun x2 + device_map="auto" + a tiny Qwen2.5-VL, image+text generate.

Runs scripts/torchrun_vl.py (the user's script, unchanged) four ways:

* reference: one process, the whole model on cuda:0;
* torchrun x2, no attnguard: recorded (fails, or every rank spreads over both GPUs);
* torchrun x2 with ATTNGUARD=1: each rank on its own GPU, outputs equal to the reference,
  ``device_map_rewritten`` per rank, one aggregated ``summary`` (rank 0's);
* one process with ATTNGUARD=1 and device_map="auto": split over both GPUs on purpose, left alone.

ATTNGUARD=1 reaches torchrun's workers through attnguard's interpreter start-up hook, so attnguard
must be installed (``pip install .``, or the two files of hook/ copied into site-packages).
Everything the runs produced is written to ``$MULTIGPU_RESULTS`` (default: the test's tmp dir) as
one JSON file, for the closing note.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.models import CLASS_DEFAULT, tiny_config
from helpers.processes import PY, REPO, subprocess_env

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

SCRIPT = REPO / "scripts" / "torchrun_vl.py"

if torch.cuda.device_count() < 2:
    pytest.skip("needs two or more CUDA GPUs", allow_module_level=True)


def _env(**extra: str) -> dict[str, str]:
    env = subprocess_env()
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def _hook_installed() -> bool:
    probe = "import sys; print('attnguard' in sys.modules)"
    res = subprocess.run(
        [PY, "-c", probe], env=_env(ATTNGUARD="1", ATTNGUARD_LOG="none"), capture_output=True
    )
    return res.stdout.decode().strip() == "True"


def _launch(out: Path, model: Path, *, nproc: int, guarded: bool, device_map: str) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = _env(ATTNGUARD="1" if guarded else "0")
    if guarded:
        env["ATTNGUARD_LOG"] = str(out / "events-{rank}.jsonl")
    args = [str(SCRIPT), "--model", str(model), "--out", str(out), "--device-map", device_map]
    if nproc > 1:
        cmd = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
        cmd += args
    else:
        cmd = [PY, *args]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    results = {}
    for rank in range(nproc):
        path = out / f"result-{rank}.json"
        results[rank] = json.loads(path.read_text()) if path.exists() else None
    evs = {}
    for rank in range(nproc):
        path = out / f"events-{rank}.jsonl"
        evs[rank] = (
            [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
        )
    return {
        "cmd": " ".join(cmd[1:]),
        "guarded": guarded,
        "returncode": res.returncode,
        "output_tail": (res.stdout + res.stderr)[-3000:],
        "results": results,
        "events": evs,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if not _hook_installed():
        pytest.skip("attnguard's start-up hook is not installed (pip install . on this machine)")
    base = tmp_path_factory.mktemp("family_c")
    model = base / "tiny-qwen2.5-vl"
    subprocess.run([PY, str(SCRIPT), "--make-model", str(model)], env=_env(), check=True)
    got = {
        "reference": _launch(base / "ref", model, nproc=1, guarded=False, device_map="cuda:0"),
        "torchrun_unguarded": _launch(
            base / "unguarded", model, nproc=2, guarded=False, device_map="auto"
        ),
        "torchrun_guarded": _launch(
            base / "guarded", model, nproc=2, guarded=True, device_map="auto"
        ),
        "single_process_auto_guarded": _launch(
            base / "single", model, nproc=1, guarded=True, device_map="auto"
        ),
    }
    record = Path(os.environ.get("MULTIGPU_RESULTS", base / "multigpu_results.json"))
    slim = {
        name: {
            **{k: v for k, v in run.items() if k != "events"},
            "results": {
                r: {k: v for k, v in (res or {}).items() if k not in ("first_logits", "traceback")}
                for r, res in run["results"].items()
            },
            "events": {
                r: [
                    {k: e.get(k) for k in ("event", "site", "reason_code", "reason", "rank", "pid")}
                    for e in evs
                ]
                for r, evs in run["events"].items()
            },
        }
        for name, run in got.items()
    }
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(slim, indent=1, default=str))
    print(json.dumps(slim, indent=1, default=str))
    return got


def _reference(runs: dict[str, Any]) -> dict[str, Any]:
    ref = runs["reference"]["results"][0]
    assert ref and ref["ok"], runs["reference"]["output_tail"]
    assert ref["param_devices"] == ["cuda:0"]
    return ref


def test_without_attnguard_every_rank_spreads_or_fails(runs) -> None:
    run = runs["torchrun_unguarded"]
    for rank in (0, 1):
        res = run["results"][rank]
        assert res is not None, run["output_tail"]
        assert not res["attnguard_active"]
        # family C: either the launch breaks, or each rank holds its copy over both GPUs
        assert (not res["ok"]) or len(res["param_devices"]) > 1, res


def test_with_attnguard_each_rank_runs_on_its_own_gpu(runs) -> None:
    ref = _reference(runs)
    run = runs["torchrun_guarded"]
    assert run["returncode"] == 0, run["output_tail"]
    for rank in (0, 1):
        res = run["results"][rank]
        assert res["attnguard_active"] and res["ok"], res
        assert res["param_devices"] == [f"cuda:{rank}"]
        assert res["generated"] == ref["generated"]
        torch.testing.assert_close(
            torch.tensor(res["first_logits"]),
            torch.tensor(ref["first_logits"]),
            atol=1e-5,
            rtol=1e-4,
        )
        (rewrite,) = [e for e in run["events"][rank] if e["event"] == "device_map_rewritten"]
        assert rewrite["rank"] == rank and rewrite["world_size"] == 2
        assert rewrite["before"]["device_map"] == "auto"
        assert rewrite["after"]["device_map"] == {"": f"cuda:{rank}"}


def test_the_aggregated_summary_appears_once(runs) -> None:
    run = runs["torchrun_guarded"]
    every = [e for evs in run["events"].values() for e in evs if e["event"] == "summary"]
    (job,) = [e for e in every if e["site"] == "job"]
    # the workers' own summaries (torchrun's launcher process inherits ATTNGUARD=1 too; it has
    # no RANK, so its lines land in events-0.jsonl: told apart by pid)
    workers = {run["results"][r]["pid"]: r for r in (0, 1)}
    by_worker = {r: [e for e in every if e["pid"] == pid] for pid, r in workers.items()}
    assert by_worker == {0: [job], 1: []}
    assert job["site"] == "job" and job["ranks"] == [0, 1] and job["missing_ranks"] == []
    assert job["events"]["device_map_rewritten"] == 2
    assert job["event_ranks"]["device_map_rewritten"] == [0, 1]


def test_a_single_process_split_over_both_gpus_is_left_alone(runs) -> None:
    ref = _reference(runs)
    run = runs["single_process_auto_guarded"]
    res = run["results"][0]
    assert res["attnguard_active"] and res["ok"], run["output_tail"]
    assert res["param_devices"] == ["cuda:0", "cuda:1"]
    assert res["generated"] == ref["generated"]
    assert not [e for e in run["events"][0] if e["event"] == "device_map_rewritten"]
    (own,) = [e for e in run["events"][0] if e["event"] == "summary"]
    assert own["site"] == "process"


# --- rotary alignment on two real GPUs (in-process, no launcher needed) ----------------------------


def _tiny_llama_over_two_gpus() -> Any:
    import transformers

    cfg = tiny_config(
        "llama",
        hidden_size=32,
        intermediate_size=64,
        max_position_embeddings=CLASS_DEFAULT,
        pad_token_id=CLASS_DEFAULT,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval().to("cuda:0")
    model.model.layers[1].to("cuda:1")  # a hand-made split with no accelerate hooks
    return model


def test_rotary_inputs_from_another_gpu_are_aligned() -> None:
    import attnguard
    from attnguard.integrations.transformers.rotary import (
        install_rotary_alignment,
        remove_rotary_alignment,
    )
    from attnguard.observability import events

    attnguard.activate(log="none")
    try:
        model = _tiny_llama_over_two_gpus()
        rotary = model.model.rotary_emb
        x = torch.randn(1, 6, 32, device="cuda:1")  # hidden states of the layer on cuda:1
        position_ids = torch.arange(6, device="cuda:0")[None]  # built next to input_ids
        ref_cos, ref_sin = type(rotary)(model.config).to("cuda:1")(x, position_ids.to("cuda:1"))
        with pytest.raises(RuntimeError, match="same device"):
            rotary(x, position_ids)  # without attnguard: family C's error
        with events.capture() as got:
            assert install_rotary_alignment(model) == 1
            cos, sin = rotary(x, position_ids)
            rotary(x, position_ids)
        assert cos.device == x.device
        torch.testing.assert_close(cos, ref_cos)
        torch.testing.assert_close(sin, ref_sin)
        (ev,) = [e for e in got if e["event"] == "tensors_aligned"]
        assert ev["site"] == "rotary:LlamaRotaryEmbedding" and ev["target"] == "cuda:1"
        assert "position_ids" in ev["moved"]
        remove_rotary_alignment(model)
    finally:
        attnguard.deactivate()
        events.reset_counts()


# --- the job summary when the script destroys its group (nccl, each rank its own directory) --------

_DESTROY = r"""
import os, sys
# two "nodes": each rank its own private directory, as ranks on two hosts share none
os.environ["XDG_CACHE_HOME"] = os.path.join(sys.argv[2], "cache-" + os.environ["RANK"])
os.environ.pop("XDG_RUNTIME_DIR", None)
import torch, torch.distributed as dist, transformers

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], device_map="auto")
with torch.no_grad():
    model(input_ids=torch.tensor([[1, 2, 3, 4]], device=model.device))
dist.barrier()
dist.destroy_process_group()
"""


def test_the_job_summary_counts_both_ranks_after_destroy_process_group(tmp_path: Path) -> None:
    """torchrun x2 (nccl), every rank's device map rewritten (a change on each rank), the group
    destroyed before exit, no directory shared between the ranks: rank 0's summary counts both."""
    if not _hook_installed():
        pytest.skip("attnguard's start-up hook is not installed (pip install . on this machine)")
    import transformers

    config = tiny_config("llama", max_position_embeddings=CLASS_DEFAULT, pad_token_id=CLASS_DEFAULT)
    model_dir = tmp_path / "tiny-llama"
    transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
    script = tmp_path / "destroy.py"
    script.write_text(_DESTROY)
    env = _env(ATTNGUARD="1", ATTNGUARD_LOG=str(tmp_path / "events-{rank}.jsonl"))
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    res = subprocess.run(
        [*cmd, str(model_dir), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    lines = [json.loads(x) for x in (tmp_path / "events-0.jsonl").read_text().splitlines()]
    (job,) = [e for e in lines if e["event"] == "summary" and e["site"] == "job"]
    assert job["ranks"] == [0, 1] and job["missing_ranks"] == [] and job["silent_ranks"] == []
    assert job["event_ranks"]["device_map_rewritten"] == [0, 1]
    assert job["as_of_group_end"] == []
