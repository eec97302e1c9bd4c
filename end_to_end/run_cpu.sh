#!/usr/bin/env bash
# The CPU end-to-end regression suite: every script in end_to_end/cpu/, each printing one
# PASS/FAIL line with the figure it checked, then a summary. Exit status 1 if any failed.
#
#   end_to_end/run_cpu.sh                 # all of them
#   end_to_end/run_cpu.sh --quick         # default_loss.py with its 100-step threshold instead of 300 steps
#
# Runs are written to $E2E_OUT (default outputs/end_to_end/). Use the Python that has maxtrain
# installed: PYTHON=.venv/bin/python end_to_end/run_cpu.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PYTHON="${PYTHON:-python3}"
export E2E_OUT="${E2E_OUT:-outputs/end_to_end}"
steps=300
if [ "${1:-}" = "--quick" ]; then steps=100; fi

results=()
failed=0
run() {  # run NAME COMMAND...: runs it, keeps its verdict line
  local name=$1; shift
  echo "=== $name: $*"
  local started=$SECONDS
  "$@" 2>&1 | tee "/tmp/maxtrain-e2e-$name.log"
  local status=${PIPESTATUS[0]}
  local line
  line=$(grep -E '^(PASS|FAIL|SKIP)[: ]' "/tmp/maxtrain-e2e-$name.log" | tail -1)
  if [ "$status" -ne 0 ] || [ -z "$line" ] || [[ $line == FAIL* ]]; then
    failed=1
    line="${line:-FAIL: exited with status $status and no verdict}"
  fi
  results+=("$name: $line ($((SECONDS - started))s)")
}

run default_loss "$PYTHON" end_to_end/cpu/default_loss.py --steps "$steps"
run save_restore "$PYTHON" end_to_end/cpu/save_restore.py
run determinism "$PYTHON" end_to_end/cpu/determinism.py
run multiprocess "$PYTHON" end_to_end/cpu/multiprocess.py
# Decode from the checkpoint default_loss.py trained (its last step).
run decode "$PYTHON" end_to_end/cpu/decode.py --checkpoint "$E2E_OUT/default_loss/default/checkpoints/$steps"
# Faults (from the checkpoints work): kills at random moments, a SIGTERM to one of two processes,
# a full disk (needs root for its tmpfs; prints SKIP otherwise).
run kill_resume "$PYTHON" end_to_end/cpu/kill_resume.py
run preempt_multiprocess "$PYTHON" end_to_end/cpu/preempt_multiprocess.py
run disk_full "$PYTHON" end_to_end/cpu/disk_full.py
# gpt-oss's layers (sinks, biases, clamped experts) train on the default corpus.
run gpt_oss "$PYTHON" end_to_end/cpu/gpt_oss.py
# OLMo 3's layers (post-norms, qk-norm over all heads, windows in 3 of 4 layers) train on the default corpus.
run olmo3 "$PYTHON" end_to_end/cpu/olmo3.py
# Llama 4's layers (chunked attention, NoPE layers with temperature, L2 qk-norm, input-weighted experts) train.
run llama4 "$PYTHON" end_to_end/cpu/llama4.py
# GLM-4.5's layers (partial RoPE, qk-norm, biases, dense-first, sigmoid-routed and shared experts, MTP) train.
run glm4_moe "$PYTHON" end_to_end/cpu/glm4_moe.py
# Qwen3.5's hybrid (gated delta-net layers, gated full attention, routed and gated shared experts) trains.
run qwen3_5 "$PYTHON" end_to_end/cpu/qwen3_5.py
# A tiny Qwen3.5 with an image tower learns the colour of a generated shape (chance 0.25), and with the tower frozen.
run vlm_shapes "$PYTHON" end_to_end/cpu/vlm_shapes.py
# Post-training: SFT, LoRA and DPO on generated instructions, export checked against transformers.
run post_training "$PYTHON" end_to_end/cpu/post_training.py

echo
echo "=== summary"
printf '%s\n' "${results[@]}"
exit "$failed"
