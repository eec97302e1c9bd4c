#!/usr/bin/env python3
"""Input pipeline throughput alone (no model):  tokens/s the training iterator delivers on this host.

    python scripts/benchmark_input.py configs/base.yml dataset_type=arrayrecord \
        grain_train_files='data/web/train-*.arrayrecord' [key=value ...] [--batches 500] [--warmup 10]

Builds exactly the iterator training uses (make_inputs) for process 0 of num_processes (default 1),
pulls --warmup batches, then times --batches more. Prints tokens/s of whole rows (what the model
consumes) and of real tokens (loss weight > 0; less than rows with first_fit or packing=false).

--train-steps N then trains N steps (maxtrain.train.main, no eval or checkpoints) and prints the
median wall and process-CPU seconds per step after the first 10, and how long the training loop
waited in next() for its batch, to compare real data with dataset_type=synthetic. CPU seconds (all threads: XLA's and Grain's) are what to compare on a machine
that other work shares: wall time there varies by more than the difference being measured.
"""

import argparse
import statistics
import time

import jax

from maxtrain import config as config_lib
from maxtrain.data import make_inputs, pipeline
from maxtrain.errors import run_cli


class _Timed:
    """The training iterator, timing how long the training loop waits in next() for each batch."""

    def __init__(self, iterator):
        self.iterator, self.waits = iterator, []

    def __iter__(self):
        return self

    def __next__(self):
        start = time.perf_counter()
        batch = next(self.iterator)
        self.waits.append(time.perf_counter() - start)
        return batch


def train_step_times(args: list[str], steps: int) -> tuple[float, float, float]:
    """Median (wall s, CPU s, wait in next() s) per training step after the first 10 steps; a step is
    timed from one host batch -> global array to the next."""
    from maxtrain import train  # pylint: disable=import-outside-toplevel

    stamps, timed = [], []
    to_global, make = pipeline.to_global, train.data_lib.make_inputs

    def tap(batch, *a, **k):
        if batch["inputs"].ndim == 3:  # training batches only
            stamps.append((time.perf_counter(), time.process_time()))
        return to_global(batch, *a, **k)

    def make_timed(*a, **k):
        inputs = make(*a, **k)
        inputs.train_iterator = _Timed(inputs.train_iterator)
        timed.append(inputs.train_iterator)
        return inputs

    pipeline.to_global, train.data_lib.make_inputs = tap, make_timed
    try:
        train.main(config_lib.with_overrides(
            args, f"steps={steps}", "eval_interval=-1", "enable_checkpointing=false", "max_new_tokens=0",
            "enable_tensorboard=false", f"log_period={steps}", f"run_name=benchmark_input_{time.time():.0f}"))
    finally:
        pipeline.to_global, train.data_lib.make_inputs = to_global, make
    deltas = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(stamps[10:], stamps[11:])]
    return (statistics.median(d[0] for d in deltas), statistics.median(d[1] for d in deltas),
            statistics.median(timed[0].waits[10:]))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    parser.add_argument("--train-steps", type=int, default=0, help="also train this many steps and time them")
    opts, rest = parser.parse_known_args(argv)
    config = config_lib.load_config(rest)
    hosts = max(config.num_processes, 1)
    config = config_lib.with_devices(config, jax.local_device_count() * hosts, 1)
    start = time.time()
    inputs = make_inputs(config, log=lambda *_: None, process_index=0, process_count=hosts)
    iterator = inputs.train_iterator
    for _ in range(opts.warmup):
        next(iterator)
    print(f"set-up {time.time() - start:.2f}s (opening and checking the data, {opts.warmup} warm-up batches)")
    rates, total_rows, total_real, total_seconds = [], 0, 0, 0.0
    for _ in range(opts.repeats):
        rows = real = 0
        t0 = time.perf_counter()
        for _ in range(opts.batches):
            batch = next(iterator)
            rows += batch["inputs"].size
            real += int(batch["loss_weights"].sum())
        seconds = time.perf_counter() - t0
        rates.append(rows / seconds)
        total_rows, total_real, total_seconds = total_rows + rows, total_real + real, total_seconds + seconds
    inputs.close()
    shape = "x".join(map(str, batch["inputs"].shape))
    print(f"dataset_type={config.dataset_type} packing={config.packing}"
          f"{'/' + config.grain_packing_type if config.packing else ''} batch [{shape}] x {opts.batches} batches, "
          f"{opts.repeats} runs")
    overall = total_rows / total_seconds  # not the median: window shuffles and prefetching come in bursts
    print(f"input pipeline: {overall:,.0f} tokens/s ({total_real / total_seconds:,.0f} real tokens/s; "
          f"runs: {', '.join(f'{r:,.0f}' for r in rates)})")
    if opts.train_steps:
        wall, cpu, wait = train_step_times(rest, opts.train_steps)
        tokens = config.global_batch_size * config.max_target_length
        print(f"training: {wall:.4f} s/step wall ({tokens / wall:,.0f} tokens/s), {cpu:.4f} CPU-s/step, "
              f"waiting for input {1e3 * wait:.2f} ms/step = {100 * wait / wall:.3f}% of the step "
              f"(medians of steps 11-{opts.train_steps}); the pipeline alone is "
              f"{overall / (tokens / wall):,.0f}x faster than training consumes")


if __name__ == "__main__":
    run_cli("benchmark_input", main)
