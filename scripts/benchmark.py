"""Measure a training configuration:  python scripts/benchmark.py CONFIG [key=value ...] [--steps N]

Builds exactly what `python -m maxtrain.train` builds (config, mesh, input pipeline, sharded state,
the jit-compiled train step, using train.py's own pieces), then runs warm-up steps and N timed steps,
and prints

    compile time          lowering + XLA compilation of the train step
    step time             median (and min / max) over the N timed steps, each timed from dispatch
                          to its metrics being ready; the batch is on the device before the clock
                          starts, so input-pipeline time is not counted
    tokens/s/device       tokens per step / devices / median step time
    TFLOP/s/device, MFU   model FLOPs (metrics.flops_per_token: causal attention counted once,
                          remat recomputation not counted) / median step time; MFU against the
                          device's peak (the chip records, config/chips.py or peak_tflops_per_device=...; a CPU
                          has no table entry, see docs/performance.md for how to measure one)
    CPU seconds/step      median process CPU time (all threads) per timed step: the work a step
                          costs, less sensitive than wall time to other load on a shared machine
    memory                the compiled step's memory_analysis() (arguments + outputs + temporaries
                          - aliased), and the measured peak: the device's peak_bytes_in_use where
                          the backend reports it (GPU, TPU), else this process' peak RSS (CPU)

Options (before or after the overrides): --steps N (timed steps, default 10), --warmup N (default 2),
--json PATH (append the figures as one JSON object), --profile N (after timing, trace N more steps
with jax.profiler and print the ops that took longest, summed per op). Checkpointing, TensorBoard and evaluation
are off; nothing is written except --json. Use dataset_type=synthetic to leave data loading out.

    python scripts/benchmark.py CONFIG [key=value ...] --compare "key=value ..." --compare "key=value ..."

compares two or more variants of CONFIG (each --compare adds its overrides to the common ones,
replacing a common setting of the same key) in one process: each is built, compiled and warmed up,
then their N timed steps run alternately, one step of each in turn (the order reversed every round),
so that a machine whose speed drifts from minute to minute (a shared or virtual machine, a laptop
warming up) slows them alike. It prints each variant's median and 25th-percentile step time, CPU
seconds per step, its ratio to the first variant, its losses and its compiled memory. Separate runs
of the same configuration on a 2-vCPU virtual machine differed by up to half in median step time;
two identical variants alternated in one process by 1% to 4% (docs/performance.md, "Comparing
variants in one process").

    python scripts/benchmark.py --measure-peak

instead measures what this machine's first device achieves on a large square matmul (float32 and
bfloat16, 4096^3, median of 10): a measured stand-in for a device peak where no data sheet
applies (a CPU), to pass as peak_tflops_per_device=... so that MFU means "fraction of what a
large matmul achieves here".
"""

from __future__ import annotations

if __name__ == "__main__":  # as the trainer does, before JAX starts (maxtrain/host_memory.py)
    from maxtrain.training import host_memory

    host_memory.reexec_with_hugepages()
# pylint: disable=wrong-import-position

from maxtrain import errors  # noqa: E402
from maxtrain.training import benchmark  # noqa: E402

if __name__ == "__main__":
    errors.run_cli("benchmark", benchmark.run)
