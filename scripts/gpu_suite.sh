#!/usr/bin/env bash
# attnguard's GPU suite, made for ONE call of the device tool on a 2-GPU H200 machine
# (nvidia-h200-x2; on one GPU the two-GPU parts are skipped and say so). The image has torch 2.11
# (CUDA 13), transformers 5.17, accelerate, wrapt, pytest; no structlog, no flash-attn, no
# internet.
#
#   device run: command "bash scripts/gpu_suite.sh", carry [".gpu-deps", ".whl", ".whl-diffusers"],
#   timeout_s 600
#
# .gpu-deps/flash_attn-2.8.3.post2-cp312-sm90-torch2.11-cu130.tar.xz: the real flash-attn wheel
#   (../shared/wheels), unpacked to /tmp/flashsite; TEST_REAL_FLASH_ATTN_DIR points there. Nothing
#   else puts it on a path: each test that needs it adds it to its own children or sys.path
#   (tests/gpu/gpuenv.py), and "flash-attn absent" runs in processes without it.
# .whl-tf/gpu-wheels.tar.xz (scripts/fetch_gpu_wheels.sh, 6.8 MB; carry ".whl-tf" too when it
#   fits): transformers 4.49.0 / 4.53.3 / 4.54.1 for tests/gpu/test_broken_flash_gpu.py, which
#   installs them itself and skips with the reason without them.
# .whl/: structlog and the PyPI xformers 0.0.35 wheel (its CUDA ops do not load next to torch
#   2.11: the real "xformers unusable" case), installed to /tmp/site.
# .whl-kernels/ (scripts/fetch_kernels_wheels.sh, 13 MB): the `kernels` package at the version
#   the image's transformers accepts and what it needs beyond the image, installed to
#   /tmp/kernels-site; TEST_KERNELS_DIR points there and only tests/gpu/test_hub_gpu.py's and
#   tests/gpu/test_diffusers_hub_gpu.py's programs put it on their path (the latter needs
#   .whl-diffusers too).
# .whl-diffusers/ (scripts/fetch_diffusers_wheels.sh, 19 MB; carry ".whl-diffusers" too when it
#   fits): diffusers 0.42.1 and what it needs beyond the image, installed to
#   /tmp/diffusers-site; TEST_DIFFUSERS_DIR points there and only that test's programs put it on
#   their path. Without it that test skips and says why.
# attnguard's start-up hook (hook/attnguard.pth, hook/_attnguard_hook.py) is copied into
#   python3's site-packages so that ATTNGUARD=1 reaches torchrun's workers; attnguard itself comes
#   from PYTHONPATH. Removed again at exit.
#
# Parts (SUITE_PARTS, default "tests multigpu bench"):
#   tests     one pytest process per tests/gpu file (markers "gpu and not multigpu", GPU 0;
#             SUITE_TEST_FILES names fewer files). test_zoo_gpu.py runs every architecture of
#             the installed transformers guarded and unguarded over the real flash-attn in up
#             to 8 worker processes of its own (results: zoo/zoo_gpu.json)
#   multigpu  tests marked multigpu, both GPUs: test_ranks_gpu.py and test_packed_ranks_gpu.py
#             (one rank per GPU) in one pytest process; test_multigpu_gpu.py and
#             test_examples_gpu.py in another; test_call_gpu.py in a third
#             (SUITE_MULTIGPU_FILES names files for one process instead)
#   bench     SUITE_BENCHES (default "bench_twins bench_kernel bench_kvcache bench_generate", the
#             last two in short versions; bench_fallback too when named; bench_verify, the
#             opt-in numbers check vs off, when named: SUITE_BENCH_VERIFY_ARGS, "--seconds 150")
#             with the real flash-attn on PYTHONPATH, GPU 0, one after the other, then
#             bench/bench_multigpu.py (two GPUs). bench_forward.py / bench_load.py only with
#             SUITE_BENCH_EXTRA=1 and time left (they do not involve flash-attn's kernel)
# `tests` and `multigpu` run at the same time (correctness only; tiny models); `bench` runs
# after them, alone on the machine, because it reports timings.
#
# Time: the device tool stops a command at 600 s, so the whole script keeps to SUITE_BUDGET_S
# (default 560 s). Every part has a hard limit (its whole process tree is killed at it):
# SUITE_TESTS_LIMIT_S (default 330, tests and multigpu), SUITE_BENCH_TWINS_S (200),
# SUITE_BENCH_KERNEL_S (260), SUITE_BENCH_KVCACHE_S (60), SUITE_BENCH_GENERATE_S (100; its
# arguments SUITE_BENCH_GENERATE_ARGS, default "--rounds 6 --seconds 45"),
# SUITE_BENCH_FALLBACK_S (200),
# SUITE_BENCH_MULTIGPU_S (150), each cut to what the budget has left. Run the parts in two calls
# (SUITE_PARTS="tests multigpu", then SUITE_PARTS=bench) to give each more time.
#
# Output ($OUT, at most 3 files, no folders): results.md (versions, each part's pytest summary
# lines with skip reasons and final line, the semantics and stand-in comparisons, the benchmark
# tables, and a results table at the end, also printed), gpu_suite.log (every log in full),
# gpu_results.tar.gz (what the tests measured, JSON, under results/, and each part's log).
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${SUITE_BUDGET_S:-560}
OUT=${OUT:-/tmp/attnguard-gpu-out}
WORK=${SUITE_WORK:-/tmp/attnguard-gpu}
FLASH_SHA256=23962e3e6dacbe5bccddfd9d9f1c9c2c1cb568477b3a4a94c1de79f832553301
parts=" ${SUITE_PARTS:-tests multigpu bench} "
mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/results" "$WORK/rc" "$WORK/pt"
log="$OUT/gpu_suite.log"
results="$OUT/results.md"
: >"$log"

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export GPU_RESULTS="$WORK/results"
export LOAD_GPU_RESULTS="$WORK/results/load_gpu.json"
export MULTIGPU_RESULTS="$WORK/results/multigpu_results.json"

