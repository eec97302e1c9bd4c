"""Step time of one attention layer's forward and backward under each context-parallel strategy, at one fixed
total length, on this machine's simulated CPU devices (docs/parallelism.md's benchmark row).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python scripts/benchmark_context.py --cp 8 --tokens 8192 --steps 5

What runs: jit of value_and_grad of sum(attention(q, k, v) x w) with respect to q, k, v (models/attention/
context_parallel.py's dispatch) for one causal sequence of --tokens in the dual_chunk_swap layout, split over
--cp devices, float32, --heads query and kv heads of --head-dim, random inputs. Per strategy: the compile time,
then the median wall time and process CPU time of --steps steps after one untimed step. Rounds are interleaved
(all strategies, then all again) so that a change of load on a shared machine hits each alike. Simulated
devices share the same cores: the times measure each strategy's work and copies here, not an accelerator's
parallel speed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from maxtrain.compile import context_costs
from maxtrain.errors import run_cli
from maxtrain.models.attention import context_parallel
from maxtrain.parallel import sharding


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="benchmark_context", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--cp", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8, help="query and kv heads (a multiple of --cp for ulysses)")
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if len(jax.devices()) < args.cp:
        parser.error(f"--cp {args.cp} needs {args.cp} devices: set XLA_FLAGS=--xla_force_host_platform_device_count="
                     f"{args.cp}")
    print("$ python scripts/benchmark_context.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    mesh = sharding.mesh_of(jax.devices()[:args.cp], context=args.cp)
    split = NamedSharding(mesh, PartitionSpec(None, "context"))
    rng = np.random.default_rng(0)
    q, k, v, w = (jax.device_put(rng.standard_normal((1, args.tokens, args.heads, args.head_dim), np.float32), split)
                  for _ in range(4))
    segment_ids = jax.device_put(np.ones((1, args.tokens), np.int32), split)
    steps, times, cpu = {}, {}, {}
    for strategy in context_costs.STRATEGIES:
        def loss(q, k, v, w, segment_ids, strategy=strategy):
            return jnp.sum(context_parallel.attention(q, k, v, segment_ids, strategy=strategy) * w)
        start = time.perf_counter()
        with sharding.activation_sharding(mesh, context_costs.RULES):
            steps[strategy] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
                q, k, v, w, segment_ids).compile()
        jax.block_until_ready(steps[strategy](q, k, v, w, segment_ids))
        print(f"compiled {strategy} in {time.perf_counter() - start:.1f} s (and one untimed step)", flush=True)
        times[strategy], cpu[strategy] = [], []
    for _ in range(args.rounds):
        for strategy, step in steps.items():
            for _ in range(args.steps):
                wall, process = time.perf_counter(), time.process_time()
                jax.block_until_ready(step(q, k, v, w, segment_ids))
                times[strategy].append(time.perf_counter() - wall)
                cpu[strategy].append(time.process_time() - process)
    print(f"one attention layer fwd+bwd, 1 x {args.tokens} tokens, {args.heads} heads of {args.head_dim}, float32, "
          f"CP {args.cp}, jax {jax.__version__}, load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"{'strategy':<11}{'step s (median)':>16}{'CPU s/step':>12}")
    for strategy in steps:
        print(f"{strategy:<11}{statistics.median(times[strategy]):>16.3f}{statistics.median(cpu[strategy]):>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("benchmark_context", main))
