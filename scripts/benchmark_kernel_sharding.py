"""Compiled memory of a model step with the flash kernel inside shard_map and without it (GSPMD).

On 8 simulated CPU devices (the kernel in Pallas interpret mode, as in tests/parallel/test_attention_sharded.py),
for each mesh: bytes per device the compiled loss-and-gradient step needs (arguments, temporaries,
total) and the all-gathers of q, k or v it holds (results with both a sequence and a head_dim axis),
once with the kernel inside shard_map (maxtrain's path) and once left to GSPMD. CPU figures only:
they show what partitioning does, not an accelerator's memory.

    python scripts/benchmark_kernel_sharding.py [--length 256] [--batch 8]
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.params import is_spec
from maxtrain.models import ops  # noqa: E402
from maxtrain.parallel import sharding  # noqa: E402
from maxtrain.config import load_config, with_devices  # noqa: E402
from maxtrain.compile import fit  # noqa: E402
from maxtrain.errors import run_cli  # noqa: E402

BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")
MESHES = {"dp": (8, 1, 1), "fsdp": (1, 8, 1), "tp": (2, 1, 4), "fsdp_x_tp": (1, 4, 2)}
HEAD_DIM = 16


def compile_step(args, mesh_shape, with_shard_map: bool):
    data, fsdp, tensor = mesh_shape
    cfg = with_devices(load_config([
        BASE_YML, "base_emb_dim=32", "base_num_query_heads=8", "base_num_kv_heads=4", f"head_dim={HEAD_DIM}",
        "base_mlp_dim=96", "base_num_decoder_layers=2", "vocab_size=512", f"max_target_length={args.length}",
        f"per_device_batch_size={args.batch / 8}", "dtype=float32", "remat_policy=full", "attention=flash",
        "sa_block_q=64", "sa_block_kv=64", f"ici_data_parallelism={data}", f"ici_fsdp_parallelism={fsdp}",
        f"ici_tensor_parallelism={tensor}"]), 8)
    rt = Runtime.from_config(cfg, "cpu")
    mesh = sharding.create_mesh(cfg, jax.devices())
    rules = cfg.logical_axis_rules
    param_shardings = jax.tree.map(lambda s: sharding.named_sharding(mesh, s.axes, rules), Model.bind(cfg).param_specs,
                                   is_leaf=is_spec)
    params = jax.eval_shape(lambda: Model.bind(cfg).init_params(jax.random.key(0)))
    batch_sharding = sharding.named_sharding(mesh, ("batch", "length"), rules)
    shape = (args.batch, args.length)
    batch = {k: jax.ShapeDtypeStruct(shape, dt) for k, dt in (("inputs", np.int32), ("targets", np.int32),
                                                             ("positions", np.int32), ("segment_ids", np.int32),
                                                             ("loss_weights", np.float32))}

    def loss(p, b):
        logits, _ = Model.bind(cfg).forward(p, b["inputs"], b["positions"], b["segment_ids"], rt)
        return ops.cross_entropy(logits, b["targets"], b["loss_weights"])

    original = sharding.run_in_shards
    if not with_shard_map:
        sharding.run_in_shards = lambda fn, fn_args, *_: fn(*fn_args)
    try:
        with sharding.activation_sharding(mesh, rules):
            return jax.jit(jax.value_and_grad(loss), in_shardings=(param_shardings, batch_sharding)).lower(
                params, batch).compile()
    finally:
        sharding.run_in_shards = original


def qkv_gathers(hlo: str, length: int) -> int:
    count = 0
    for line in hlo.splitlines():
        match = re.search(r"= \w+\[([\d,]*)\][^=]*? all-gather(-start)?\(", line)
        if match and {length, HEAD_DIM} <= {int(d) for d in match.group(1).split(",") if d}:
            count += 1
    return count


def main(argv):
    parser = argparse.ArgumentParser(prog="benchmark_kernel_sharding", description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=256, help="tokens per row: a multiple of 64 (the kernel's block)")
    parser.add_argument("--batch", type=int, default=8, help="rows: a multiple of 8 (the devices)")
    args = parser.parse_args(argv)
    if args.length < 64 or args.length % 64:
        parser.error(f"--length {args.length} must be a positive multiple of 64 (the kernel's block)")
    if args.batch < 8 or args.batch % 8:
        parser.error(f"--batch {args.batch} must be a positive multiple of 8 (the simulated devices)")
    with open("/proc/loadavg", encoding="utf-8") as f:
        load = f.read().split()[0]
    print(f"# python scripts/benchmark_kernel_sharding.py {shlex.join(argv)}  (load {load})")
    print("| mesh (data x fsdp x tensor) | kernel | arguments MiB | temporaries MiB | total MiB | q/k/v all-gathers |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, mesh_shape in MESHES.items():
        for with_shard_map in (True, False):
            compiled = compile_step(args, mesh_shape, with_shard_map)
            m = compiled.memory_analysis()
            total = fit.compiled_bytes(compiled)
            label = "in shard_map" if with_shard_map else "GSPMD (no shard_map)"
            print(f"| {name} {'x'.join(map(str, mesh_shape))} | {label} | {m.argument_size_in_bytes / 2**20:.2f} | "
                  f"{m.temp_size_in_bytes / 2**20:.2f} | {total / 2**20:.2f} | "
                  f"{qkv_gathers(compiled.as_text(), args.length)} |", flush=True)


if __name__ == "__main__":
    run_cli("benchmark_kernel_sharding", main)
