"""The train step built and compiled for a compile target (compile/targets.py) on this machine: exactly the step
train.py runs there (builder.build with the target's devices and platform), with remat_policy=autoselected's
choice made against the target chip's memory. train_compile, scripts/plan.py, scripts/scale_table.py and
scripts/predict_check.py compile through it; compile/report.py reads what it returns."""

from __future__ import annotations

import time

from maxtrain.compile import targets
from maxtrain.training import builder, layer_choice


def compile_for_target(config, target: targets.Target):
    """(run, lowered, compiled, seconds): the train step of `config` compiled for `target`'s devices; with
    remat_policy=autoselected the least recomputation that fits the target chip (`choose_layers`)."""
    devices = target.devices()
    t0 = time.time()
    choice = choose_layers(config, target, devices)
    if choice is not None:
        return choice.run, choice.lowered, choice.compiled, time.time() - t0
    run = builder.build(config, devices=devices, platform=target.platform, num_processes=1)
    t0 = time.time()
    lowered = run.lower()
    compiled = lowered.compile()
    return run, lowered, compiled, time.time() - t0


def choose_layers(config, target: targets.Target, devices):
    """remat_policy=autoselected on a GPU or TPU target: training/layer_choice.py's choice (the least
    recomputation whose step fits the target chip's memory), the one train.py makes on the chips themselves, so
    that a user sees it before renting them; None where it does not apply."""
    if not layer_choice.applies(config, target.platform) or not target.memory_bytes:
        return None
    return layer_choice.choose(
        config, lambda plan: builder.build(config, devices=devices, platform=target.platform, num_processes=1,
                                           layer_plan=plan),
        target.memory_bytes, f"one {target.chip}'s memory")


def choice_report(run) -> dict:
    """The choices made for the target beside compile/report.py's figures: the experts' line (an MoE model: which
    form dropless dispatch runs) and the remat candidates tried (training/layer_choice.py)."""
    return {"experts": builder.moe_line(run) if run.model.is_moe else None,
            "remat_choice": run.remat_choice or None}
