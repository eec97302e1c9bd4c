"""Train a decoder LLM:  python -m maxtrain.train configs/base.yml [key=value ...]

Reads top to bottom like a run: config -> processes -> mesh -> data -> state (fresh or resumed)
-> compiled step -> loop (dispatch step n+1 before reading step n's metrics) -> final save,
eval and a greedy sample.
"""

from __future__ import annotations

if __name__ == "__main__":  # before JAX starts: a CPU step's buffers on huge pages (maxtrain/host_memory.py)
    from maxtrain import host_memory

    host_memory.reexec_with_hugepages()
# pylint: disable=wrong-import-position

import json
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import yaml

from maxtrain import builder, checkpoint_files, decode, distributed, evals, executable, host_memory, memory, metrics
from maxtrain import sharding, viz
from maxtrain import checkpoint as checkpoint_lib
from maxtrain import config as config_lib
from maxtrain import data as data_lib
from maxtrain import preemption as preemption_lib
from maxtrain import profiler as profiler_lib
from maxtrain import storage
from maxtrain.data import pipeline
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.errors import UserError, run_cli


class TrainingError(UserError, RuntimeError):
    """The run cannot continue; the message says why and what to try."""


def log(*args):
    if jax.process_index() == 0:
        print(*args, flush=True)


def evaluate(eval_step, state, eval_batches) -> tuple[float, dict]:
    """(weighted mean loss, weighted mean of each metric) of the objective over the eval batches
    (padding has weight 0)."""
    total, weight, sums = 0.0, 0.0, {}
    for batch in eval_batches:
        loss_sum, weight_sum, metrics = eval_step(state, batch)
        total, weight = total + loss_sum, weight + weight_sum
        sums = {k: sums.get(k, 0.0) + v * weight_sum for k, v in metrics.items()}
    denom = jnp.maximum(weight, 1.0)
    return float(total / denom), {k: float(v / denom) for k, v in sums.items()}


def log_eval(step: int, loss: float, metrics: dict, writer) -> None:
    extra = "".join(f"  {k} {v:.4f}" for k, v in metrics.items())
    log(f"eval at step {step}: loss {loss:.4f}{extra}")
    writer.write(step, {"eval/avg_loss": loss, **{f"eval/{k}": v for k, v in metrics.items()}}, print_line=False)


def check_finite(step: int, m: dict, loss_scaled: bool, loss_scale_min: float = 1.0) -> None:
    """Stops a diverged run. With float16 loss scaling a non-finite step was skipped (nothing was
    updated) and the scale halved; the run stops only once the scale is at its floor."""
    loss = m["learning/loss"]
    if math.isfinite(loss) or (loss_scaled and m["learning/loss_scale"] > loss_scale_min):
        return
    raise TrainingError(
        f"the loss became {loss} at step {step} (grad norm {m['learning/grad_norm']}). Nothing after the last "
        "checkpoint was saved. Try a lower learning_rate, a longer warmup (warmup_steps_fraction), "
        "gradient_clipping_threshold=1.0, or dtype=float32 / bfloat16 instead of float16.")


