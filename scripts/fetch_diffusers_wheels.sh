#!/usr/bin/env bash
# The wheels tests/gpu/test_diffusers_gpu.py needs on the GPU machine, which has no internet and no
# diffusers: diffusers 0.42.1 and what it needs beyond the GPU image (Python 3.12, transformers
# 5.17): huggingface_hub 1.33.0 (diffusers needs >=1.32, transformers 5.17 <2) with the click and
# hf-xet it requires, importlib_metadata with zipp and lazy-importer, the requests stack, Pillow.
#
#   bash scripts/fetch_diffusers_wheels.sh   # here, once: writes .whl-diffusers/ (about 19 MB)
#   device run: carry [".gpu-deps", ".whl", ".whl-diffusers"]; scripts/gpu_suite.sh installs them
#   into /tmp/diffusers-site and exports TEST_DIFFUSERS_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  diffusers==0.42.1 huggingface_hub==1.33.0 click==8.5.1 hf-xet==1.8.0
  importlib_metadata==10.2.0 zipp==4.1.2 lazy-importer==0.1.0
  requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3 idna==3.20 certifi==2026.10.19.post1
  pillow==13.0.0
)
mkdir -p .whl-diffusers
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl-diffusers "${WHEELS[@]}"
ls -1 .whl-diffusers
