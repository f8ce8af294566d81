#!/usr/bin/env bash
# The test command (README "Run the tests"): installs attnguard with its test extras into the
# active Python environment, CPU torch pinned so no multi-GB CUDA build is pulled, plus the
# test-only installs that recreate real failure cases, then runs pytest with any arguments given.
#
#   TRANSFORMERS_VERSION=4.57.6 bash scripts/test.sh   # pin transformers too (CI's matrix)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pin=()
[ -n "${TRANSFORMERS_VERSION:-}" ] && pin=("transformers==${TRANSFORMERS_VERSION}")
"$PY" -m pip install -q "torch==2.13.0" "${pin[@]}" -e ".[test]"
# xformers from PyPI, without its torch pin: its CUDA ops never load on a CPU machine — the real
# "xformers installed but unusable" case the guard must carry.
"$PY" -m pip install -q --no-deps "xformers==0.0.35" "numpy"
# The real DeepSpeed (ZeRO-3 on CPU with gloo, tests/test_ranks.py), without its CUDA ops.
DS_BUILD_OPS=0 "$PY" -m pip install -q "torch==2.13.0" "deepspeed==0.19.8"
# A real broken flash-attn install: the PyPI sdist built without its CUDA extension (~12 s, no
# CUDA torch), kept out of the environment so other tests still see flash-attn absent; the tests
# that need it put it on sys.path (TEST_BROKEN_FLASH_ATTN_DIR).
broken="$PWD/.test-deps/flash-attn-nocuda"
if [ ! -d "$broken/flash_attn" ]; then
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
    "$PY" -m pip install -q --no-build-isolation --no-deps --target "$broken" "flash-attn==2.8.3"
fi
export TEST_BROKEN_FLASH_ATTN_DIR="$broken"
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
exit "$rc"
