"""The model zoo on a GPU with the real flash-attn: attnguard over a kernel that runs changes
nothing (the GPU half of tests/test_zoo.py).

Every model type of the installed transformers that declares flash support (tests/workers/zoo.py),
built tiny and saved in bf16, is loaded with ``attn_implementation="flash_attention_2"``,
``dtype=torch.bfloat16``, ``device_map={"": 0}`` and run on its plain, left-padded and packed
batches, first without attnguard and then with it, in worker processes that have the real
flash-attn 2.8.3 on their path (tests/workers/zoo_gpu_worker.py; shards in parallel so the whole
zoo takes well under two minutes). Each built model must come out the same both ways: the same
outputs bit for bit (within its own run-to-run spread where the model itself is not
deterministic), or the same error. attnguard changes an outcome ("remedied") only where the
unguarded load fails: transformers refused the flash request at load (a sub-model without flash
support), or the hub kernel transformers routes the model to (attention sinks:
kernels-community/vllm-flash-attn3) cannot load here (no `kernels` package on the GPU image), and
the twins compute it (their numbers against eager: tests/gpu/test_hub_gpu.py, and on the CPU the
zoo's exact check). Results go to $GPU_RESULTS/zoo/zoo_gpu.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

import gpuenv  # noqa: E402

WORKER = gpuenv.WORKERS / "zoo_gpu_worker.py"
POISONED = 3  # the worker's exit status when CUDA became unusable (zoo_gpu_worker.py)
LIMIT_S = 300  # per worker (a hung worker is a failure, not a hung suite)


def test_guard_over_the_real_kernel_changes_no_outcome(
    tmp_path: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    gpuenv.require()
    shards = max(1, min(8, (os.cpu_count() or 2) // 2))
    env = gpuenv.child_env(
        real=True, CUDA_VISIBLE_DEVICES="0", ZOO_THREADS="2", CUDA_LAUNCH_BLOCKING="1"
    )
    start = time.monotonic()
    outs = [tmp_path / f"shard{shard}.jsonl" for shard in range(shards)]

    def spawn(shard: int, first: int) -> subprocess.Popen[str]:
        root = tmp_path / f"models{shard}"
        root.mkdir(exist_ok=True)
        cmd = [gpuenv.PY, str(WORKER), str(shard), str(shards), str(outs[shard]), str(root)]
        return subprocess.Popen([*cmd, str(first)], env=env, stderr=subprocess.PIPE, text=True)

    running = {shard: spawn(shard, 0) for shard in range(shards)}
    errors, restarts = [], 0
    while running:
        for shard, proc in list(running.items()):
            try:
                _, stderr = proc.communicate(timeout=max(1, LIMIT_S - (time.monotonic() - start)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                errors.append(f"{outs[shard].name}: over {LIMIT_S}s")
                del running[shard]
                continue
            del running[shard]
            if proc.returncode == POISONED:  # CUDA unusable after a model: on in a fresh worker
                restarts += 1
                last = json.loads(outs[shard].read_text().splitlines()[-1])
                running[shard] = spawn(shard, last["index"] + (0 if last.get("pending") else 1))
            elif proc.returncode != 0:
                errors.append(f"{outs[shard].name}: exit {proc.returncode}: {stderr[-2000:]}")
    assert not errors, errors
    lines = [json.loads(x) for out in outs for x in out.read_text().splitlines()]
    lines = [x for x in lines if not x.get("pending")]
    seconds = time.monotonic() - start
    counts: dict[str, int] = {}
    for line in lines:
        counts[line["outcome"]] = counts.get(line["outcome"], 0) + 1
    report = {"seconds": round(seconds, 1), "shards": shards, "restarts": restarts,
              "counts": counts, "models": lines}  # fmt: skip
    results = gpuenv.results_dir(tmp_path_factory, "zoo") / "zoo_gpu.json"
    results.write_text(json.dumps(report, indent=1))
    print(f"zoo on the GPU: {counts} in {seconds:.0f}s over {shards} workers, {restarts} restarts")
    differs = [f"{x['cls']}: {x['detail']}" for x in lines if x["outcome"] == "differs"]
    assert not differs, differs
    # attnguard changes an outcome only where transformers refused the flash request at load
    # (a sub-model without flash support), or where the hub kernel it routes the model to cannot
    # load (transformers' own ImportError about the kernels package): the load then runs on what
    # the guard can run
    remedied = [x for x in lines if x["outcome"] == "remedied"]
    print("remedied:", [f"{x['cls']}: {x['detail'][:160]}" for x in remedied])
    refused = [
        x
        for x in remedied
        if "Flash Attention" not in x["detail"] and "`kernels`" not in x["detail"]
    ]
    assert not refused, refused
    assert counts.get("same", 0) >= 0.6 * len(lines), counts
