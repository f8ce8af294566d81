#!/usr/bin/env bash
# The test command (README "Run the tests"). It tests the torch of the active Python environment,
# whatever release it is (attnguard supports torch >= 2.4; CI runs the newest, the floor and one
# between), and says which: into the environment it installs only attnguard (editable) with its
# `test` extras, keeping its torch; TORCH_VERSION=X installs torch X first; torch 2.13.0 only where
# the environment has none. The test-only packages that recreate real failure cases go into
# .test-deps/ of this checkout, never into the environment, and only the test run sees them; each
# is a version that runs with this torch, or its tests skip and say why:
#
#   .test-deps/xformers-<version>-pyXY/   xformers from PyPI without its torch pin: its CUDA ops
#       never load on a CPU machine ("xformers installed but unusable"); on the PYTHONPATH of
#       the pytest run. 0.0.35 (it needs torch >= 2.10); for an older torch, the newest release
#       built for it (each pins its torch: 0.0.27.post2 for 2.4.0, 0.0.32.post2 for 2.8.0), as
#       pip resolves it beside this torch (once per torch release: remembered in .test-deps/)
#   .test-deps/deepspeed-0.19.8-pyXY/  DeepSpeed without its CUDA ops (ZeRO-3 on CPU with gloo)
#       and the packages it needs that the environment lacks; on the PYTHONPATH of
#       tests/test_ranks.py's DeepSpeed workers only ($TEST_DEEPSPEED_DIR)
#   .test-deps/flash-attn-nocuda/      flash-attn 2.8.3 built without its CUDA extension (a broken
#       install); on the path of the tests that need it only ($TEST_BROKEN_FLASH_ATTN_DIR)
#   .test-deps/kernels-0.11.7-nodeps/  a `kernels` release diffusers refuses (metadata only: no
#       dependencies); for tests/test_diffusers_hub.py's programs ($TEST_KERNELS_REFUSED_DIR)
#   .test-deps/diffusers-0.42.1-pyXY/  diffusers and what it needs that the environment lacks,
#       resolved together with this environment's torch and transformers; on the PYTHONPATH of
#       the pytest run. Where pip cannot install diffusers beside this transformers (diffusers
#       0.42.1 needs huggingface-hub>=1.32, transformers 4.x requires it below 1.0), or it does
#       not import with this torch (it needs torch >= 2.6), there is none: TEST_DIFFUSERS_ABSENT
#       says why and the diffusers tests skip with that reason (elsewhere
#       TEST_DIFFUSERS_EXPECTED=1: diffusers not importing fails them)
#
# Then it runs pytest with any arguments given, and names the torch and transformers it tested.
#
#   TRANSFORMERS_VERSION=4.57.6 bash scripts/test.sh   # pin transformers too (CI's matrix)
#   TORCH_VERSION=2.8.0 bash scripts/test.sh            # install this torch first (CI's torch lanes)
#   TEST_DEPS_DIR=/elsewhere bash scripts/test.sh       # .test-deps/ somewhere else (CI streams)
#   TEST_REUSE_INSTALL=1 TRANSFORMERS_VERSION=...       # CI's smoke lanes: swap transformers only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
version_of() { "$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"; }
no_torch_default=2.13.0 # only where the environment has no torch (README "Install")
had=$(version_of torch 2>/dev/null || true)
if [ -n "${TORCH_VERSION:-}" ]; then
  torch_pin="torch==$TORCH_VERSION" torch_from="TORCH_VERSION"
elif [ -n "$had" ]; then
  torch_pin="torch==${had%%+*}" torch_from="the environment's" # pip keeps it
else
  torch_pin="torch==$no_torch_default" torch_from="none was installed"
fi
pin=()
[ -n "${TRANSFORMERS_VERSION:-}" ] && pin=("transformers==${TRANSFORMERS_VERSION}")
install() { "$PY" -m pip install -q "$torch_pin" "${pin[@]}" -e ".[test]"; }
met() { "$PY" scripts/requirements_met.py "$@" >/dev/null 2>&1; }
if [ "${TEST_REUSE_INSTALL:-0}" = 1 ] && [ -n "${TRANSFORMERS_VERSION:-}" ] && met "attnguard[test]" &&
  met "$torch_pin"; then
  # CI's smoke lanes (TEST_REUSE_INSTALL=1): this checkout is installed in the venv already and
  # only transformers changes; everything is installed as above wherever that leaves a
  # requirement unmet
  "$PY" -m pip install -q --no-deps "transformers==$TRANSFORMERS_VERSION"
  { met "transformers==$TRANSFORMERS_VERSION" && met "attnguard[test]"; } || install
