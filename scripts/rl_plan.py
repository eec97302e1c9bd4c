"""A disaggregated RL run planned from a laptop: the GRPO update and the rollout's generation compiled ahead of time for
the two halves of a cluster (trainer | sampler), with memory per chip and the predicted seconds per phase:

    python scripts/rl_plan.py configs/base.yml model_name=qwen3-30b-a3b compile_topology=h100-16 grpo_beta=0 \\
        --prompts 64 --generations 16 --prompt-tokens 1024 --completion-tokens 4096 --sampler-rows 256
    python scripts/rl_plan.py configs/base.yml model_name=qwen3-30b-a3b compile_topology=v5p-128 grpo_beta=0

compile_topology names the whole cluster; each half is a slice of half its chips (h100-16: 8 + 8 GPUs; v5p-128, 64
chips: two v5p-64 of 32). It compiles the update (objective=grpo's train step over prompts x generations rows) on the
trainer's half and on all chips, and one wave of the sampler (prefill and KV-cache decode of --sampler-rows rows) on
the sampler's half, and prints the weight sync's bytes and seconds and one step off policy against colocated, with
the formulas in maxtrain/training/rl_plan.py. --trainer and --sampler add settings to one side only (e.g. --sampler
'ici_expert_parallelism=8'). Figures and how far to trust them: docs/scale.md, "RL: trainer and sampler apart".
"""

from maxtrain.errors import run_cli
from maxtrain.training import rl_plan

if __name__ == "__main__":
    run_cli("rl_plan", rl_plan.main)