elapsed() { echo $(($(date +%s) - START)); }
left() { echo $((START + BUDGET - $(date +%s))); }
say() { echo "[suite +$(elapsed)s] $*" | tee -a "$log"; }
min() { if [ "$1" -lt "$2" ]; then echo "$1"; else echo "$2"; fi; }

descendants() {
  local child
  for child in $(pgrep -P "$1" 2>/dev/null); do
    echo "$child"
    descendants "$child"
  done
}

# run_limited LIMIT_S LOGFILE CMD...: CMD with its output in LOGFILE; at LIMIT_S the command and
# every process it started (pytest's children, torchrun's workers) are stopped. Returns CMD's
# exit status, or 124 when the limit stopped it.
run_limited() {
  local limit=$1 logf=$2 pid waited=0 tree
  shift 2
  "$@" >"$logf" 2>&1 &
  pid=$!
  while kill -0 "$pid" 2>/dev/null; do
    if [ "$waited" -ge "$limit" ]; then
      tree="$pid $(descendants "$pid")"
      echo "[suite] stopped at its limit of ${limit}s" >>"$logf"
      # shellcheck disable=SC2086
      kill -TERM $tree 2>/dev/null
      sleep 5
      # shellcheck disable=SC2086
      kill -KILL $tree 2>/dev/null
      wait "$pid" 2>/dev/null
      return 124
    fi
    sleep 1
    waited=$((waited + 1))
  done
  wait "$pid"
}

# pytest_job NAME LIMIT_S DEVICES PYTEST_ARGS...: one pytest process; its exit status and wall
# time go to $WORK/rc/NAME.
pytest_job() {
  local name=$1 limit=$2 devices=$3 t0 rc
  shift 3
  t0=$(date +%s)
  if [ "$devices" = all ]; then
    run_limited "$limit" "$WORK/logs/$name.log" python3 -m pytest "$@" -v -rA \
      -p no:cacheprovider --basetemp="$WORK/pt/$name"
  else
    run_limited "$limit" "$WORK/logs/$name.log" env CUDA_VISIBLE_DEVICES="$devices" \
      python3 -m pytest "$@" -v -rA -p no:cacheprovider --basetemp="$WORK/pt/$name"
  fi
  rc=$?
  echo "$rc $(($(date +%s) - t0)) $limit" >"$WORK/rc/$name"
}

# --- setup ---------------------------------------------------------------------------------------
say "setup (budget ${BUDGET}s, parts:${parts})"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl >>"$log" 2>&1 || say "pip install of .whl/ failed (see the log)"
  export PYTHONPATH="/tmp/site:$PWD"
