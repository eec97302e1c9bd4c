"""Per-device memory of one attention layer's forward and backward under each context-parallel strategy, by
sequence length, compiled (not run) for this machine's simulated CPU devices: XLA's memory_analysis of the
program each device runs. Shows what each strategy holds per device as T grows (docs/parallelism.md's table).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python scripts/context_memory.py --cp 8 --lengths 32768,131072,524288,1048576

What is compiled (compile/context_costs.py's compiled_attention_memory): value_and_grad of sum(attention(q, k, v) x w) with respect to q, k, v for one sequence
(B = 1) of T tokens in the dual_chunk_swap layout, split over a context group of --cp devices
(models/attention/context_parallel.py's dispatch: all_gather, ring, ulysses), causal, float32, --heads query
and key/value heads of --head-dim. Only the attention layer, not the whole train step: a whole model's step
at 1M tokens compiles for minutes on 2 cores, and the projections, MLP and norms around attention are O(T / C)
under every strategy, so the layer is where the strategies differ. The inputs are ShapeDtypeStructs
(nothing allocated), so 1M tokens compiles on a laptop.

What to read: arguments (q, k, v, w, segment ids: O(T / C) for all) and temporaries. all_gather holds the
gathered [T, G, H] keys and values and its scores against every key, [T / C, N, T]; ring holds one block pair's
scores [T / C, N, T / C] (blocks computed in full by plain jnp: no flash kernel inside the ring yet, so a
block's scores are (T / C)^2, not O(T / C)); ulysses holds all T tokens of N / C heads, scores [T, N / C, T].
"""

from __future__ import annotations

import argparse
import shlex
import sys

import jax

from maxtrain.compile import context_costs
from maxtrain.errors import run_cli
from maxtrain.models.attention import context_parallel

GIB = 2 ** 30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="context_memory", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--cp", type=int, default=8, help="devices in the context group")
    parser.add_argument("--lengths", default="32768,131072,524288,1048576", help="comma-separated token counts")
    parser.add_argument("--strategies", default=",".join(context_parallel.STRATEGIES))
    parser.add_argument("--heads", type=int, default=8, help="query and key/value heads (a multiple of --cp for "
                        "ulysses)")
    parser.add_argument("--head-dim", type=int, default=16)
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    strategies = args.strategies.split(",")
    if any(s not in context_parallel.STRATEGIES for s in strategies):
        parser.error(f"--strategies {args.strategies!r}: each one of {', '.join(context_parallel.STRATEGIES)}")
    if len(jax.devices()) < args.cp:
        parser.error(f"--cp {args.cp} needs {args.cp} devices, this process has {len(jax.devices())}: set "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={args.cp}")
    if any(t % (2 * args.cp) for t in lengths):
        parser.error(f"every length must be a multiple of 2 x --cp = {2 * args.cp} (dual_chunk_swap's chunks)")
    print("$ python scripts/context_memory.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"one attention layer, forward + backward, B 1, heads {args.heads} (q and kv) x {args.head_dim}, float32, "
          f"causal, CP {args.cp}, jax {jax.__version__}; GiB per device")
    print(f"{'strategy':<11}{'tokens':>9}{'arguments':>11}{'outputs':>10}{'temporaries':>13}{'compile s':>11}")
    for strategy in strategies:
        for tokens in lengths:
            m = context_costs.compiled_attention_memory(strategy, args.cp, tokens, args.heads, args.head_dim)
            print(f"{strategy:<11}{tokens:>9}{m['arguments'] / GIB:>11.3f}{m['outputs'] / GIB:>10.3f}"
                  f"{m['temporaries'] / GIB:>13.3f}{m['seconds']:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("context_memory", main))
