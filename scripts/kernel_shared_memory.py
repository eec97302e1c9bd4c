"""Shared memory the GPU flash kernels ask Triton for, against flash_tiles.shared_memory_bytes.

Compiles each kernel (forward, dq, dk/dv) alone for a GPU target whose shared-memory limit is set
to 1 KiB, so every compile stops with Triton's "requested N" (no GPU needed; needs the [cuda]
extra). Prints one row per (kernel, head_dim, dtype, blocks, warps, stages) with the reported
bytes, the estimate and their difference. This is how the estimate in kernels/flash_tiles.py
was fitted (docs/performance.md, "Kernel tiles").

    python scripts/kernel_shared_memory.py [--target h100|a100] [--dtype bfloat16] [--head-dims 64,128,256]
"""

from __future__ import annotations

import argparse
import itertools
import re
import shlex

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from maxtrain.kernels import flash_attention as flash_attention_module
from maxtrain.kernels import flash_tiles
from maxtrain.compile import targets
from maxtrain.errors import run_cli

BLOCKS = [(128, 128), (128, 64), (64, 128), (64, 64), (64, 32), (32, 64), (32, 32), (128, 32), (32, 128)]


def requested_bytes(device, kernel, head_dim, dtype, tuning, length=512, heads=4, kv_heads=2):
    """Triton's reported shared memory for one kernel, or None if the compile failed otherwise."""
    small = flash_tiles.Tuning(16, 16, 4, 1)
    tunings = {"fwd": small, "dq": small, "dkv": small, kernel: tuning}
    cfg = flash_attention_module.KernelConfig(causal=True, sliding_window=0, soft_cap=0.0, scale=0.1, kv_len=length,
                     kv_padded=False, interpret=False, **tunings)
    sharding = SingleDeviceSharding(device)

    def arg(shape, dt=dtype):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

    q, kv, seg = arg((1, length, heads, head_dim)), arg((1, length, kv_heads, head_dim)), arg((1, length), jnp.int32)
    rows = arg((1, heads, length), jnp.float32)
    if kernel == "fwd":
        fn, args = (lambda q, k, v, s: flash_attention_module.forward_call(q, k, v, s, s, cfg)), (q, kv, kv, seg)
    else:
        call = flash_attention_module.dq_call if kernel == "dq" else flash_attention_module.dkv_call
        fn, args = (lambda q, k, v, do, lse, d, s: call(q, k, v, do, lse, d, s, s, cfg)), (q, kv, kv, q, rows, rows, seg)
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()
    except Exception as error:  # pylint: disable=broad-except
        match = re.search(r"requested (\d+)", str(error))
        return int(match.group(1)) if match else None
    return 0  # fitted in 1 KiB: cannot happen for these tiles


def main(argv):
    parser = argparse.ArgumentParser(prog="kernel_shared_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100", choices=sorted(targets.GPU_TARGET_FILES))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--head-dims", default="64,128,256", help="comma-separated, e.g. 64,128")
    args = parser.parse_args(argv)
    head_dims = [h.strip() for h in args.head_dims.split(",")]
    if not all(h.isdigit() and int(h) > 0 for h in head_dims):
        parser.error(f"--head-dims {args.head_dims!r} must be positive numbers separated by commas, e.g. 64,128,256")
    missing = targets.compiler_missing("gpu")
    if missing:
        raise targets.TargetError(f"compiling the kernels for --target {args.target} needs the GPU compiler: {missing}")
    # Compiling for a GPU target needs no GPU here; keep JAX from probing for one (without it, JAX with the CUDA
    # plugin and no GPU answers get_topology_desc(platform="cuda") with "topology not implemented for cuda").
    jax.config.update("jax_platforms", "cpu")
    text = re.sub(r"shared_memory_per_block_optin: \d+", "shared_memory_per_block_optin: 1024",
                  targets.gpu_target_config(args.target))
    device = topologies.get_topology_desc(platform="cuda", topology_name=args.target, target_config=text,
                                          topology="1x1x1").devices[0]
    dtype = jnp.dtype(args.dtype)
    print(f"# python scripts/kernel_shared_memory.py {shlex.join(argv)}")
    print("kernel head_dim block_q block_k warps stages requested estimate estimate-requested")
    for kernel, head_dim, (bq, bk), stages, warps in itertools.product(
            ("fwd", "dq", "dkv"), [int(h) for h in head_dims], BLOCKS, (1, 2, 3), (4, 8)):
        tuning = flash_tiles.Tuning(bq, bk, warps, stages)
        got = requested_bytes(device, kernel, head_dim, dtype, tuning)
        estimate = flash_tiles.shared_memory_bytes(kernel, tuning, head_dim, dtype.itemsize)
        print(kernel, head_dim, bq, bk, warps, stages, got, estimate, None if got is None else estimate - got,
              flush=True)


if __name__ == "__main__":
    run_cli("kernel_shared_memory", main)
