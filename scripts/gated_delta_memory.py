"""Memory of the gated delta rule's Pallas kernel (kernels/gated_delta.py) by sequence length, compiled for one
GPU target on this machine (no GPU needed; needs the [cuda] extra): the forward alone and forward + backward
(the custom VJP recomputes through the jnp chunked form). Prints per length the compiled arguments, outputs and
temporaries (XLA's memory_analysis), so that growth in T can be read off (O(T): no [T, T] array).

    python scripts/gated_delta_memory.py [--target h100] [--lengths 8192,32768] [--heads 16] [--head-dim 128]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain.compile import targets
from maxtrain.errors import run_cli
from maxtrain.kernels import gated_delta as gated_delta_kernel
from maxtrain.models.recurrent import gated_delta
from maxtrain.parallel import sharding


def main(argv=None):
    parser = argparse.ArgumentParser(prog="gated_delta_memory", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--target", default="h100", choices=sorted(targets.GPU_TARGET_FILES))
    parser.add_argument("--lengths", default="8192,32768", help="comma-separated token counts, e.g. 4096,16384")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128, help="key and value head width")
    parser.add_argument("--chunk", type=int, default=64, help="gdn_chunk_size")
    args = parser.parse_args(argv)
    lengths = [n.strip() for n in args.lengths.split(",")]
    if not all(n.isdigit() and int(n) > 0 for n in lengths):
        parser.error(f"--lengths {args.lengths!r} must be positive numbers separated by commas, e.g. 8192,32768")
    try:
        gated_delta_kernel.check_chunk_size(args.chunk)
    except ValueError as e:
        parser.error(f"--chunk: {e}")
    missing = targets.compiler_missing("gpu")
    if missing:
        raise targets.TargetError(f"compiling the kernel for --target {args.target} needs the GPU compiler: {missing}")
    jax.config.update("jax_platforms", "cpu")  # as scripts/kernel_shared_memory.py: no GPU probing here
    mesh = sharding.mesh_of(targets.parse(f"{args.target}-1").devices(), data=1)
    rule = gated_delta_kernel.make(gated_delta.chunked, chunk_size=args.chunk, platform="gpu")

    def arg(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, PartitionSpec()))

    def forward(q, k, v, a, b, seg):
        return rule(q, k, v, a, b, seg, None)[0]

    def step(q, k, v, a, b, seg):
        loss = lambda *xs: jnp.sum(rule(*xs, seg, None)[0].astype(jnp.float32))
        return jax.value_and_grad(loss, argnums=range(5))(q, k, v, a, b)

    for length in map(int, lengths):
        x = arg((1, length, args.heads, args.head_dim))
        gate, seg = arg((1, length, args.heads), jnp.float32), arg((1, length), jnp.int32)
        for name, fn in (("forward", forward), ("forward+backward", step)):
            start = time.time()
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                compiled = jax.jit(fn).trace(x, x, x, gate, gate, seg).lower(lowering_platforms=("cuda",)).compile()
            m = compiled.memory_analysis()
            print(f"T={length} {name}: arguments {m.argument_size_in_bytes / 2**20:.1f} MiB, outputs "
                  f"{m.output_size_in_bytes / 2**20:.1f} MiB, temporaries {m.temp_size_in_bytes / 2**20:.1f} MiB "
                  f"(compiled in {time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    run_cli("gated_delta_memory", main)
