"""Ring attention with the flash kernel (and with cuDNN per block pair) on one GPU: a ring of one against plain
attention, and its speed beside flash alone and cuDNN (issue 60's GPU row; docs/parallelism.md "On a GPU").

    python3 scripts/gpu_ring_check.py --out $OUT                 # on the GPU: 32k tokens
    python scripts/gpu_ring_check.py --out /tmp/ring --dry-run   # here: tiny shapes, the kernel in interpret mode

What runs:
- check: bf16, causal, GQA 4:1 (8 query heads, 2 kv heads), head_dim 128, one row of --tokens holding three packed
  documents. ring_flash.ring_flash_attention (the custom VJP, the kernel's (out, lse) calls and the online-softmax
  merge; the backward from the global out and lse) on a one-device context mesh, the same ring with cuDNN's forward
  per block (ring_cudnn.py: its float32 statistics merged, the Triton backward; jnp's stand-in in a dry run), the
  same with cuDNN's own backward per block given the ring's global out and lse (ring_cudnn.cudnn_block_grad, jax's
  private primitive; a jax whose form ring_cudnn.py does not bind fails the row, saying why), flash
  alone, flash masking causally by positions given as operands (all_gather's and usp's form under context
  parallelism) and cuDNN: out, dq, dk, dv against a float32 reference at full matmul precision computed in query
  chunks (relative Frobenius error, kernel_check.relative_errors; tolerance kernel_check.TOLERANCE["bfloat16"]).
- speed: forward+backward of these and of flash masked by position with every tile run (as before 2026-11-30's
  tile skipping) at --tokens, causal, bf16, 32 query heads and 8 kv heads of 128, no
  segment ids: the median of --iters after 2 warm-ups, and TFLOP/s of the useful matmul work
  (kernel_check.attention_flops).

A ring of one is the ring's own code with no block passed: on one device the ring runs only its own block. What
the GPU adds beyond the CPU tests (8 simulated devices, interpret mode) is the Triton kernels' lse and backward
inside the ring's custom VJP, compiled, at a long length. Prints one line per item and writes ring.json to --out;
exit 1 if a check fails.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.compile import context_costs
from maxtrain.config import chips
from maxtrain.errors import run_cli
from maxtrain.kernels import flash_attention, flash_tiles
from maxtrain.kernels.flash_tiles import DEFAULT_SHARED_MEMORY
from maxtrain.models.attention import kernel_check, ring_cudnn, ring_flash
from maxtrain.observability import metrics
from maxtrain.parallel import sharding


def packed_ids(length: int, seed: int = 0) -> np.ndarray:
    """[1, length]: three documents of random lengths, no padding."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(length // 8, length - length // 8), size=2, replace=False))
    ids = np.ones((1, length), np.int32)
    ids[0, cuts[0]:] = 2
    ids[0, cuts[1]:] = 3
    return ids


