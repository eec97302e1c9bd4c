"""Times causal attention forward + backward for the flash (Pallas), cudnn and dot_product kernels.

Setup: bfloat16 (--dtype), causal, no segment ids, q [B, T, N, H] and k, v [B, T, G, H]; defaults are
N=32 query heads, G=8 kv heads (GQA 4:1), H=128, and batch B = max(1, tokens // T) so every row
of the table processes about `--tokens` (default 16384) tokens.

Each measurement jits q, k, v, dO -> (dq, dk, dv) (the vjp, which includes the forward), runs it
`--warmup` times, then reports the median wall time of `--iters` runs (block_until_ready).

TFLOP/s counts matmul FLOPs only: forward 4*B*T*S*N*H / 2 (q@k^T and p@v, each 2*T*S*H per head,
halved because causal attention needs half the (t, s) pairs), and forward + backward
2.5 x forward (the backward does 5 matmuls of the same size to the forward's 2). This is the
useful work; a kernel that recomputes (flash recomputes q@k^T) is not credited for it.

cudnn (jax.nn.dot_product_attention(implementation="cudnn")) runs only on GPU. On CPU use
--interpret with tiny sizes to check that the script works, e.g.
    python scripts/benchmark_attention.py --seq 128 --heads 4 --kv-heads 2 --head-dim 32 --interpret

dot_product is the one masked [B, G, R, T, S] product that GPU and TPU compute; dot_product_cpu is
what the trainer computes on CPU (heads-major, causal query chunks: attention.causal_chunks). The
reference model's attention on this repository's CPU (docs/performance.md, "A sixth round"):
    python scripts/benchmark_attention.py --impl dot_product dot_product_cpu --dtype float32 \
        --seq 256 --tokens 1024 --heads 4 --kv-heads 4 --head-dim 64 --iters 40
"""

from __future__ import annotations

import argparse
import shlex

import jax
import jax.numpy as jnp

from maxtrain.errors import run_cli
from maxtrain.models import attention
from maxtrain.models.attention import kernel_check
from maxtrain.models.attention.kernel_check import attention_flops
from maxtrain.observability import metrics


def make_attention_fn(impl, args):
    """(q, k, v) -> out for one implementation, causal, no segment ids (kernel_check.implementation, and
    dot_product_cpu: the trainer's CPU formulation)."""
    if impl == "dot_product_cpu":
        def on_cpu(q, k, v):
            ones = jnp.ones(q.shape[:2], jnp.int32)
            return attention.attention(q, k, v, ones, implementation="dot_product", platform="cpu")
        return on_cpu
    platform = "cpu" if args.interpret else jax.default_backend()
    fn = kernel_check.implementation(impl, causal=True, platform=platform, block_q=args.block_q,
                                        block_k=args.block_k, interpret=args.interpret)
    return lambda q, k, v: fn(q, k, v, None)


def time_fwd_bwd(attention_fn, q, k, v, do, warmup, iters):
    """Median seconds of one jitted forward + backward."""
    program = kernel_check.fwd_bwd(lambda q, k, v, _: attention_fn(q, k, v))
    return metrics.median_seconds(program, q, k, v, None, do, warmup=warmup, iters=iters)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="benchmark_attention", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                        help="sequence lengths T = S")
    parser.add_argument("--tokens", type=int, default=16384,
                        help="tokens per batch; batch = max(1, tokens // seq)")
    parser.add_argument("--heads", type=int, default=32, help="query heads N")
    parser.add_argument("--kv-heads", type=int, default=8, help="kv heads G")
    parser.add_argument("--head-dim", type=int, default=128, help="head dim H")
    parser.add_argument("--impl", nargs="+", default=["flash", "cudnn", "dot_product"],
                        choices=["flash", "cudnn", "dot_product", "dot_product_cpu"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--interpret", action="store_true",
                        help="run the Pallas kernel in interpret mode (needed on CPU)")
    args = parser.parse_args(argv)
    sizes = {"--seq": min(args.seq), "--tokens": args.tokens, "--heads": args.heads, "--kv-heads": args.kv_heads,
             "--head-dim": args.head_dim, "--block-q": args.block_q, "--block-k": args.block_k, "--iters": args.iters}
    for flag, value in sizes.items():
        if value < 1:
            parser.error(f"{flag} {value} must be >= 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be >= 0")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads} (grouped-query attention)")
    return args


def main(argv: list[str]):
    args = parse_args(argv)
    backend = jax.default_backend()
    impls = [i for i in args.impl if i != "cudnn" or backend == "gpu"]
    print(f"command: {shlex.join(['python', 'scripts/benchmark_attention.py', *argv])}")
    print(f"device: {jax.devices()[0].device_kind} ({backend}); {args.dtype}, causal, "
          f"N={args.heads} G={args.kv_heads} H={args.head_dim}, fwd+bwd, median of {args.iters} "
          f"after {args.warmup} warm-up; flash blocks {args.block_q}/{args.block_k}"
          f"{' (interpret)' if args.interpret else ''}")
    if len(impls) < len(args.impl):
        print("cudnn skipped: needs a GPU")
    print("TFLOP/s = 2.5 * 4*B*T*S*N*H/2 / time")
    header = f"{'impl':<16} {'seq':>6} {'batch':>5} {'ms':>10} {'TFLOP/s':>8}"
    print(header)
    print("-" * len(header))
    for seq in args.seq:
        batch = max(1, args.tokens // seq)
        keys = jax.random.split(jax.random.key(0), 4)
        dtype = jnp.dtype(args.dtype)
        q = jax.random.normal(keys[0], (batch, seq, args.heads, args.head_dim), dtype)
        k = jax.random.normal(keys[1], (batch, seq, args.kv_heads, args.head_dim), dtype)
        v = jax.random.normal(keys[2], (batch, seq, args.kv_heads, args.head_dim), dtype)
        do = jax.random.normal(keys[3], q.shape, dtype)
        flops = attention_flops(batch, seq, seq, args.heads, args.head_dim)
        for impl in impls:
            try:
                seconds = time_fwd_bwd(make_attention_fn(impl, args), q, k, v, do, args.warmup,
                                       args.iters)
                result = f"{seconds * 1e3:>10.3f} {flops / seconds / 1e12:>8.3g}"
            except Exception as e:  # pylint: disable=broad-except  # e.g. out of memory
                result = f"  failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            print(f"{impl:<16} {seq:>6} {batch:>5} {result}", flush=True)


if __name__ == "__main__":
    run_cli("benchmark_attention", main)
