"""Train a decoder LLM:  python -m maxtrain.train configs/base.yml [key=value ...]

Reads top to bottom like a run: config -> processes -> mesh, model and compiled step -> where it
starts (fresh or resumed) -> data -> the loop (dispatch step n+1 before reading step n's metrics;
checkpoints, evaluations and heatmaps as hooks) -> a greedy sample.

The settings are configs/base.yml's keys (every one declared there with its allowed values), a model
preset (`model_name=`) and key=value overrides; docs/ describes them by topic.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: a CPU step's buffers on huge pages (training/host_memory.py)
    from maxtrain.training import host_memory

    host_memory.reexec_with_hugepages()
# pylint: disable=wrong-import-position

import sys
import time

import jax
import jax.numpy as jnp
import yaml

from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain import evals
from maxtrain.checkpointing import manager as checkpoint_manager
from maxtrain.checkpointing.files import CheckpointError
from maxtrain.compile import executable, fit
from maxtrain.data import pipeline
from maxtrain.errors import run_cli
from maxtrain.observability import metrics
from maxtrain.parallel import distributed, sharding
from maxtrain.training import builder, end_sample, grpo, host_memory, layer_choice, loop, on_policy, rewards
from maxtrain.training.loop import RunResult, TrainingError  # noqa: F401 (TrainingError: the run's own errors)
from maxtrain.training.preemption import Preemption

KEYS = ("model_name", "steps", "per_device_batch_size", "max_target_length", "learning_rate", "dataset_type",
        "grain_train_files", "tokenizer_path", "run_name", "base_output_directory", "ici_fsdp_parallelism",
        "attention", "remat_policy", "load_parameters_path")


def log(*args):
    if jax.process_index() == 0:
        print(*args, flush=True)


def main(argv: list[str]) -> RunResult:
    started = time.time()
    config = builder.load_config(argv, log=log, command="maxtrain.train")
    host_memory.keep_step_buffers(config)  # a small CPU step's buffers kept between steps; before JAX starts
    metrics.check_outputs(config)  # a metrics_file or run directory that cannot be written: refused now
    # GRPO's reward functions: imported and their signatures checked now (called on made-up completions below)
    sampled = config_lib.objectives.of(config).samples  # GRPO, distill_on_policy: completions sampled as it trains
    rewarded = config_lib.objectives.rewarded(config)  # GRPO: and scored by reward functions
    reward_functions = rewards.load(config.grpo_reward_functions) if rewarded else None
    joining = distributed.settings(config)  # the processes the config or the environment names: None for one
    config_lib.objectives.one_process_only(config, 1 if joining is None else joining.get("num_processes", 2),
                                           "" if joining is None or joining else "the environment names a cluster")
    distributed.initialize(config)
    distributed.agree_on_config(config)  # one agreed view: the same settings and code on every process
    run = builder.build(config)  # mesh, model, optimizer, state shardings and the jitted steps
    config, mesh, rules = run.config, run.mesh, run.config.logical_axis_rules
    compiled_step = None
    if config.compiled_trainstep_file:  # compiled ahead of time by maxtrain.train_compile; checked before any work
        compiled_step = executable.load(config.compiled_trainstep_file, run)
        log(f"loaded the compiled step from {config.compiled_trainstep_file}")

    checkpointer = checkpoint_manager.Checkpointer(config, log=log) if config.enable_checkpointing else None
    start = checkpoint_manager.plan_start(config, checkpointer, run.abstract_state, log=log)  # fails here if it does not fit
    distributed.agree_on_checkpoint_step(start.step, config.checkpoint_dir)  # every process resumes the same step
    if start.kind == "resume" and start.step >= config.steps and checkpointer.intact(start.step):
        log(f"checkpoint {start.step_dir} is at step {start.step}, steps={config.steps}: nothing to train; raise steps "
            f"(e.g. steps={start.step + config.steps}) to train on")
        checkpointer.close()
        return RunResult(config, nothing_to_train=True)
    inputs = data_lib.make_inputs(config, log=log, vision=run.model.family.vision)  # checked before compiling
    if rewarded:  # GRPO's reward functions called on made-up completions of its first prompts (training/grpo.py)
        inputs = grpo.with_rewards(config, inputs, reward_functions, log=log)
    task_evals = evals.from_config(config, inputs.tokenizer, mesh, run.rt, log=log)  # data checked, requests packed
    sample_prompt = end_sample.prompt_ids(config, inputs.tokenizer)  # the end-of-run sample's prompt, checked now
    compile_started = time.time()
    if compiled_step is None and layer_choice.applies(config, run.rt.backend):  # remat by compiled memory (GPU, TPU)
        choice = layer_choice.choose_on_devices(run, lambda plan: builder.build(config, layer_plan=plan))
        run, compiled_step = choice.run, choice.compiled
    step_fn = run.compile() if compiled_step is None else compiled_step  # from the state's shapes and shardings
    log(builder.summarize(run, step_fn, time.time() - compile_started, start))
    fit.check_fits(run, step_fn)  # a step the devices cannot hold is refused before the state takes memory
    host_memory.release_unused()  # what compiling left in malloc goes back before the state and the steps take theirs
    metadata = checkpoint_manager.run_metadata(config, run.rt, start, inputs.tokenizer)
    writer = metrics.MetricWriter(config, active=jax.process_index() == 0)
    writer.write_text("config", "```\n" + yaml.safe_dump(config.to_dict(), sort_keys=False) + "\n```")

    with sharding.activation_sharding(mesh, rules):
        state = checkpoint_manager.initial_state(start, checkpointer, run.abstract_state, run.init,
                                             jax.random.key(config.seed), inputs.train_iterator, log=log)
        if sampled:  # each step samples completions of a prompt batch, then updates on them
            rollouts = grpo if rewarded else on_policy  # on_policy: the teacher scores them (distill_on_policy)
            step_fn = rollouts.Step(run, step_fn, inputs)
            # GRPO: a prompt batch at each rollout batch's first step (grpo_steps_per_generation, grpo_num_iterations)
            batches = step_fn.batches() if rewarded else iter(inputs.train_iterator)
            evaluation = rollouts.HeldOut(run, inputs, writer, log)
        else:
            batches = (pipeline.to_global(batch, mesh, rules) for batch in inputs.train_iterator)
            evaluation = loop.EvalLoss(config, run.eval_step, lambda: eval_batches(run, inputs), writer, log)
        hooks = [loop.Profile(config, log)]
        hooks += [loop.Checkpoint(config, checkpointer, inputs.train_iterator, metadata)] if checkpointer else []
        hooks += [evaluation] if len(inputs.eval_batches) > 0 else []
        hooks += [loop.TaskEval(task_evals, run.model_params, writer)] if task_evals else []
        if len(inputs.eval_batches) > 0 and inputs.tokenizer is not None and config.viz_period > 0 and not sampled:
            viz_batch = pipeline.to_global(inputs.eval_batches[0], mesh, rules, pipeline.EVAL_BATCH_AXES)
            hooks.append(loop.Heatmap(config, run.model, run.rt, viz_batch, inputs.tokenizer, run.model_params, writer,
                                      log))
        reporter = loop.Reporter(config, writer, run.flops_per_token(), peak_tflops(config),
                                 loss_scaled=run.rt.dtype == jnp.float16)
        preemption = Preemption()
        if rewarded:  # a SIGTERM stops the run at the end of the GRPO rollout batch under way
            preemption = grpo.AtRolloutEnds(preemption, grpo.steps_per_rollout(config))
        state, preempted = loop.train(step_fn, state, batches, int(jax.device_get(state["step"])), config.steps,
                                      hooks, reporter, preemption, log)
        writer.close()
        inputs.close()  # stops background cache building; finished shards stay
        sample = None if preempted else end_sample.greedy(run, state, inputs.tokenizer, sample_prompt, log)
    log(f"done in {time.time() - started:.1f}s")
    return RunResult(config, state, evaluation.losses, evaluation.metrics, sample, preempted)


def eval_batches(run, inputs):
    """The eval batches as global arrays, read afresh each evaluation (one eval epoch need not fit in memory)."""
    rules = run.config.logical_axis_rules
    return (pipeline.to_global(b, run.mesh, rules, pipeline.EVAL_BATCH_AXES) for b in inputs.eval_batches)


def peak_tflops(config) -> float | None:
    """The device's peak for MFU (metrics.peak_tflops), saying so when it is unknown."""
    peak = metrics.peak_tflops(config, log=log)
    if peak is None:
        log("MFU: unknown peak for this device; set peak_tflops_per_device=<dense TFLOP/s per device> to report it")
    return peak


if __name__ == "__main__":
    # A failed save's background writers would only add tracebacks on the way out: CheckpointError ends at once.
    result = run_cli("maxtrain", main, hard_exit=(CheckpointError,), usage=lambda: config_lib.command_help(__doc__, KEYS))
    if result.preempted:
        sys.exit(143)  # 128 + SIGTERM, as if killed by it: the run is saved but not finished