else
  install
fi
tv=$(version_of torch)
tv_pin="torch==${tv%%+*}" # this torch, for pip's plans below
deps="${TEST_DEPS_DIR:-$PWD/.test-deps}" # CI gives each of its parallel streams its own
py=$("$PY" -c 'import sys; print("py%d%d" % sys.version_info[:2])') # compiled parts differ
mkdir -p "$deps"
imports() { # imports DIR MODULE: nothing where MODULE imports with DIR on the path, else its error
  local out
  out=$(PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c "import $2" 2>&1) || echo "${out##*$'\n'}"
}

# xformers: the newest release up to 0.0.35 that pip installs beside this torch, resolved once
# per torch release (each xformers wheel pins the torch it was built for)
xformers_newest=0.0.35
memo="$deps/xformers-for-torch-${tv%%+*}-$py"
if [ ! -s "$memo" ]; then
  plan="$deps/xformers-plan.json"
  if "$PY" -m pip install --dry-run -q --report "$plan" "$tv_pin" \
    "xformers>=0.0.27,<=$xformers_newest" >"$deps/xformers-plan.log" 2>&1; then
    "$PY" -c 'import json, sys
print(*[p["metadata"]["version"] for p in json.load(open(sys.argv[1]))["install"]
        if p["metadata"]["name"] == "xformers"])' "$plan" >"$memo"
  fi
  [ -s "$memo" ] || echo "none: no xformers release up to $xformers_newest installs beside torch $tv" >"$memo"
  rm -f "$plan" "$deps/xformers-plan.log"
fi
xformers_version=$(cat "$memo")
xformers=""
if env_xformers=$(version_of xformers 2>/dev/null); then
  xformers_version="$env_xformers (the environment's)" # on the path already
elif [ "${xformers_version%%:*}" != none ]; then
  xformers="$deps/xformers-$xformers_version-$py"
  if [ ! -d "$xformers/xformers" ]; then
    "$PY" -m pip install -q --no-deps --target "$xformers" "xformers==$xformers_version"
    why=$(imports "$xformers" xformers.ops)
    [ -z "$why" ] || echo "none: xformers $xformers_version does not import with torch $tv: $why" >"$memo"
  fi
  xformers_version=$(cat "$memo")
  [ "${xformers_version%%:*}" != none ] || xformers=""
fi

