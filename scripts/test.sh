#!/usr/bin/env bash
# The test command (README "Run the tests"): prepares the active Python environment and the
# test-only packages (scripts/testenv.py says what it installs or reuses as it goes), runs pytest
# with any arguments given, names the torch and transformers it tested, and says where its time
# went (set-up, tests).
#
#   bash scripts/test.sh -m smoke                        # the quick check
#   TRANSFORMERS_VERSION=4.57.6 bash scripts/test.sh     # pin transformers too (installed)
#   TORCH_VERSION=2.8.0 bash scripts/test.sh             # install this torch first
#   TEST_DEPS_DIR=/elsewhere bash scripts/test.sh        # the test-only packages elsewhere (CI)
#   TEST_TRANSFORMERS_OVERLAY=1 TRANSFORMERS_VERSION=... # CI's smoke lanes: transformers on the
#                                                        # test run's path, the environment unchanged
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
started=$EPOCHREALTIME
seconds() { # seconds FROM TO ($EPOCHREALTIME values), rounded
  local from=${1//[.,]/} to=${2//[.,]/}
  echo $(((to - from + 500000) / 1000000))
}
echo "scripts/test.sh: preparing $("$PY" -c 'import sys; print(sys.prefix)') and the test-only packages" >&2
setup=$("$PY" scripts/testenv.py setup) || exit 1
eval "$setup"

# README's two commands (the full suite, `-m smoke`) record their counts and minutes
# (tests/conftest.py); README's ranges are checked against that record after the run
kind=""
[ "$#" -eq 0 ] && kind=full
[ "$*" = "-m smoke" ] && kind=smoke
[ "${TEST_ZOO:-}" = all ] && kind=""
record="${TEST_RUNS_DIR:-$PWD/.test-runs}/$kind.json"
[ -n "$kind" ] && rm -f "$record"
set_up=$(seconds "$started" "$EPOCHREALTIME")
export TEST_SETUP_SECONDS=$set_up # recorded with the run (tests/run_record.py)

echo "scripts/test.sh: testing with $TESTED"
tests_started=$EPOCHREALTIME
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
tests=$(seconds "$tests_started" "$EPOCHREALTIME")
echo "scripts/test.sh: tested with $TESTED"
echo "scripts/test.sh: set-up ${set_up} s, tests ${tests} s"
[ -n "${TEST_TIMES_FILE:-}" ] && echo "$set_up $tests" >>"$TEST_TIMES_FILE" # .ci/run's table
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
if [ -n "$kind" ] && [ -f "$record" ] && ! "$PY" tests/run_record.py "$kind"; then
  [ "$rc" -eq 0 ] && rc=1
fi
exit "$rc"
