#!/usr/bin/env bash
# Downloads, as wheels, the Python packages maxtrain needs that a lent GPU machine lacks, into .whl/ (git
# ignores it), for the `device` tool's `carry` (docs/gpu.md):
#
#     scripts/gpu_wheels.sh [DIR]        # default: .whl in the repository root; then DIR holds only these
#     scripts/gpu_wheels.sh --list       # print the pinned names, one a line
#
# The machine's image (the device tool's KINDS.md: Python 3.12, jax 0.11.2 with its CUDA 13 plugin, optax,
# orbax-checkpoint, sentencepiece, tokenizers, tensorstore, numpy, protobuf, pyyaml, jinja2, xxhash, ...) has
# the rest, and nothing can be downloaded there. So these are fetched here for it (CPython 3.12, manylinux
# x86-64) without their dependencies, which the image has: grain needs absl-py, cloudpickle, etils, numpy,
# protobuf, array-record and portpicker; array-record absl-py and etils; tensorboardX numpy, packaging and
# protobuf; portpicker psutil. The versions are the ones maxtrain is tested with (inside pyproject.toml's
# ranges; tests/test_gpu_report.py checks that). About 4.5 MB in all.
set -euo pipefail

WHEELS=(grain==0.2.18 array-record==0.8.6 tensorboardX==2.6.5 portpicker==1.6.0)

if [[ "${1:-}" == "--list" ]]; then
  printf '%s\n' "${WHEELS[@]}"
  exit 0
fi
if [[ "${1:-}" == -* ]]; then
  sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
  exit 0
fi
repo="$(cd "$(dirname "$0")/.." && pwd)"
dir="${1:-$repo/.whl}"
mkdir -p "$dir"
rm -f "$dir"/*.whl  # one version of each: two would stop the whole install on the machine
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d "$dir" "${WHEELS[@]}"
ls -l "$dir"
echo "$(du -sh "$dir" | cut -f1) in $dir: carry it with the device call (python scripts/gpu_report.py --print-device-call)"
