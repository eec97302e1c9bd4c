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
# ranges; tests/gpu_check/test_gpu_report.py checks that). About 4.5 MB in all.
#
# Then the [gpu] extra (tokamax: attention=tokamax, a candidate of autoselected) with what it needs beyond the
# image, as installed beside jax 0.12.0.1 on Python 3.12 here: qwix and flax (qwix imports flax), flax's
# treescope, rich and its markdown-it-py, mdurl and pygments (the image's orbax may have them: carried anyway),
# jaxtyping and wadler-lindig, pydantic with pydantic-core, annotated-types and typing-inspection, einshape,
# immutabledict, typeguard 2.13.3 (tokamax pins it), tqdm. About 10 MB more.
set -euo pipefail

WHEELS=(grain==0.2.18 array-record==0.8.6 tensorboardX==2.6.5 portpicker==1.6.0)
GPU_WHEELS=(tokamax==0.0.12 qwix==0.1.8 flax==0.12.12 treescope==0.1.10 rich==15.0.0 markdown-it-py==4.3.0
            mdurl==0.1.2 pygments==2.21.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 pydantic==2.14.4
            pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 einshape==1.0
            immutabledict==4.3.1 typeguard==2.13.3 tqdm==4.70.1)
WHEELS+=("${GPU_WHEELS[@]}")

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
