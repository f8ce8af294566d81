#!/usr/bin/env bash
# The wheels tests/gpu/test_hub_gpu.py needs on the GPU machine, which has no internet: the
# `kernels` package at the newest release the image's transformers (5.17) accepts (its own bounds:
# kernels >=0.16.0,<0.17.0) and what it needs that the image (Python 3.12, huggingface_hub 1.33,
# requests, pyyaml) lacks. scripts/gpu_suite.sh installs them to /tmp/kernels-site.
#
#   bash scripts/fetch_kernels_wheels.sh    # here, once: writes .whl-kernels/ (about 13 MB)
#   device run: carry [".whl-kernels", ...]
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl-kernels
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work" "kernels==0.16.2"
# what the image already has stays out (its huggingface_hub, the requests stack, rich, ...)
keep=(kernels- kernels_data sigstore- sigstore_models sigstore_rekor tuf- securesystemslib rfc8785
  rfc3161 id- pyjwt cryptography cffi pycparser email_validator dnspython pydantic- pydantic_core
  annotated_types typing_inspection platformdirs tomlkit)
rm -rf "$out" && mkdir -p "$out"
for prefix in "${keep[@]}"; do cp "$work/$prefix"*.whl "$out/"; done
ls "$out"