# What pip would add to this environment for DeepSpeed goes into its directory instead; made
# again when it no longer completes the environment (made for another one that had more).
deepspeed="$deps/deepspeed-0.19.8-$py"
if ! PYTHONPATH="$deepspeed" "$PY" scripts/requirements_met.py "deepspeed==0.19.8" >/dev/null; then
  rm -rf "$deepspeed"
  missing=$(DS_BUILD_OPS=0 "$PY" -m pip install --dry-run -q --report - "$tv_pin" "deepspeed==0.19.8" |
    "$PY" -c 'import json, sys
print(" ".join(p["metadata"]["name"] + "==" + p["metadata"]["version"]
               for p in json.load(sys.stdin)["install"]))')
  # shellcheck disable=SC2086 # one word per requirement
  DS_BUILD_OPS=0 "$PY" -m pip install -q --no-deps --target "$deepspeed" $missing
fi
export TEST_DEEPSPEED_DIR="$deepspeed"

# A real broken flash-attn install: the PyPI sdist built without its CUDA extension (~12 s, no
# CUDA torch); the tests that need it put it on their path (TEST_BROKEN_FLASH_ATTN_DIR).
broken="$deps/flash-attn-nocuda"
if [ ! -d "$broken/flash_attn" ]; then
  FLASH_ATTENTION_SKIP_CUDA_BUILD=TRUE FLASH_ATTENTION_FORCE_BUILD=TRUE \
    "$PY" -m pip install -q --no-build-isolation --no-deps --target "$broken" "flash-attn==2.8.3"
fi
export TEST_BROKEN_FLASH_ATTN_DIR="$broken"

# diffusers: what pip would add for it, resolved together with this environment's torch and
# transformers, goes into its directory; made again when it no longer completes the environment or
# would shadow what this transformers needs (the CI smoke lanes change transformers in one venv).
diffusers="$deps/diffusers-0.42.1-$py"
unset TEST_DIFFUSERS_ABSENT TEST_DIFFUSERS_EXPECTED
tf=$("$PY" -c 'import importlib.metadata as m; print(m.version("transformers"))')
if ! PYTHONPATH="$diffusers" "$PY" scripts/requirements_met.py "diffusers==0.42.1" >/dev/null ||
  ! PYTHONPATH="$diffusers" "$PY" scripts/requirements_met.py "transformers==$tf" >/dev/null; then
  rm -rf "$diffusers"
  mkdir -p "$deps"
  plan="$deps/diffusers-plan.json"
  if "$PY" -m pip install --dry-run --report "$plan" "$tv_pin" "transformers==$tf" \
    "diffusers==0.42.1" >"$deps/diffusers-plan.log" 2>&1; then
    missing=$("$PY" -c 'import json, sys
print(" ".join(p["metadata"]["name"] + "==" + p["metadata"]["version"]
               for p in json.load(open(sys.argv[1]))["install"]))' "$plan")
    # shellcheck disable=SC2086 # one word per requirement
    [ -n "$missing" ] && "$PY" -m pip install -q --no-deps --target "$diffusers" $missing
  elif grep -q ResolutionImpossible "$deps/diffusers-plan.log"; then
    why=$(grep -E "^ +[^ ]+ [^ ]+ depends on " "$deps/diffusers-plan.log" | sed 's/^ *//' |
      paste -sd ';' -)
    TEST_DIFFUSERS_ABSENT="pip cannot install diffusers 0.42.1 beside transformers $tf"
    export TEST_DIFFUSERS_ABSENT="$TEST_DIFFUSERS_ABSENT (${why:-conflicting requirements})"
    echo "$TEST_DIFFUSERS_ABSENT: the diffusers tests skip" >&2
  else
    cat "$deps/diffusers-plan.log" >&2
    exit 1
  fi
  rm -f "$plan" "$deps/diffusers-plan.log"
fi
if [ -d "$diffusers/diffusers" ]; then
  # diffusers 0.42 does not import with torch below 2.6: checked once per torch release
  seen="$diffusers/.imports-with-torch-${tv%%+*}"
  [ -f "$seen" ] || imports "$diffusers" diffusers.models.attention_dispatch >"$seen"
  if [ -s "$seen" ]; then
    export TEST_DIFFUSERS_ABSENT="diffusers 0.42.1 does not import with torch $tv ($(cat "$seen"))"
    echo "$TEST_DIFFUSERS_ABSENT: the diffusers tests skip" >&2
  else
    PYTHONPATH="$diffusers${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
# the tests fail (not skip) where diffusers does not import after this
[ -z "${TEST_DIFFUSERS_ABSENT:-}" ] && export TEST_DIFFUSERS_EXPECTED=1

# kernels (the Hugging Face kernel hub's loader): the newest release this transformers accepts
# (its own bounds, scripts/kernels_requirement.py); where no release lies in that window, the
# newest there is (the version skew a user of that transformers meets). What pip would add for it
# beside this environment goes into its directory, on the path of the hub-kernel tests' programs
# only ($TEST_KERNELS_DIR). Where pip cannot install it beside this environment (kernels needs
# huggingface-hub >= 1.10, transformers 4.x requires it below 1.0) TEST_KERNELS_ABSENT says why.
unset TEST_KERNELS_DIR TEST_KERNELS_ABSENT
kver=""
hubver=$("$PY" -c 'import importlib.metadata as m; print(m.version("huggingface-hub"))')
if want=$("$PY" scripts/kernels_requirement.py 2>"$deps/kernels-why"); then
  plan="$deps/kernels-plan.json"
  mkdir -p "$deps"
  # pip's answer is remembered for the day (CI's smoke lanes ask the same question many times)
  memo="$deps/kernels-for-$(echo "$want $hubver" | tr -c 'A-Za-z0-9.\n' '_')-$py-$(date +%F)"
  resolved=$(cat "$memo" 2>/dev/null || true)
  for req in "$want" kernels; do # in the window, else the newest (the skew case)
    [ -s "$memo" ] && break
    if "$PY" -m pip install --dry-run -q --report "$plan" "$req" "huggingface-hub==$hubver" \
      >"$deps/kernels-plan.log" 2>&1; then
      resolved=$("$PY" -c 'import json, sys
print(" ".join(p["metadata"]["name"] + "==" + p["metadata"]["version"]
               for p in json.load(open(sys.argv[1]))["install"]))' "$plan")
      echo "$resolved" >"$memo"
      break
    fi
  done
  kver=$(printf '%s\n' $resolved | sed -n 's/^kernels==//p')
  if [ -n "$kver" ]; then
    kernels="$deps/kernels-$kver-$py"
    if ! PYTHONPATH="$kernels" "$PY" scripts/requirements_met.py "kernels==$kver" >/dev/null; then
      rm -rf "$kernels"
      # shellcheck disable=SC2086 # one word per requirement
      "$PY" -m pip install -q --no-deps --target "$kernels" $resolved
    fi
    export TEST_KERNELS_DIR="$kernels"
    # a release may break the import of a transformers that names no upper bound (kernels 0.17
    # raises inside transformers 5.3's import of its hub layers): a user of that pair cannot
    # import transformers at all, so no hub test runs there, and the skips say why
    err=""
    case "$want" in *"<"*) ;; *) err=$(imports "$kernels" transformers.modeling_utils) ;; esac
    if [ -n "$err" ]; then
      unset TEST_KERNELS_DIR
      export TEST_KERNELS_ABSENT="kernels $kver breaks the import of transformers $tf ($err)"
      echo "$TEST_KERNELS_ABSENT: the hub-kernel tests skip" >&2
    fi
  else
    export TEST_KERNELS_ABSENT="pip cannot install kernels beside huggingface-hub $hubver"
  fi
  rm -f "$plan" "$deps/kernels-plan.log"
else
  export TEST_KERNELS_ABSENT="$(tail -n 1 "$deps/kernels-why")"
fi
rm -f "$deps/kernels-why"
# A `kernels` release diffusers refuses (its *_hub backends check a floor: 0.12 in diffusers 0.42;
# tests/test_diffusers_hub.py asserts diffusers still refuses it): metadata is all diffusers reads
# before refusing, so no dependencies; on the path of those tests' programs only
# ($TEST_KERNELS_REFUSED_DIR)
unset TEST_KERNELS_REFUSED_DIR
if [ -z "${TEST_DIFFUSERS_ABSENT:-}" ]; then
  refused="$deps/kernels-0.11.7-nodeps"
  if [ ! -d "$refused/kernels" ]; then
    "$PY" -m pip install -q --no-deps --target "$refused" "kernels==0.11.7" || rm -rf "$refused"
  fi
  [ -d "$refused/kernels" ] && export TEST_KERNELS_REFUSED_DIR="$refused"
fi
# README's two commands (the full suite, `-m smoke`) record their counts and minutes
# (tests/conftest.py); README's ranges are checked against that record after the run
kind=""
[ "$#" -eq 0 ] && kind=full
[ "$*" = "-m smoke" ] && kind=smoke
[ "${TEST_ZOO:-}" = all ] && kind=""
record="${TEST_RUNS_DIR:-$PWD/.test-runs}/$kind.json"
[ -n "$kind" ] && rm -f "$record"

tested="torch $tv ($torch_from), transformers $tf, xformers ${xformers_version}"
tested+=", diffusers $([ -n "${TEST_DIFFUSERS_ABSENT:-}" ] && echo "none" || echo 0.42.1)"
if [ -n "${TEST_KERNELS_DIR:-}" ]; then
  tested+=", kernels $kver (hub-kernel tests' programs only)"
else
  tested+=", kernels none (${TEST_KERNELS_ABSENT:-})"
fi
echo "scripts/test.sh: testing with $tested"
[ -n "$xformers" ] && PYTHONPATH="$xformers${PYTHONPATH:+:$PYTHONPATH}"
set +e
PYTHONPATH="${PYTHONPATH:-}" "$PY" -m pytest "$@"
rc=$?
set -e
echo "scripts/test.sh: tested with $tested"
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: treating as a failure" >&2
  exit 1
fi
if [ -n "$kind" ] && [ -f "$record" ] && ! "$PY" tests/run_record.py "$kind"; then
  [ "$rc" -eq 0 ] && rc=1
fi
exit "$rc"
