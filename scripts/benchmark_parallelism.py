"""Compare mesh layouts of one model on simulated CPU devices: per-device compiled memory and step time.

    python scripts/benchmark_parallelism.py [--devices 8] [--global-batch 8] [--steps 5] [--rounds 2] \\
        --layout "fsdp2@2:ici_fsdp_parallelism=2" --layout "cp4@8:ici_context_parallelism=4,ici_fsdp_parallelism=2" \\
        -- base.yml max_target_length=1024 ...

A layout is NAME[@DEVICES]:key=value,key=value: its overrides, on the first DEVICES devices (default
--devices). Every layout builds the run with builder.build (what train.py runs) on the same config
plus its own overrides, with the global batch fixed (per_device_batch_size = --global-batch /
devices), on synthetic data, and compiles the train step. Per layout it prints

    memory/device   the compiled step's memory_analysis(): arguments + outputs + temporaries - aliased,
                    and the temporaries alone (activations, gathered weights, attention scores)
    step time       median wall time of the timed steps (dispatch to metrics ready), over all rounds
    CPU s/step      process CPU time per step (all threads): on a shared machine, the work a step costs
    loss            of the first step (every layout computes the same loss; a check, not a benchmark)

Timing rounds are interleaved (layout A, B, C, then A, B, C again) so that a change of load on a
shared machine affects every layout alike; the load average is printed with the results. Simulated
CPU devices share the same cores: a layout's speed here measures its extra work and communication
(copies between device buffers), never the parallel speed-up of real accelerators.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    _n = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "8"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={_n}").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from maxtrain.training import builder  # noqa: E402
from maxtrain.parallel import sharding  # noqa: E402
from maxtrain import config as config_lib  # noqa: E402
from maxtrain.compile import fit  # noqa: E402
from maxtrain.errors import ToolError, run_cli  # noqa: E402

FIXED = ["dataset_type=synthetic", "enable_checkpointing=false", "enable_tensorboard=false", "eval_interval=-1",
         "max_new_tokens=0"]


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="benchmark_parallelism", description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (XLA_FLAGS)")
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, the same for every layout")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per layout and round")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved timing rounds")
    parser.add_argument("--layout", action="append", required=True,
                        help="NAME[@DEVICES]:key=value,key=value (the layout's overrides and device count)")
    parser.add_argument("config", nargs="+", help="config file and key=value overrides shared by every layout")
    args = parser.parse_args(argv)
    if min(args.devices, args.global_batch, args.steps, args.rounds) < 1:
        parser.error("--devices, --global-batch, --steps and --rounds must be >= 1")
    return args


def parse_layout(spec: str, default_devices: int) -> tuple[str, int, list[str]]:
    """NAME[@DEVICES]:key=value,key=value -> (name, devices, overrides)."""
    name, _, overrides = spec.partition(":")
    name, _, devices = name.partition("@")
    if not name or (devices and not devices.isdigit()) or devices == "0":
        raise ToolError(f"--layout {spec!r} must be NAME[@DEVICES]:key=value,..., e.g. "
                          "--layout \"fsdp2@2:ici_fsdp_parallelism=2\" (DEVICES a number >= 1)")
    count = int(devices or default_devices)
    if count > default_devices:
        raise ToolError(f"--layout {spec!r} asks for {count} devices, more than the {default_devices} simulated "
                          f"ones; raise --devices to {count}")
    return name, count, [o for o in overrides.split(",") if o]


def synthetic_batch(config, sharding_):
    rng = np.random.default_rng(0)
    shape = (config.gradient_accumulation_steps, config.micro_batch_size, config.max_target_length)
    tokens = rng.integers(4, config.vocab_size, shape[:-1] + (shape[-1] + 1,), dtype=np.int32)
    batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "segment_ids": np.ones(shape, np.int32),
             "positions": np.broadcast_to(np.arange(shape[-1], dtype=np.int32), shape).copy(),
             "loss_weights": np.ones(shape, np.float32)}
    return jax.device_put(batch, sharding_)


class Layout:
    def __init__(self, name, devices, overrides, base, args):
        per_device = args.global_batch // devices
        config = config_lib.load_config(config_lib.with_overrides(base, *FIXED, f"per_device_batch_size={per_device}",
                                                                    *overrides))
        self.name, self.devices, self.overrides = name, devices, overrides
        self.run = builder.build(config, devices=jax.devices()[:devices])
        rules = self.run.config.logical_axis_rules
        with sharding.activation_sharding(self.run.mesh, rules):
            self.state = self.run.init(jax.random.key(0))
            self.batch = synthetic_batch(self.run.config, self.run.batch_sharding)
            start = time.time()
            self.step = self.run.compile(self.state, self.batch)
            self.compile_s = time.time() - start
        self.total = fit.compiled_bytes(self.step)
        self.temp = self.step.memory_analysis().temp_size_in_bytes
        self.wall, self.cpu, self.loss = [], [], None

    def time_steps(self, n):
        with sharding.activation_sharding(self.run.mesh, self.run.config.logical_axis_rules):
            if self.loss is None:  # the first step: the loss to compare, and a warm-up
                self.state, m = self.step(self.state, self.batch)
                self.loss = float(m["loss"])
            for _ in range(n):
                wall, cpu = time.perf_counter(), time.process_time()
                self.state, m = self.step(self.state, self.batch)
                jax.block_until_ready(m)
                self.wall.append(time.perf_counter() - wall)
                self.cpu.append(time.process_time() - cpu)


def main(argv):
    args = parse_args(argv)
    layouts = []
    specs = [parse_layout(spec, args.devices) for spec in args.layout]  # all refused before any is built
    for name, devices, _ in specs:
        if args.global_batch % devices:
            raise ToolError(f"--global-batch {args.global_batch} is not a multiple of the {devices} devices of layout "
                              f"{name}; choose a --global-batch that every layout's device count divides")
    for name, devices, overrides in specs:
        layouts.append(Layout(name, devices, overrides, args.config, args))
        print(f"built {name}: mesh {dict(layouts[-1].run.mesh.shape)}, compiled in {layouts[-1].compile_s:.1f}s",
              flush=True)
    for _ in range(args.rounds):
        for layout in layouts:
            layout.time_steps(args.steps)
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    c = layouts[0].run.config
    print(f"\ncommand: python scripts/benchmark_parallelism.py {' '.join(argv)}")
    print(f"model {c.model_name}: D {c.base_emb_dim}, L {c.base_num_decoder_layers}, T {c.max_target_length}, "
          f"global batch {args.global_batch}, simulated CPU devices; {args.rounds} rounds x "
          f"{args.steps} steps, interleaved; load average {load} on {os.cpu_count()} cores; jax {jax.__version__}")
    print("\n| layout | devices | mesh (axes > 1) | memory/device MiB | temporaries MiB | step s (median) | CPU s/step | loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for layout in layouts:
        mesh = " x ".join(f"{a} {n}" for a, n in layout.run.mesh.shape.items() if n > 1) or "1 device"
        print(f"| {layout.name} | {layout.devices} | {mesh} | {layout.total / 2**20:.1f} | {layout.temp / 2**20:.1f} | "
              f"{statistics.median(layout.wall):.3f} | {statistics.median(layout.cpu):.3f} | {layout.loss:.5f} |")


if __name__ == "__main__":
    run_cli("benchmark_parallelism", main)
