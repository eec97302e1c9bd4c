"""The fastest layout for a target: compile a small grid ahead of time and sort what fits by predicted tokens/s.

    python scripts/plan.py configs/base.yml compile_topology=v5p-128 model_name=llama3-8b max_target_length=8192
    python scripts/plan.py configs/base.yml compile_topology=h100-64 model_name=llama3-8b --batch 1,2 --tensor 1,8
    python scripts/plan.py configs/base.yml compile_topology=v5p-512 model_name=deepseek3-671b --expert 8,64 \
        --json plan.json

Every cell is `python -m maxtrain.train_compile` of the config with one choice of each axis of the grid: the
tensor (--tensor) and expert (--expert, MoE models only) splits that divide the target's devices, FSDP taking the
rest; the per-device batch (--batch); the remat policy (--remat); the attention implementation (--attention). It
prints the cells that fit the chip's memory, fastest first by the predicted tokens/s (compile/predict.py; how far
to trust it: docs/scale.md), with the command to train the best, and the cells that did not fit or compile. The
grid is small by default (compiles for a pod take 15-110 s each on a CPU): widen it with the flags. `--cache DIR`
keeps each cell's compiled program (its HLO text and memory), so a second run with the same cells, after a change to
the prediction or its calibration (PREDICTION_FILES), re-predicts them without compiling; any other change to
maxtrain's code, or another jax or libtpu, compiles them again.
"""

from maxtrain.errors import run_cli
from maxtrain.training import layout_plan

if __name__ == "__main__":
    run_cli("plan", layout_plan.main)