def reference(q, k, v, seg, chunk: int):
    """Causal attention in float32 at full matmul precision, queries in chunks of `chunk` (each chunk's scores
    recomputed in the backward pass), so that the [T, T] scores never exist whole."""
    b, t, n, h = q.shape
    g = k.shape[2]
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    q5 = q.reshape(b, t // chunk, chunk, g, n // g, h)
    positions = jnp.arange(t)

    @jax.checkpoint
    def one(args):
        qc, seg_q, pos_q = args
        with jax.default_matmul_precision("highest"):
            scores = jnp.einsum("BTGRH,BSGH->BGRTS", qc, k) * h**-0.5
            mask = (seg_q[:, :, None] == seg[:, None, :]) & (pos_q[:, None] >= positions[None, :])[None]
            scores = jnp.where(mask[:, None, None], scores, -1e30)
            return jnp.einsum("BGRTS,BSGH->BTGRH", jax.nn.softmax(scores, axis=-1), v)

    pieces = (q5.transpose(1, 0, 2, 3, 4, 5), seg.reshape(b, t // chunk, chunk).transpose(1, 0, 2),
              positions.reshape(t // chunk, chunk))
    out = jax.lax.map(one, pieces)  # [C, B, chunk, G, R, H]
    return out.transpose(1, 0, 2, 3, 4, 5).reshape(b, t, n, h)


def ring_of_one(mesh, platform: str, interpret: bool):
    """(q, k, v, seg) -> out: ring_flash_attention on the one-device context mesh `mesh`."""
    def ring(q, k, v, seg):
        with sharding.activation_sharding(mesh, context_costs.RULES):
            return ring_flash.ring_flash_attention(
                q, k, v, seg, reorder="dual_chunk_swap", causal=True,
                **ring_flash.kernel_settings(platform, 128, 128, interpret))
    return ring


def cudnn_ring_of_one(mesh, platform: str, interpret: bool, cudnn_backward: bool = False):
    """(q, k, v, seg) -> out: ring_cudnn_attention (cuDNN's forward with its float32 statistics; the Triton backward
    from the ring's out and lse, or with cudnn_backward cuDNN's own given them) on the one-device context mesh
    `mesh`; in a dry run cuDNN's contracts in plain jnp (ring_cudnn.reference_block, reference_block_grad), since
    cuDNN does not run on a CPU."""
    block = ring_cudnn.reference_block if interpret else ring_cudnn.cudnn_block
    block_grad = None  # the Triton backward
    if cudnn_backward:
        block_grad = ring_cudnn.reference_block_grad if interpret else ring_cudnn.cudnn_block_grad

    def ring(q, k, v, seg):
        with sharding.activation_sharding(mesh, context_costs.RULES):
            return ring_cudnn.ring_cudnn_attention(
                q, k, v, seg, reorder="dual_chunk_swap", causal=True, block=block, block_grad=block_grad,
                **ring_flash.kernel_settings(platform, 128, 128, interpret))
    return ring


def by_position(platform: str, interpret: bool):
    """(q, k, v, seg) -> out: the flash kernel masking causally by the tokens' positions given as operands (here
    their indices), as all_gather and usp's ring run it under context parallelism."""
    shared_memory = chips.gpu_shared_memory(jax.devices()) if platform == "gpu" else DEFAULT_SHARED_MEMORY

    def flash(q, k, v, seg):
        positions = jnp.broadcast_to(jnp.arange(q.shape[1], dtype=jnp.int32)[None], seg.shape)
        return flash_attention.flash_attention(q, k, v, seg, seg, causal=True, q_positions=positions,
                                               kv_positions=positions, shared_memory=shared_memory,
                                               interpret=interpret)
    return flash


@contextlib.contextmanager
def every_tile():
    """Within: the flash kernels traced run every tile (2026-11-30's tile skipping by position,
    flash_tiles.block_seen, turned off), as before it. Covers the forward and backward kernels' tracing."""
    saved = flash_tiles.block_seen
    flash_tiles.block_seen = lambda cfg, q_tokens, kv_tokens: None
    try:
        yield
    finally:
        flash_tiles.block_seen = saved


def timed(program, args, iters: int) -> tuple[float, float]:
    """(compile + first run s, median ms of `iters` runs after one more warm-up: metrics.median_seconds)."""
    start = time.perf_counter()
    jax.block_until_ready(program(*args))
    first = time.perf_counter() - start
    return first, 1e3 * metrics.median_seconds(program, *args, warmup=1, iters=iters)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_ring_check", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--out", required=True, help="folder for ring.json")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--dry-run", action="store_true", help="this CPU: 256 tokens, small heads, interpret mode")
    args = parser.parse_args(argv)
    print("$ python3 scripts/gpu_ring_check.py " + shlex.join(sys.argv[1:] if argv is None else argv), flush=True)
    platform = "cpu" if args.dry_run else jax.default_backend()
    if platform != "gpu" and not args.dry_run:
        parser.error(f"needs a GPU (JAX's backend is {platform}); on a CPU pass --dry-run")
    interpret = args.dry_run
    tokens = 256 if args.dry_run else args.tokens
    check_heads, speed_heads, head_dim = ((4, 2), (4, 1), 32) if args.dry_run else ((8, 2), (32, 8), 128)
    chunk = min(tokens, 2048)
    if tokens % 256 or tokens % chunk:
        parser.error(f"--tokens {tokens}: a multiple of 256 and of {chunk}")
    mesh = sharding.mesh_of(jax.devices()[:1], context=1)
    impls = {"ring of one (flash)": ring_of_one(mesh, platform, interpret),
             "ring of one (cudnn forward, flash backward)": cudnn_ring_of_one(mesh, platform, interpret),
             "ring of one (cudnn forward and backward)": cudnn_ring_of_one(mesh, platform, interpret, True),
             "flash": kernel_check.implementation("flash", causal=True, platform=platform, interpret=interpret),
             "flash masked by position": by_position(platform, interpret),
             "cudnn": kernel_check.implementation("cudnn", causal=True, platform=platform)}
    if args.dry_run:
        del impls["cudnn"]
    os.makedirs(args.out, exist_ok=True)
    report = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "tokens": tokens, "check": {},
              "speed": {}}
    ok = True

    keys = jax.random.split(jax.random.key(0), 4)
    n, g = check_heads
    shape_q, shape_kv = (1, tokens, n, head_dim), (1, tokens, g, head_dim)
    q, d_out = (jax.random.normal(key, shape_q, jnp.bfloat16) for key in keys[::3])
    k, v = (jax.random.normal(key, shape_kv, jnp.bfloat16) for key in keys[1:3])
    seg = jnp.asarray(packed_ids(tokens))
    start = time.perf_counter()
    expected = jax.block_until_ready(kernel_check.fwd_bwd(lambda q, k, v, seg: reference(q, k, v, seg, chunk))(
        q, k, v, seg, d_out))
    print(f"check: the float32 reference at {tokens} tokens, {n}/{g} heads of {head_dim}, 3 documents: "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    for name, fn in impls.items():
        start = time.perf_counter()
        try:
            errors = kernel_check.relative_errors(kernel_check.fwd_bwd(fn)(q, k, v, seg, d_out), expected)
        except Exception as error:  # pylint: disable=broad-exception-caught  # a row with its error, the rest go on
            report["check"][name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            print(f"check: {name}: FAIL ({report['check'][name]['error']})", flush=True)
            ok = False
            continue
        verdict = kernel_check.passes(errors, "bfloat16")
        ok &= verdict
        report["check"][name] = {**errors, "pass": verdict, "s": round(time.perf_counter() - start, 2)}
        print(f"check: {name}: " + ", ".join(f"{key} {value:.2e}" for key, value in errors.items())
              + f" (tolerance {kernel_check.TOLERANCE['bfloat16']}): {'PASS' if verdict else 'FAIL'}", flush=True)
    del expected

    n, g = speed_heads
    q, d_out = (jax.random.normal(key, (1, tokens, n, head_dim), jnp.bfloat16) for key in keys[::3])
    k, v = (jax.random.normal(key, (1, tokens, g, head_dim), jnp.bfloat16) for key in keys[1:3])
    ones = jnp.ones((1, tokens), jnp.int32)
    flops = kernel_check.attention_flops(1, tokens, tokens, n, head_dim)
    impls["flash masked by position, every tile"] = by_position(platform, interpret)
    for name, fn in impls.items():
        try:
            with every_tile() if name.endswith("every tile") else contextlib.nullcontext():  # the first call traces
                first, ms = timed(kernel_check.fwd_bwd(fn), (q, k, v, ones, d_out), args.iters)
        except Exception as error:  # pylint: disable=broad-exception-caught
            report["speed"][name] = {"error": f"{type(error).__name__}: {error}"[:500]}
            print(f"speed: {name}: {report['speed'][name]['error']}", flush=True)
            continue
        report["speed"][name] = {"ms": round(ms, 3), "tflops": round(flops / ms / 1e9, 1),
                                 "compile_and_first_s": round(first, 1)}
        print(f"speed: {name}: fwd+bwd {ms:.3f} ms, {flops / ms / 1e9:.1f} TFLOP/s ({tokens} tokens, causal, bf16, "
              f"{n}/{g} heads of {head_dim}; compile and first run {first:.1f} s)", flush=True)
    with open(os.path.join(args.out, "ring.json"), "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    print(f"ring check: {'every check passed' if ok else 'a check FAILED'} on {report['device']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(run_cli("gpu_ring_check", main))