else
  say ".whl/ is missing: no structlog (attnguard needs it) and no xformers"
  export PYTHONPATH="$PWD"
fi

diffusers_line="diffusers: none (.whl-diffusers/ missing): tests/gpu/test_diffusers_gpu.py skips"
if ls .whl-diffusers/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/diffusers-site
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/diffusers-site .whl-diffusers/*.whl >>"$log" 2>&1; then
    export TEST_DIFFUSERS_DIR=/tmp/diffusers-site
    diffusers_line="diffusers: $(ls .whl-diffusers/*.whl | wc -l) wheels of .whl-diffusers/ -> /tmp/diffusers-site"
  else
    diffusers_line="diffusers: pip install of .whl-diffusers/ failed (see the log): its test skips"
  fi
fi
say "$diffusers_line"

kernels_line="kernels: none (.whl-kernels/ missing): the stand-in hub kernel test skips"
if ls .whl-kernels/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/kernels-site
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --target /tmp/kernels-site .whl-kernels/*.whl >>"$log" 2>&1; then
    export TEST_KERNELS_DIR=/tmp/kernels-site
    kernels_line="kernels: $(ls .whl-kernels/kernels-*.whl | xargs -n1 basename) -> /tmp/kernels-site"
  else
    kernels_line="kernels: pip install of .whl-kernels/ failed (see the log): its test skips"
  fi
fi
say "$kernels_line"

flash_tar=$(ls .gpu-deps/flash_attn-*.tar.xz 2>/dev/null | head -n 1)
flash_line="real flash-attn: none (.gpu-deps/flash_attn-*.tar.xz missing): its tests skip"
if [ -n "$flash_tar" ]; then
  sha=$(sha256sum "$flash_tar" | cut -d' ' -f1)
  [ "$sha" = "$FLASH_SHA256" ] && sha_note="sha256 as in ../shared/wheels/README.md" ||
    sha_note="sha256 $sha DIFFERS from the README's $FLASH_SHA256"
  rm -rf /tmp/flashsite && mkdir -p /tmp/flashsite
  if tar xJf "$flash_tar" -C /tmp/flashsite >>"$log" 2>&1; then
    export TEST_REAL_FLASH_ATTN_DIR=/tmp/flashsite
    probe=$(PYTHONPATH="/tmp/flashsite:$PYTHONPATH" python3 -c \
      "import torch, flash_attn, flash_attn_2_cuda; print('flash-attn', flash_attn.__version__, '(CUDA extension imports)')" \
      2>&1 | tail -n 1)
    flash_line="real flash-attn: $(basename "$flash_tar") -> /tmp/flashsite; $sha_note; $probe"
  else
    flash_line="real flash-attn: unpacking $flash_tar failed (see the log): its tests skip"
  fi
fi
say "$flash_line"

site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
hook_files=""
if cp hook/attnguard.pth hook/_attnguard_hook.py "$site/" 2>>"$log"; then
  hook_files="$site/attnguard.pth $site/_attnguard_hook.py"
fi
cleanup() {
  # shellcheck disable=SC2086
  [ -n "$hook_files" ] && rm -f $hook_files
}
trap cleanup EXIT
hook_check=$(ATTNGUARD=1 ATTNGUARD_LOG=none python3 -c \
  "import sys; print('active' if 'attnguard' in sys.modules else 'NOT active')" 2>&1 | tail -n 1)
say "start-up hook in $site: ATTNGUARD=1 -> attnguard $hook_check"

ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>>"$log" || echo 0)
{
  echo "# attnguard GPU suite, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo '```'
  nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv 2>&1
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())" 2>&1 | tail -n 1
  python3 -c "import importlib.metadata as m; print('xformers', m.version('xformers'), '/ structlog', m.version('structlog'))" 2>&1 | tail -n 1
  echo "$flash_line"
  echo "$diffusers_line"
  echo "$kernels_line"
  echo "start-up hook: ATTNGUARD=1 -> attnguard $hook_check"
  # the device's copy of the tree has no trustworthy .git: name the code by its content instead
  # (the same command on the checkout says which commit that is)
  echo "attnguard sources: sha256 $(find attnguard -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum | cut -c1-12) (find attnguard -name '*.py' | LC_ALL=C sort | xargs cat | sha256sum)"
  echo "parts:${parts}; budget ${BUDGET}s"
  echo '```'
} >"$results"

# --- tests and multigpu (at the same time) --------------------------------------------------------
order=()
bench_reserve=0
if [[ $parts == *" bench "* ]]; then
  bench_reserve=$((ngpu >= 2 ? 200 : 120))
fi
limit=$(min "${SUITE_TESTS_LIMIT_S:-330}" $(($(left) - bench_reserve - 20)))
if [[ $parts == *" tests "* || $parts == *" multigpu "* ]] && [ "$limit" -lt 60 ]; then
  say "only ${limit}s for tests: raise SUITE_BUDGET_S or run fewer parts"
  limit=60
fi
if [[ $parts == *" tests "* ]]; then
  say "tests: one pytest process per file on GPU 0, limit ${limit}s each"
  for f in ${SUITE_TEST_FILES:-tests/gpu/test_*.py}; do
    case "$f" in
      tests/gpu/test_multigpu_gpu.py | tests/gpu/test_ranks_gpu.py) continue ;; # multigpu only
    esac
    name="tests-$(basename "$f" .py)"
    order+=("$name")
    pytest_job "$name" "$limit" 0 "$f" -m "gpu and not multigpu" &
  done
fi
if [[ $parts == *" multigpu "* ]]; then
  if [ "$ngpu" -ge 2 ] && [ -n "${SUITE_MULTIGPU_FILES:-}" ]; then
    say "multigpu: ${SUITE_MULTIGPU_FILES} in one pytest process on both GPUs, limit ${limit}s"
    order+=(multigpu-files)
    # shellcheck disable=SC2086 # a list of files
    pytest_job multigpu-files "$limit" all $SUITE_MULTIGPU_FILES -m multigpu &
  elif [ "$ngpu" -ge 2 ]; then
    say "multigpu: three pytest processes on both GPUs, limit ${limit}s each"
    order+=(multigpu-ranks multigpu-others multigpu-call)
    pytest_job multigpu-ranks "$limit" all tests/gpu/test_ranks_gpu.py \
      tests/gpu/test_packed_ranks_gpu.py -m multigpu &
    pytest_job multigpu-others "$limit" all tests/gpu/test_multigpu_gpu.py \
      tests/gpu/test_examples_gpu.py -m multigpu &
    # test_call_gpu puts the real flash-attn on sys.path itself: its own process, or transformers
    # has already decided flash-attn is absent
    pytest_job multigpu-call "$limit" all tests/gpu/test_call_gpu.py -m multigpu &
  else
    say "multigpu: skipped, $ngpu GPU(s) visible"
    echo -e "\n## multigpu\n\nskipped: $ngpu GPU(s) visible, two needed" >>"$results"
  fi
fi
wait
say "tests done"

describe_rc() {
  case "$1" in
    0) echo "ok" ;;
    1) echo "FAILURES" ;;
    2) echo "interrupted / collection errors" ;;
    5) echo "nothing ran (none collected or selected)" ;;
    124) echo "STOPPED at its time limit" ;;
    *) echo "exit code $1" ;;
  esac
}

for name in "${order[@]}"; do
  read -r rc secs lim <"$WORK/rc/$name" || { rc=?; secs=?; lim=?; }
  {
    echo
    echo "## $name: $(describe_rc "$rc") (${secs}s of ${lim}s)"
    echo
    echo '```'
    grep -E "^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) " "$WORK/logs/$name.log" | cut -c1-400
    grep -E "^=+ .*(passed|failed|skipped|error|deselected|no tests ran).* =+$" \
      "$WORK/logs/$name.log" | tail -n 1
    [ "$rc" = 124 ] && tail -n 5 "$WORK/logs/$name.log"
    echo '```'
  } >>"$results"
done

# what the comparisons measured, in short (the JSON is in gpu_results.tar.gz)
python3 - "$WORK/results" >>"$results" 2>>"$log" <<'PY'
import json, sys
from pathlib import Path

base = Path(sys.argv[1])
sem = base / "semantics" / "semantics.json"
GROUPS = {
    "packed_cache": "packed row (use_cache False/True)",
    "packed_alone": "its sequences alone",
    "padded_cache": "left-padded batch (use_cache False/True)",
    "kernel_packed_vs_alone": "kernel itself: packed row = sequences alone",
}
if sem.exists():
    data = json.loads(sem.read_text())
    print("\n## twins vs the real kernel on models\n")
    print("Worst check of each group: max |twins - kernel| at real tokens, and its bound.\n")
    print("| family | what | err | bound | all ok |")
    print("|---|---|---|---|---|")
    for family, checks in data["compared"].items():
        for prefix, label in GROUPS.items():
            group = [r for k, r in checks.items() if k.startswith(prefix)]
            if group:
                worst = max(group, key=lambda r: r["err"] / max(r["bound"], 1e-12))
                ok = all(r["ok"] for r in group)
                print(f"| {family} | {label} | {worst['err']:.3g} | {worst['bound']:.3g} | {ok} |")
        for i, row in enumerate(checks["generate"]["rows"]):
            first = row["first_difference"]
            what = "tokens equal" if first is None else (
                f"tokens differ from step {first}, kernel margin {row['kernel_margin']:.3g} "
                f"({'near-tie' if row['near_tie'] else 'NOT a tie'})")
            print(f"| {family} | generate row {i}: {what} | {row['scores_err']:.3g} "
                  f"| {row['bound']:.3g} | {row['ok']} |")
zoo = base / "zoo" / "zoo_gpu.json"
if zoo.exists():
    data = json.loads(zoo.read_text())
    print("\n## the model zoo with the real flash-attn, guarded vs unguarded\n")
    print(f"{data['counts']} in {data['seconds']} s over {data['shards']} workers")
    for m in data["models"]:
        if m["outcome"] == "differs":
            print(f"- {m['cls']}: {m['detail']}")
cmp_ = base / "standin_vs_real" / "comparison.json"
if cmp_.exists():
    data = json.loads(cmp_.read_text())
    print("\n## stand-in vs the real kernel: cases that differ\n")
    rows = []
    for name, r in data["cases"].items():
        notes = []
        if not r["same_inputs"]:
            notes.append("inputs differ")
        if name.startswith("err_"):
            re_, se = r["real_error"], r["standin_error"]
            if re_ is None or se is None:
                notes.append(f"raised: real {re_ and re_[0]}, stand-in {se and se[0]}")
            elif not (r["same_type"] and r["same_message"]):
                first = lambda e: (e[1].splitlines() or [""])[0][:160]  # noqa: E731
                notes.append(f"real {re_[0]}: {first(re_)!r} / stand-in {se[0]}: {first(se)!r}")
        else:
            if r["real_error"] or r["standin_error"]:
                notes.append(f"raised: real {r['real_error'] and r['real_error'][0]}, "
                             f"stand-in {r['standin_error'] and r['standin_error'][0]}")
            if "out_err" in r and r["out_err"] > r["out_bound"]:
                notes.append(f"out err {r['out_err']:.3g} > {r['out_bound']:.3g}")
            if "lse_err" in r and (not r["lse_same_inf"] or r["lse_err"] > 1e-3):
                notes.append(f"lse err {r['lse_err']:.3g}, inf rows {r['lse_inf_rows']}")
            if r.get("caches_equal") is False:
                notes.append("KV caches differ")
        if notes:
            rows.append(f"- {name}: {'; '.join(notes)}")
    print("\n".join(rows) if rows else "none")
PY

# --- bench (alone) --------------------------------------------------------------------------------
bench_row=()
bench() {  # NAME LIMIT_S ENV... -- CMD...
  local name=$1 lim=$2 t0 rc
  shift 2
  if [ "$lim" -lt 45 ]; then
    say "$name: skipped, ${lim}s left"
    echo -e "\n## $name\n\nskipped: only ${lim}s of the budget left" >>"$results"
    bench_row+=("| bench | $name | skipped (time) | | | | | | |")
    return
  fi
  say "$name: limit ${lim}s"
  t0=$(date +%s)
  run_limited "$lim" "$WORK/logs/$name.log" "$@"
  rc=$?
  {
    echo
    echo "## $name: exit $rc$([ "$rc" = 124 ] && echo ', STOPPED at its time limit') ($(($(date +%s) - t0))s of ${lim}s)"
    echo
    echo '```'
    grep -vE "^\{|^\[\{|Loading weights|Writing model shards|it/s\]$|Warning|warn\(" \
      "$WORK/logs/$name.log" | tail -n 40 | cut -c1-400
    echo '```'
  } >>"$results"
  bench_row+=("| bench | $name | $( [ "$rc" = 0 ] && echo ok || echo "exit $rc") | | | | | | $(($(date +%s) - t0)) |")
}
if [[ $parts == *" bench "* ]]; then
  reserve=$((ngpu >= 2 ? 60 : 0))
  real_path="${TEST_REAL_FLASH_ATTN_DIR:-/nonexistent}:$PYTHONPATH"
  for b in ${SUITE_BENCHES:-bench_twins bench_kernel bench_kvcache bench_generate}; do
    args=()
    case "$b" in
      bench_twins) lim=${SUITE_BENCH_TWINS_S:-200} ;;
      bench_kernel) lim=${SUITE_BENCH_KERNEL_S:-260} ;;
      # short versions: the KV-cache twin per call and per decode step against the real kernel;
      # generate / a decode step / host µs per call without attnguard, guarded and fastest
      bench_kvcache) lim=${SUITE_BENCH_KVCACHE_S:-60} args=(--parts calls,step --rounds 3 --iters 50) ;;
      bench_generate) # SUITE_BENCH_GENERATE_ARGS: the long run, e.g. "--seconds 480"
        lim=${SUITE_BENCH_GENERATE_S:-100}
        read -r -a args <<<"${SUITE_BENCH_GENERATE_ARGS:---rounds 6 --seconds 45}" ;;
      bench_verify) # the numbers check at its default rate vs off: training steps, generate
        lim=${SUITE_BENCH_VERIFY_S:-420}
        read -r -a args <<<"${SUITE_BENCH_VERIFY_ARGS:---seconds 150}" ;;
      *) lim=${SUITE_BENCH_FALLBACK_S:-200} ;;
    esac
    bench "$b" "$(min "$lim" $(($(left) - 15 - reserve)))" \
      env CUDA_VISIBLE_DEVICES=0 PYTHONPATH="$real_path" python3 "bench/$b.py" ${args[@]+"${args[@]}"}
  done
  if [ "$ngpu" -ge 2 ]; then
    bench bench_multigpu "$(min "${SUITE_BENCH_MULTIGPU_S:-150}" $(($(left) - 15)))" \
      python3 bench/bench_multigpu.py
  else
    bench_row+=("| bench | bench_multigpu | skipped ($ngpu GPU) | | | | | | |")
  fi
  if [ "${SUITE_BENCH_EXTRA:-0}" = 1 ]; then
    for b in bench_load bench_forward; do
      bench "$b" "$(min 240 $(($(left) - 15)))" env CUDA_VISIBLE_DEVICES=0 python3 "bench/$b.py"
    done
  fi
fi

# --- the results table, logs, the bundle ----------------------------------------------------------
count() { grep -E "^=+ .* =+$" "$1" 2>/dev/null | tail -n 1 | grep -oE "[0-9]+ $2" | grep -oE "^[0-9]+" || echo 0; }
{
  echo
  echo "## Results ($(elapsed)s of the ${BUDGET}s budget)"
  echo
  echo "| part | run | outcome | passed | failed | errors | skipped | xfailed | seconds |"
  echo "|---|---|---|---|---|---|---|---|---|"
  for name in "${order[@]}"; do
    read -r rc secs _ <"$WORK/rc/$name" || { rc=?; secs=?; }
    f="$WORK/logs/$name.log"
    echo "| ${name%%-*} | ${name#*-} | $(describe_rc "$rc") | $(count "$f" passed) | $(count "$f" failed) | $(count "$f" 'errors?') | $(count "$f" skipped) | $(count "$f" xfailed) | $secs |"
  done
  for row in "${bench_row[@]+"${bench_row[@]}"}"; do echo "$row"; done
} >>"$results"

for f in "$WORK"/logs/*.log; do
  [ -e "$f" ] || continue
  {
    echo
    echo "===== $(basename "$f") ====="
    cat "$f"
  } >>"$log"
done
tar czf "$OUT/gpu_results.tar.gz" -C "$WORK" results logs 2>>"$log"
if [ "$(stat -c %s "$OUT/gpu_results.tar.gz" 2>/dev/null || echo 0)" -gt 15000000 ]; then
  tar czf "$OUT/gpu_results.tar.gz" -C "$WORK" results 2>>"$log" # the logs are in gpu_suite.log
fi
say "done: $OUT/results.md, $OUT/gpu_suite.log, $OUT/gpu_results.tar.gz"
cat "$results"
