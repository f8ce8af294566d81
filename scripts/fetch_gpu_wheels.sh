#!/usr/bin/env bash
# The wheels tests/gpu/test_broken_flash_gpu.py installs on the GPU machine, which has no internet:
# transformers 4.49.0, 4.53.3 and 4.54.1, what they need that the GPU image (Python 3.12,
# transformers 5.17, tokenizers 0.23, huggingface_hub 1.33) lacks or has too new for them
# (tokenizers <0.22, huggingface_hub <1.0 and the requests stack it imports), and structlog
# (attnguard's own dependency, absent from the image).
#
#   bash scripts/fetch_gpu_wheels.sh        # here, once: writes .whl-tf/gpu-wheels.tar.xz
#   device run: carry [".gpu-deps", ".whl-tf"]; tests/gpu/test_broken_flash_gpu.py unpacks it
#
# One solid xz archive of the wheels stored uncompressed: the three transformers releases share
# most of their files, so it is about 8 MB where the wheels themselves take about 37 MB (the device
# tool carries at most 64 MiB, and the real flash-attn archive already takes 15.5 MB). pip
# installs the stored wheels as it would the originals (same files, same RECORD).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
  transformers==4.49.0 transformers==4.53.3 transformers==4.54.1
  tokenizers==0.21.4 huggingface_hub==0.36.2
  requests==2.34.2 urllib3==2.8.0 charset_normalizer==3.5.2 idna==3.20 certifi==2026.10.18
  structlog==26.1.0
)
out=.whl-tf
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/dl" "$work/stored" "$out"
for wheel in "${WHEELS[@]}"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$work/dl" "$wheel"
done
# the same wheels with their members stored, not deflated, so that xz sees the files themselves
python3 - "$work/dl" "$work/stored" <<'PY'
import sys, zipfile
from pathlib import Path

src, dst = Path(sys.argv[1]), Path(sys.argv[2])
for wheel in sorted(src.glob("*.whl")):
    with zipfile.ZipFile(wheel) as zin, zipfile.ZipFile(dst / wheel.name, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info, zin.read(info), compress_type=zipfile.ZIP_STORED)
PY
tar -C "$work/stored" -cf - . | xz -9 -T1 >"$out/gpu-wheels.tar.xz"
(cd "$work/dl" && ls -1 ./*.whl | sed 's|^\./||') >"$out/MANIFEST"
ls -l "$out/gpu-wheels.tar.xz"
du -cb "$work"/dl/*.whl | tail -n 1 | sed 's/total/bytes of wheels as downloaded/'
