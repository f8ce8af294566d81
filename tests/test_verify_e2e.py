"""The numbers check end to end, in fresh interpreters as users run it:

* a program calling flash-attn's ``flash_attn_func`` under ``ATTNGUARD=1 ATTNGUARD_VERIFY=...``,
  flash-attn being a CPU stand-in of 2.8.3 written into the test's directory with a deliberate
  bug (a sliding window one key wider, a softmax scale of ``1/sqrt(head_dim - 1)``), patched by
  attnguard as the real package is: the bug is caught at the documented rate, said in one
  ``numerics_mismatch`` line, counted in the exit summary; the program's numbers are the
  kernel's own; the right stand-in: nothing said, every check passed;
* the same under ``torchrun --nproc-per-node=2`` (gloo), the bug on rank 1 only: rank 0's job
  summary counts checked and mismatched calls per rank;
* ``attnguard run --verify`` sets the check for its command, a bad value stops nothing but the
  run (exit 2);
* a hub kernel (the stand-in of tests/standins/hub_kernel.py) with a bug at one head dimension,
  loaded by transformers through ``LOCAL_KERNELS`` where this transformers accepts a `kernels`
  release that loads it (the smoke lanes of 5.13-5.22): caught for the model of that head
  dimension only.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from helpers.packages import hub_standin, local_kernels_unservable
from helpers.processes import PY, REPO, subprocess_env

WORKER = REPO / "tests" / "workers" / "verify_worker.py"
TIMEOUT_S = 420  # a hang (a collective, the exit summary's wait) fails the test here


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("flash-standin")
    subprocess.run([PY, str(WORKER), "make", str(root)], check=True, timeout=120)
    return root


def _env(standin: Path, log: Path, **extra: str) -> dict[str, str]:
    env = subprocess_env(
        **{
            "ATTNGUARD": "1",  # the start-up hook
            "ATTNGUARD_DISABLE": "reroute",  # on a CPU the stand-in kernel itself computes
            "ATTNGUARD_LOG": str(log),
            "OMP_NUM_THREADS": "1",
            **extra,
        }
    )
    env["PYTHONPATH"] = os.pathsep.join([str(standin), env["PYTHONPATH"]])
    return env


def _events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():  # an unguarded program writes none
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _program(standin: Path, tmp: Path, calls: int, **extra: str) -> tuple[dict, list[dict]]:
    log = tmp / "events.jsonl"
    res = subprocess.run(
        [PY, str(WORKER), "run", str(calls)],
        env=_env(standin, log, **extra),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.splitlines()[-1]), _events(log)


@pytest.mark.smoke
@pytest.mark.parametrize("bug", ["window", "scale"])
def test_a_wrong_flash_attn_build_is_caught_at_the_documented_rate(
    bug: str, standin: Path, tmp_path: Path
) -> None:
    """Rate 0.25 over 16 calls alternating two windows (two buckets of 8): calls 0 and 4 of
    each bucket are checked, all 4 mismatch; the outputs are the kernel's own, as unguarded."""
    got, evts = _program(standin, tmp_path, 16, ATTNGUARD_VERIFY="0.25", FLASH_STANDIN_BUG=bug)
    plain = tmp_path / "plain"
    plain.mkdir()
    want, _ = _program(standin, plain, 16, ATTNGUARD="0", FLASH_STANDIN_BUG=bug)
    assert got["guarded"] and not want["guarded"]
    assert got["sums"] == want["sums"]  # never a changed number
    (said,) = [e for e in evts if e["event"] == "numerics_mismatch"]
    assert said["site"] == "flash_attn.flash_attn_func"
    assert (said["reason_code"], said["level"], said["count"]) == (
        "kernel_numbers_differ",
        "error",
        1,
    )
    assert said["kernel"] == "flash-attn flash_attn_func" and said["reference"] == "twin_float64"
    (summary,) = [e for e in evts if e["event"] == "summary"]
    assert summary["numerics"] == {"checked": 4, "mismatched": 4, "skipped": {}}
    assert summary["level"] == "warning" and "4 mismatched" in summary["reason"]


def test_the_right_build_passes_every_check_quietly(standin: Path, tmp_path: Path) -> None:
    got, evts = _program(standin, tmp_path, 12, ATTNGUARD_VERIFY="all")
    assert got["guarded"]
    assert [e["event"] for e in evts if e["event"] not in ("activated", "summary")] == []
    (summary,) = [e for e in evts if e["event"] == "summary"]
    assert summary["numerics"] == {"checked": 12, "mismatched": 0, "skipped": {}}
    assert summary["level"] == "info"


