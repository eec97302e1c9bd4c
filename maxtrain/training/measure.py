"""Measuring a training step as train.py builds it: scripts/benchmark.py and scripts/gpu_report.py.

    build(config)          the run, its compiled step, a fresh state and up to 4 batches on the devices
    timed_step(...)        one step from dispatch until its metrics are on the host, timed
    step_figures(...)      median step time, tokens/s, TFLOP/s and MFU per device, compiled and peak memory
    loss_and_grads(run)    the jitted (params, micro batch) -> (loss, grads) of the run's objective, to
                           compare implementations (attention, dtype) on the same params and batch

Times are wall seconds from dispatch until the step's metrics are ready; the batch is on the device
before the clock starts, so input-pipeline time is not counted. FLOPs are model FLOPs
(metrics.flops_per_token: causal attention counted once, remat recomputation not counted).
"""

from __future__ import annotations

import resource
import statistics
import time

import jax
import numpy as np

from maxtrain import data as data_lib
from maxtrain.compile import fit
from maxtrain.data import pipeline
from maxtrain.observability import metrics
from maxtrain.parallel import sharding
from maxtrain.training import builder, layer_choice, losses

# What a measured run leaves out: checkpoints, TensorBoard, evaluation, sampling and the metrics file.
MEASURE_OVERRIDES = ["enable_checkpointing=false", "enable_tensorboard=false", "eval_interval=-1",
                     "max_new_tokens=0", "metrics_file="]


def build(config, log=print):
    """What train.py builds: (run, compiled step, initial state, up to 4 batches on the devices, compile
    seconds); logs the run's summary. On a GPU or TPU with remat_policy=autoselected the remat policy is
    chosen by compiled memory as train.py chooses it (training/layer_choice.py; its compiles counted in the
    compile seconds)."""
    run = builder.build(config)
    t0 = time.perf_counter()
    chosen = None
    if layer_choice.applies(config, run.rt.backend):
        chosen = layer_choice.choose_on_devices(run, lambda plan: builder.build(config, layer_plan=plan))
        run = chosen.run
    choice_seconds = time.perf_counter() - t0
    mesh, rules = run.mesh, run.config.logical_axis_rules
    inputs = data_lib.make_inputs(run.config, log=log, vision=run.model.family.vision)
    with sharding.activation_sharding(mesh, rules):
        state = run.init(jax.random.key(run.config.seed))
        batches = [pipeline.to_global(next(inputs.train_iterator), mesh, rules)
                   for _ in range(min(run.config.steps, 4))]
        t0 = time.perf_counter()
        step_fn = chosen.compiled if chosen is not None else run.compile(state, batches[0])
        compile_seconds = time.perf_counter() - t0 + choice_seconds
        log(builder.summarize(run, step_fn, compile_seconds))
    inputs.close()
    return run, step_fn, state, batches, compile_seconds


def new_timings() -> dict:
    return {"times": [], "cpu_times": [], "losses": []}


def timed_step(step_fn, state, batch, timings: dict, timed: bool):
    """Runs one step, from dispatch until its metrics are on the host (the batch already on the device);
    appends its seconds and process CPU seconds (when timed) and its loss to timings. Returns the state."""
    jax.block_until_ready(batch)
    t, cpu = time.perf_counter(), time.process_time()
    state, step_metrics = step_fn(state, batch)
    step_metrics = jax.block_until_ready(step_metrics)
    if timed:
        timings["times"].append(time.perf_counter() - t)
        timings["cpu_times"].append(time.process_time() - cpu)
    timings["losses"].append(float(step_metrics["loss"]))
    return state


def process_peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_peak_bytes() -> int | None:
    """The first local device's peak_bytes_in_use, where its backend reports one (GPU, TPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def step_figures(run, times: list[float], step_fn) -> dict:
    """The figures of timed steps: median (min, max) step seconds, tokens/s, model TFLOP/s and MFU per
    device, the compiled step's memory and the measured peak (the device's, else this process' RSS)."""
    config = run.config
    median = statistics.median(times)
    tokens_per_device = config.tokens_per_step / config.num_devices
    tflops = run.flops_per_token() * tokens_per_device / median / 1e12
    peak = metrics.peak_tflops(config)
    measured_peak = device_peak_bytes()
    return {
        "timed_steps": len(times), "step_seconds_median": median, "step_seconds_min": min(times),
        "step_seconds_max": max(times), "tokens_per_second_per_device": tokens_per_device / median,
        "tflops_per_second_per_device": tflops, "peak_tflops_per_device": peak, "mfu": tflops / peak if peak else None,
        "compiled_memory_bytes": fit.compiled_bytes(step_fn),
        "measured_peak_bytes": measured_peak if measured_peak is not None else process_peak_rss_bytes(),
        "measured_peak_is": "device peak_bytes_in_use" if measured_peak is not None else "process peak RSS",
    }


def loss_and_grads(run):
    """jit of (params, micro batch [B, T]) -> (mean loss over the batch's weighted tokens, grads of it):
    the run's objective and model, as its train step computes them for one micro-batch, without the
    optimizer."""
    objective = losses.make(run.config, run.model, run.rt)

    def mean_loss(params, batch):
        loss, weight, _ = objective(params, batch, None)
        return loss / jax.numpy.maximum(weight, 1.0)

    return jax.jit(jax.value_and_grad(mean_loss))


def relative_tree_errors(tree, reference) -> dict:
    """How far a pytree of arrays (gradients) is from a reference one: the global relative L2 error
    ||tree - reference|| / ||reference|| over all leaves, and the leaf with the largest relative error
    (inf where a leaf is not finite)."""
    flat = jax.tree_util.tree_flatten_with_path(reference)[0]
    leaves = jax.tree.leaves(tree)
    diff_sq = ref_sq = 0.0
    worst, worst_name = 0.0, ""
    for (path, r), a in zip(flat, leaves):
        r, a = np.asarray(r, np.float64), np.asarray(a, np.float64)
        if not np.all(np.isfinite(a)):
            return {"grads": float("inf"), "worst_leaf": jax.tree_util.keystr(path), "worst_leaf_error": float("inf")}
        d, n = float(np.sum((a - r) ** 2)), float(np.sum(r ** 2))
        diff_sq, ref_sq = diff_sq + d, ref_sq + n
        error = (d / max(n, 1e-60)) ** 0.5
        if error > worst:
            worst, worst_name = error, jax.tree_util.keystr(path)
    return {"grads": (diff_sq / max(ref_sq, 1e-60)) ** 0.5, "worst_leaf": worst_name, "worst_leaf_error": worst}
