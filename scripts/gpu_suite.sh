#!/usr/bin/env bash
# The whole GPU suite in one go, for the GPU machine (device tool; torch 2.11 + transformers 5.17,
# no structlog / flash-attn / internet). Carry .whl (structlog + the PyPI xformers wheel, whose
# CUDA ops do not load next to torch 2.11: the real "xformers unusable" case).
#
#   bash scripts/gpu_suite.sh            # writes $OUT/gpu_suite.log and $OUT/results.md
#   SUITE_PARTS="tests bench" ...         # choose parts: tests multigpu bench
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/attnguard-gpu-out}
mkdir -p "$OUT"
log="$OUT/gpu_suite.log"
results="$OUT/results.md"
parts=${SUITE_PARTS:-"tests multigpu bench"}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >>"$log" 2>&1
  export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
{
  echo "# attnguard GPU suite — $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
  python3 -c "import importlib.metadata as m; print('xformers', m.version('xformers'))" 2>&1 | tail -n 1
  echo '```'
} >"$results"

section() { echo; echo "## $1"; echo; } >>"$results"

if [[ " $parts " == *" tests "* ]]; then
  section "GPU tests (tests/gpu, one GPU)"
  # one process per file: the flash_attn stand-in one file imports must not leak into the next
  for f in tests/gpu/test_*.py; do
    [ "$f" = tests/gpu/test_multigpu_gpu.py ] && continue
    CUDA_VISIBLE_DEVICES=0 python3 -m pytest "$f" -m "gpu and not multigpu" -v -rA \
      -p no:cacheprovider >"$OUT/part.log" 2>&1
    rc=$?
    cat "$OUT/part.log" >>"$log"
    echo "$f: exit code $rc" >>"$results"
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL)" "$OUT/part.log" | sed 's/^/    /' >>"$results"
    tail -n 1 "$OUT/part.log" | sed 's/^/    /' >>"$results"
  done
  rm -f "$OUT/part.log"
fi

if [[ " $parts " == *" multigpu "* ]] && [ "$ngpu" -ge 2 ]; then
  section "Multi-GPU tests (two GPUs)"
  # ATTNGUARD=1 must reach torchrun's workers through the start-up hook: install its two files
  # into site-packages (no build backend on an offline machine; attnguard itself is on PYTHONPATH)
  site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  cp hook/attnguard.pth hook/_attnguard_hook.py "$site/"
  python3 -m pytest tests/gpu -m "multigpu" -v -rA -p no:cacheprovider >"$OUT/part.log" 2>&1
  echo "exit code $?" >>"$results"
  cat "$OUT/part.log" >>"$log"
  grep -E "^(PASSED|FAILED|ERROR|SKIPPED)" "$OUT/part.log" | sed 's/^/    /' >>"$results"
  tail -n 1 "$OUT/part.log" | sed 's/^/    /' >>"$results"
  rm -f "$OUT/part.log" "$site/attnguard.pth" "$site/_attnguard_hook.py"
fi

if [[ " $parts " == *" bench "* ]]; then
  for b in bench_load bench_forward; do
    if [ -f "bench/$b.py" ]; then
      section "bench/$b.py"
      echo '```' >>"$results"
      CUDA_VISIBLE_DEVICES=0 timeout 240 python3 "bench/$b.py" >>"$results" 2>>"$log"
      echo "(exit $?)" >>"$results"
      echo '```' >>"$results"
    fi
  done
  if [ -f bench/bench_multigpu.py ] && [ "$ngpu" -ge 2 ]; then
    section "bench/bench_multigpu.py"
    echo '```' >>"$results"
    timeout 300 python3 bench/bench_multigpu.py >>"$results" 2>>"$log"
    echo "(exit $?)" >>"$results"
    echo '```' >>"$results"
  fi
fi
cat "$results"