def test_each_rank_checks_its_own_sample_and_rank_0_counts_them(
    standin: Path, tmp_path: Path
) -> None:
    env = _env(
        standin,
        tmp_path / "events-{rank}.jsonl",
        ATTNGUARD_VERIFY="first:3",
        FLASH_STANDIN_BUG="window",
        FLASH_STANDIN_BUG_RANK="1",
        HF_HUB_OFFLINE="1",
    )
    cmd = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    res = subprocess.run(
        [*cmd, str(WORKER), "run", "10"],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    rank0, rank1 = (_events(tmp_path / f"events-{r}.jsonl") for r in (0, 1))
    (job,) = [e for e in rank0 if e["event"] == "summary"]
    assert job["site"] == "job" and job["missing_ranks"] == []
    # two buckets (two windows) x the first 3 calls each, on each rank; the bug on rank 1 only
    assert job["numerics"] == {
        "checked": 12,
        "mismatched": 6,
        "skipped": {},
        "per_rank": {
            "0": {"checked": 6, "mismatched": 0, "skipped": {}},
            "1": {"checked": 6, "mismatched": 6, "skipped": {}},
        },
    }
    assert "1: 6 checked, 6 mismatched" in job["reason"]
    assert [e["rank"] for e in rank1 if e["event"] == "numerics_mismatch"] == [1]
    assert [e for e in rank0 if e["event"] == "numerics_mismatch"] == []


def test_attnguard_run_sets_the_check_for_its_command(standin: Path, tmp_path: Path) -> None:
    env = _env(standin, tmp_path / "events.jsonl", FLASH_STANDIN_BUG="window")
    env.pop("ATTNGUARD")
    cmd = [PY, "-m", "attnguard", "run", "--verify", "first:1", "--", PY, str(WORKER), "run", "4"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.returncode == 0, res.stderr[-4000:]
    (summary,) = [e for e in _events(tmp_path / "events.jsonl") if e["event"] == "summary"]
    assert summary["numerics"] == {"checked": 2, "mismatched": 2, "skipped": {}}
    bad = subprocess.run(
        [*cmd[:4], "--verify", "often", "--", PY, "-c", "print('ran')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "ran" not in bad.stdout
    assert bad.stderr.count("\n") == 1 and "ATTNGUARD_VERIFY='often'" in bad.stderr


# --- a hub kernel with a bug at one head dimension -------------------------------------------------

# the stand-in's attention, wrong for head_dim 32 only: its causal mask forgotten (a tiny random
# model's attention is nearly uniform, so which keys it averages shows where a scale would not)
_BUG_AT_32 = (
    "    sq, h, d = q.shape\n",
    "    sq, h, d = q.shape\n    if d == 32:\n        causal = False\n",
)


@pytest.mark.smoke
def test_a_hub_kernel_with_a_bug_at_one_head_dimension_is_caught(tmp_path: Path) -> None:
    """Two models on the same hub kernel (loaded by transformers, computing every call): the
    check's first call of each bucket (rate 0.5: calls 0, 2, 4 of 6 per model) finds the head
    dimension where it is wrong, and only there."""
    pytest.importorskip("transformers")

    why = local_kernels_unservable()
    if why:
        pytest.skip(why)
    repo = hub_standin().write_repo(tmp_path / "flash-attn2")
    source = next(repo.rglob("flash_attn2/__init__.py"))
    text = source.read_text()
    assert _BUG_AT_32[0] in text
    source.write_text(text.replace(*_BUG_AT_32))
    env = subprocess_env(
        ATTNGUARD="1",
        ATTNGUARD_VERIFY="0.5",
        ATTNGUARD_LOG=str(tmp_path / "events.jsonl"),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf-home"),
        LOCAL_KERNELS=f"kernels-community/flash-attn2={repo}",
        WORK_DIR=str(tmp_path),
        TQDM_DISABLE="1",
    )
    env["PYTHONPATH"] = os.pathsep.join([os.environ["TEST_KERNELS_DIR"], env["PYTHONPATH"]])
    res = subprocess.run(
        [PY, str(WORKER), "hub", "3"], env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert res.returncode == 0, res.stderr[-4000:]
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["loaded"] == ["kernels-community/flash-attn2"] * 2
    assert got["numerics"] == {"checked": 6, "mismatched": 3, "skipped": {}}
    evts = _events(tmp_path / "events.jsonl")
    (said,) = [e for e in evts if e["event"] == "numerics_mismatch"]
    assert said["kernel"] == "kernels-community/flash-attn2" and said["source"] == "hub"
    assert said["family"] == "flash-attn 2" and said["shapes"]["q"][-1] == 32
    assert said["site"].startswith("transformers.kernels-community/flash-attn2:")
