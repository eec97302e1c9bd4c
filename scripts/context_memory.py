"""Per-device memory of one attention layer's forward and backward under each context-parallel strategy, by
sequence length, compiled (not run): XLA's memory_analysis of the program each device runs, for this machine's
simulated CPU devices or for a compile target's (8 H100s: the kernels inside the strategies). Shows what each
strategy holds per device as T grows (docs/parallelism.md's table).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python scripts/context_memory.py --cp 8 --lengths 32768,131072,524288,1048576
    JAX_PLATFORMS=cpu python scripts/context_memory.py --target h100-8 --heads 32 --kv-heads 8 --head-dim 128 \\
        --dtype bfloat16 --runs ring:flash,ulysses:flash,ulysses:cudnn,all_gather:dot_product

What is compiled (compile/context_costs.py's compiled_attention_memory): value_and_grad of sum(attention(q, k, v)
x w) with respect to q, k, v for one sequence (B = 1) of T tokens in the dual_chunk_swap layout, split over a
context group of --cp devices, causal, --heads query heads and --kv-heads key/value heads of --head-dim, through
models.attention.attention with each run's strategy and kernel (`strategy:kernel`; dot_product is the plain-jnp
form). Only the attention layer, not the whole train step: a whole model's step at 1M tokens compiles for minutes
on 2 cores, and the projections, MLP and norms around attention are O(T / C) under every strategy, so the layer is
where the strategies differ. The inputs are ShapeDtypeStructs (nothing allocated), so 1M tokens compiles on a
laptop. A GPU target needs the CUDA compiler (`pip install -e '.[cuda]'`); runs it cannot compile print the
compiler's one-line reason.

What to read: arguments (q, k, v, w, segment ids: O(T / C) for all) and temporaries. all_gather holds the
gathered [T, G, H] keys and values and its scores against every key, [T / C, N, T]; the plain-jnp ring holds one
block pair's scores [T / C, N, T / C]; the flash ring holds no scores, only the block in hand and the one arriving
(O(T / C)); ulysses holds all T tokens of N / C heads: with a kernel O(T N / C), the plain form's scores
[T, N / C, T].
"""

from __future__ import annotations

import argparse
import shlex
import sys

import jax

from maxtrain.compile import context_costs, targets
from maxtrain.errors import run_cli
from maxtrain.models import attention

GIB = 2 ** 30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="context_memory", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--cp", type=int, default=8, help="devices in the context group")
    parser.add_argument("--lengths", default="32768,131072,524288,1048576", help="comma-separated token counts")
    parser.add_argument("--runs", default="all_gather:dot_product,ring:dot_product,ulysses:dot_product",
                        help="comma-separated strategy:kernel pairs (kernel: dot_product, flash, cudnn, tokamax; usp "
                        "needs a mesh of slices, which this one-axis compile does not build)")
    parser.add_argument("--target", default="", help="a compile target (h100-8, ...; see compile_topology); "
                        "default: this machine's devices")
    parser.add_argument("--heads", type=int, default=8, help="query heads (a multiple of --cp for ulysses)")
    parser.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: --heads)")
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--block", type=int, default=128, help="the kernels' largest tiles (sa_block_q, sa_block_kv)")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    runs = [tuple(run.split(":", 1)) if ":" in run else (run, "dot_product") for run in args.runs.split(",")]
    for strategy, kernel in runs:
        if strategy not in ("all_gather", "ring", "ulysses") or kernel not in attention.IMPLEMENTATIONS[1:]:
            parser.error(f"--runs {strategy}:{kernel}: a strategy of all_gather, ring, ulysses and a "
                         f"kernel of {', '.join(attention.IMPLEMENTATIONS[1:])}")
    target = targets.parse(args.target) if args.target else None
    devices = target.devices() if target else jax.devices()
    platform = target.platform if target else "cpu"
    if len(devices) < args.cp:
        parser.error(f"--cp {args.cp} needs {args.cp} devices, {args.target or 'this process'} has {len(devices)}"
                     + ("" if target else f": set XLA_FLAGS=--xla_force_host_platform_device_count={args.cp}"))
    if any(t % (2 * args.cp) for t in lengths):
        parser.error(f"every length must be a multiple of 2 x --cp = {2 * args.cp} (dual_chunk_swap's chunks)")
    print("$ python scripts/context_memory.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"one attention layer, forward + backward, B 1, heads {args.heads} q / {args.kv_heads or args.heads} kv x "
          f"{args.head_dim}, {args.dtype}, blocks {args.block}, causal, CP {args.cp} on {target.describe() if target else 'this CPU'}, "
          f"jax {jax.__version__}; GiB per device")
    print(f"{'strategy:kernel':<22}{'tokens':>9}{'arguments':>11}{'outputs':>10}{'temporaries':>13}{'compile s':>11}")
    for strategy, kernel in runs:
        for tokens in lengths:
            try:
                m = context_costs.compiled_attention_memory(
                    strategy, args.cp, tokens, args.heads, args.head_dim, devices=devices[:args.cp],
                    kv_heads=args.kv_heads or None, implementation=kernel, platform=platform, dtype=args.dtype,
                    block=args.block)
            except Exception as error:  # pylint: disable=broad-except  # a compiler's refusal is a table row
                reason = str(error).strip().splitlines()[0][:160] if str(error).strip() else type(error).__name__
                print(f"{strategy + ':' + kernel:<22}{tokens:>9}  not compiled: {reason}", flush=True)
                continue
            print(f"{strategy + ':' + kernel:<22}{tokens:>9}{m['arguments'] / GIB:>11.3f}{m['outputs'] / GIB:>10.3f}"
                  f"{m['temporaries'] / GIB:>13.3f}{m['seconds']:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("context_memory", main))
