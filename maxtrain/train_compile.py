"""Compile the train step ahead of time for a TPU pod or a GPU cluster, on a machine without one:

    python -m maxtrain.train_compile configs/base.yml compile_topology=v5p-256 compile_topology_num_slices=2 \\
        model_name=llama3-8b per_device_batch_size=1 remat_policy=full

It compiles exactly the step train.py runs (builder.build, given the target's devices and platform:
the same mesh, shardings, remat policy, attention kernels and gradient accumulation), with the
target's own compiler (libtpu; XLA's GPU pipeline down to sm_90a code), and prints a short table:
the mesh, per-chip memory against the chip's, the collectives per step, model TFLOPs per chip per
step and the compile time. It exits 3 when the step does not fit the chip's memory, saying by how
much and which settings would help. `compiled_trainstep_file=PATH` saves the executable for
train.py to load on the target. Targets: maxtrain/compile/targets.py; figures at scale: docs/scale.md.

Without a GPU XLA does not autotune matmuls or build cuDNN graphs, so a GPU target's memory can
differ somewhat from a compile on the GPU itself.
"""

from __future__ import annotations

import contextlib
import json
import sys

import jax

from maxtrain import config as config_lib
from maxtrain import storage
from maxtrain.compile import executable, libtpu, predict, report, targets
from maxtrain.errors import run_cli
from maxtrain.training import ahead_of_time, builder

EXIT_DOES_NOT_FIT = 3
KEYS = ("compile_topology", "compile_topology_num_slices", "model_name", "per_device_batch_size", "max_target_length",
        "remat_policy", "dtype", "attention", "ici_fsdp_parallelism", "ici_tensor_parallelism", "compiled_trainstep_file",
        "compile_report_file")


def main(argv: list[str]) -> int:
    config = builder.load_config(argv, log=lambda *a: print(*a, file=sys.stderr), command="maxtrain.train_compile")
    if config.compile_report_file:  # refused now, not after the compile
        storage.check_output(config.compile_report_file, True,
                             f"compile_report_file={storage.abspath(config.compile_report_file)!r}")
    if config.compiled_trainstep_file:
        storage.check_output(config.compiled_trainstep_file, True,
                             f"compiled_trainstep_file={storage.abspath(config.compiled_trainstep_file)!r}")
    target = targets.parse(config.compile_topology, config.compile_topology_num_slices)
    if target.platform != "cpu":
        # Compiling for another target needs no accelerator here; keep JAX from probing for one.
        jax.config.update("jax_platforms", "cpu")
    if target.platform != "cpu":  # a chip record missing a figure the prediction needs: said before the compile
        domains = target.num_slices * (target.shape[0] if target.platform == "gpu" else 1)
        predict.check_record(targets.chip_record(target), target.num_devices, domains)
    print(f"compiling the train step for {target.describe()} ...", flush=True)
    try:
        with executable.compiled_afresh() if config.compiled_trainstep_file else contextlib.nullcontext():
            run, lowered, compiled, seconds = ahead_of_time.compile_for_target(config, target)
    except jax.errors.JaxRuntimeError as error:
        smem = libtpu.out_of_scalar_memory(error)
        if smem is not None:
            print(f"maxtrain.train_compile: error: {report.scalar_memory_message(*smem, config, target.chip)}",
                  file=sys.stderr, flush=True)
            return EXIT_DOES_NOT_FIT
        vmem = libtpu.out_of_scoped_vmem(error)
        if vmem is not None:
            print(f"maxtrain.train_compile: error: {report.scoped_vmem_message(*vmem, config, target.chip)}",
                  file=sys.stderr, flush=True)
            return EXIT_DOES_NOT_FIT
        refused = libtpu.out_of_memory(error)
        if refused is None:
            raise
        needed, available = refused
        run = builder.build(config, devices=target.devices(), platform=target.platform, num_processes=1)
        mesh = dict(run.mesh.shape)
        print("the TPU compiler refused the step: its temporaries alone need more than the chip's memory\n"
              f"mesh        {' x '.join(f'{axis} {size}' for axis, size in mesh.items())}", flush=True)
        knobs = report.knobs(config, mesh, len(target.devices()), run.rt.attention, target.platform)
        print(f"maxtrain.train_compile: error: {report.refused_message(needed, available, target.chip, knobs)}",
              file=sys.stderr, flush=True)
        return EXIT_DOES_NOT_FIT
    rep = {**report.report(run, compiled, target, seconds), **ahead_of_time.choice_report(run)}
    print("\n".join([report.format_report(rep), *report.format_choices(rep)]), flush=True)
    if config.compile_report_file:
        storage.write_text(config.compile_report_file, json.dumps(rep, indent=1, default=str))
        print(f"wrote the figures to {config.compile_report_file} (JSON)", flush=True)
    if not report.fits(rep):
        print(f"maxtrain.train_compile: error: {report.overshoot_message(rep, config)}", file=sys.stderr, flush=True)
        return EXIT_DOES_NOT_FIT
    if config.compiled_trainstep_file:
        size = executable.save(config.compiled_trainstep_file, run, lowered, compiled)
        print(f"saved the compiled step to {config.compiled_trainstep_file} ({size / 2**20:.1f} MiB); run train.py "
              f"with compiled_trainstep_file={config.compiled_trainstep_file} on the target", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("maxtrain.train_compile", main, usage=lambda: config_lib.command_help(__doc__, KEYS)))