def write_metadata(config, rt, start) -> dict:
    """Run metadata, saved in every checkpoint and written as readable files to <run>/metadata."""
    source = checkpoint_files.source_of(start.step_dir) if start.step_dir else None
    meta = {"config": config.to_dict(), "runtime": {"dtype": rt.dtype.name, "attention": rt.attention,
                                                    "remat_policy": rt.remat_policy,
                                                    "scan_layers": rt.scan_layers(config)},
            **({"source": source} if source else {}),  # a model imported from Hugging Face: kept for export
            "jax_version": jax.__version__, "num_processes": jax.process_count(), "num_devices": jax.device_count(),
            "device_kind": jax.devices()[0].device_kind, "git": checkpoint_lib.git_state(),
            "command": sys.argv, "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "packages": checkpoint_lib.installed_packages()}
    if jax.process_index() == 0:
        directory = config.metadata_dir  # local or gs://
        storage.write_text(os.path.join(directory, "config.yml"), yaml.safe_dump(config.to_dict(), sort_keys=False))
        storage.write_text(os.path.join(directory, "run.json"),
                           json.dumps({k: v for k, v in meta.items() if k not in ("config", "packages")}, indent=2))
        storage.write_text(os.path.join(directory, "requirements.txt"), "\n".join(meta["packages"]) + "\n")
    return meta


def main(argv: list[str]) -> dict:
    start_time = time.time()
    config = builder.load_config(argv, log=log)
    host_memory.keep_step_buffers(config)  # a small CPU step's buffers kept between steps; before JAX starts
    metrics.check_outputs(config)  # a metrics_file or run directory that cannot be written: refused now
    distributed.initialize(config)
    distributed.agree_on_config(config)  # one agreed view: the same settings and code on every process
    run = builder.build(config)  # mesh, model, optimizer, state shardings and the jitted steps
    config, rt, mesh, rules = run.config, run.rt, run.mesh, run.config.logical_axis_rules
    compiled_step = None
    if config.compiled_trainstep_file:  # compiled ahead of time by maxtrain.train_compile; checked before any work
        compiled_step = executable.load(config.compiled_trainstep_file, run)
        log(f"loaded the compiled step from {config.compiled_trainstep_file}")

    checkpointer = checkpoint_lib.Checkpointer(config, log=log) if config.enable_checkpointing else None
    start = checkpoint_lib.plan_start(config, checkpointer, run.abstract_state, log=log)  # fails here if it does not fit
    distributed.agree_on_checkpoint_step(start.step, config.checkpoint_dir)  # every process resumes the same step
    if start.kind == "resume" and start.step >= config.steps and checkpointer.intact(start.step):
        log(f"checkpoint {start.step_dir} is at step {start.step}, steps={config.steps}: nothing to train; raise steps "
            f"(e.g. steps={start.step + config.steps}) to train on")
        checkpointer.close()
        return {"eval_losses": {}, "sample": None, "state": None, "config": config, "preempted": False,
                "nothing_to_train": True}
    inputs = data_lib.make_inputs(config, log=log)
    task_evals = evals.from_config(config, inputs.tokenizer, mesh, rt, log=log)  # data checked, requests packed
    t0 = time.time()
    step_fn = run.compile() if compiled_step is None else compiled_step  # from the state's shapes and shardings
    log(builder.summarize(run, step_fn, time.time() - t0, start))
    memory.check_fits(run, step_fn)  # a step the devices cannot hold is refused before the state takes memory
    host_memory.release_unused()  # what compiling left in malloc goes back before the state and the steps take theirs
    metadata = write_metadata(config, rt, start)
    writer = metrics.MetricWriter(config, active=jax.process_index() == 0)
    writer.write_text("config", "```\n" + yaml.safe_dump(config.to_dict(), sort_keys=False) + "\n```")

    with sharding.activation_sharding(mesh, rules):
        state = checkpoint_lib.initial_state(start, checkpointer, run.abstract_state, run.init,
                                             jax.random.key(config.seed), inputs.train_iterator, log=log)
        first_batch = pipeline.to_global(next(inputs.train_iterator), mesh, rules)
        eval_step = run.eval_step
        has_eval = len(inputs.eval_batches) > 0

        def eval_batches():  # read afresh each evaluation: one eval epoch need not fit in memory
            return (pipeline.to_global(b, mesh, rules, pipeline.EVAL_BATCH_AXES) for b in inputs.eval_batches)
        viz_batch = (pipeline.to_global(inputs.eval_batches[0], mesh, rules, pipeline.EVAL_BATCH_AXES)
                     if has_eval and inputs.tokenizer is not None and config.viz_period > 0 else None)
        peak = metrics.peak_tflops(config, log=log)
        if peak is None:
            log("MFU: unknown peak for this device; set peak_tflops_per_device=<dense TFLOP/s per device> to report it")

        start_step = int(jax.device_get(state["step"]))
        profiler = profiler_lib.Profiler(config, start_step, log)  # profiler=xplane: traces a few steps
        eval_losses, eval_metrics = {}, {}
        if has_eval and start_step == 0:
            eval_losses[0], eval_metrics[0] = evaluate(eval_step, state, eval_batches())
            log_eval(0, eval_losses[0], eval_metrics[0], writer)
        if task_evals and start_step == 0 and config.eval_tasks_interval > 0:
            task_evals.run(run.model_params(state), 0, writer)

        loss_scaled = rt.dtype == jnp.float16
        pending = None  # (step, device metrics) of the step dispatched last
        last_done = time.time()
        batch = first_batch
        preempted = False
        preemption = preemption_lib.Preemption()  # SIGTERM: save the current step, then stop
        for step in range(start_step, config.steps):
            if step != start_step:
                batch = pipeline.to_global(next(inputs.train_iterator), mesh, rules)
            profiler.step(step, state)
            state, step_metrics = step_fn(state, batch)  # dispatched; runs while we report the previous step
            if pending is not None:
                last_done = _report(pending, config, peak, writer, last_done, loss_scaled)
                if pending[0] == start_step:  # one step done (and the first evaluation compiled): again
                    host_memory.release_unused()
            pending = (step, step_metrics)
            done = step + 1
            is_last = done == config.steps
            saving = checkpointer and (done % config.checkpoint_period == 0 or is_last)
            if saving:
                checkpointer.save(done, state, inputs.train_iterator, metadata)
            elif checkpointer:
                checkpointer.poll()  # a failed background save stops the run here
            if preemption.reached(done) and not is_last:
                log(f"SIGTERM (preemption): {'saving step ' + str(done) if checkpointer else 'checkpointing is off, nothing saved'}"
                    " and stopping; re-run the same command to resume")
                if checkpointer and not saving:
                    checkpointer.save(done, state, inputs.train_iterator, metadata)
                preempted = True
                break
            if has_eval and config.eval_interval > 0 and (done % config.eval_interval == 0 or is_last):
                last_done = _report(pending, config, peak, writer, last_done, loss_scaled)
                pending = None
                eval_losses[done], eval_metrics[done] = evaluate(eval_step, state, eval_batches())
                log_eval(done, eval_losses[done], eval_metrics[done], writer)
                last_done = time.time()  # the eval's time is not a train step's
            if task_evals and task_evals.due(done, is_last):
                if pending is not None:
                    last_done, pending = _report(pending, config, peak, writer, last_done, loss_scaled), None
                task_evals.run(run.model_params(state), done, writer)
                last_done = time.time()
            if viz_batch is not None and done % config.viz_period == 0:
                if pending is not None:
                    last_done, pending = _report(pending, config, peak, writer, last_done, loss_scaled), None
                path = viz.write_heatmap(done, run.model_params(state), viz_batch, config, rt, inputs.tokenizer, writer)
                log(f"token heatmap at step {done}: {path}")
                last_done = time.time()
        preemption.close()
        profiler.stop(state)
        if pending is not None:
            _report(pending, config, peak, writer, last_done, loss_scaled)

        if checkpointer:
            checkpointer.close()
        writer.close()
        inputs.close()  # stops background cache building; finished shards stay
        sample = None
        tok = inputs.tokenizer
        prompt = tokenizer_lib.prompt_ids(tok, config.prompt) if tok is not None else []
        if config.max_new_tokens > 0 and prompt and not preempted:
            new = decode.generate(run.model_params(state), prompt, config, rt, max_new_tokens=config.max_new_tokens,
                                  eos_id=tok.eos_ids)
            sample = decode.trim_sample(config.prompt + tok.decode(new))  # not the blank lines after its end
            log(f"greedy sample from {config.prompt!r}:\n{sample}")
    log(f"done in {time.time() - start_time:.1f}s")
    return {"eval_losses": eval_losses, "eval_metrics": eval_metrics, "sample": sample, "state": state, "config": config, "preempted": preempted}


def _report(pending, config, peak, writer, last_done: float, loss_scaled: bool) -> float:
    """Waits for a dispatched step's metrics, writes them; returns when they arrived."""
    step, device_metrics = pending
    raw = jax.device_get(device_metrics)
    now = time.time()
    m = metrics.step_metrics(raw, now - last_done, config, peak)
    check_finite(step + 1, m, loss_scaled, config.loss_scale_min)
    writer.write(step + 1, m, print_line=(step + 1) % config.log_period == 0 or step == 0)
    return now


if __name__ == "__main__":
    # A failed save's background writers would only add tracebacks on the way out: CheckpointError ends at once.
    result = run_cli("maxtrain", main, hard_exit=(checkpoint_files.CheckpointError,))
    if result["preempted"]:
        sys.exit(143)  # 128 + SIGTERM, as if killed by it: the run is saved but not finished
