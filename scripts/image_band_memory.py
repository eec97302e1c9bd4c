"""Compiled memory of one Gemma 4 sliding layer's attention with bidirectional_image_attention, plain (the whole
[T, T] mask) against banded (models/attention/image_band.py), forward + backward, compiled by XLA's CPU compiler on
this machine (nothing runs). Prints per length and form the compiled arguments, outputs and temporaries
(memory_analysis). The defaults are gemma4-default's sliding layers: 8 query heads,
4 kv heads of 256, window 512, bfloat16; the span image_attention_span's default.

    python scripts/image_band_memory.py [--lengths 8192] [--span 1120] [--block 512] [--window 512]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from maxtrain.errors import run_cli
from maxtrain.models import attention
from maxtrain.models.attention import image_band


def main(argv=None):
    parser = argparse.ArgumentParser(prog="image_band_memory", description=__doc__.split("\n\n", maxsplit=1)[0])
    parser.add_argument("--lengths", default="8192", help="comma-separated token counts, e.g. 8192,32768")
    parser.add_argument("--span", type=int, default=1120, help="image_attention_span")
    parser.add_argument("--block", type=int, default=512, help="queries per step of the banded form")
    parser.add_argument("--window", type=int, default=512, help="sliding_window_size")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=256)
    args = parser.parse_args(argv)
    lengths = [n.strip() for n in args.lengths.split(",")]
    if not all(n.isdigit() and int(n) > 0 for n in lengths):
        parser.error(f"--lengths {args.lengths!r} must be positive numbers separated by commas, e.g. 8192,32768")
    for name in ("span", "block", "window", "heads", "kv_heads", "head_dim"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    if args.heads % args.kv_heads:
        parser.error(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    jax.config.update("jax_platforms", "cpu")

    def plain(q, k, v, seg, blocks):
        mask = attention.make_attention_mask(seg, seg, sliding_window=args.window, q_blocks=blocks, kv_blocks=blocks)
        return attention.dot_product_attention(q, k, v, mask, scale=1.0)

    def banded(q, k, v, seg, blocks):
        return image_band.image_band_attention(q, k, v, seg, blocks, sliding_window=args.window, span=args.span,
                                               block=args.block, scale=1.0)

    for length in map(int, lengths):
        q = jax.ShapeDtypeStruct((1, length, args.heads, args.head_dim), jnp.bfloat16)
        kv = jax.ShapeDtypeStruct((1, length, args.kv_heads, args.head_dim), jnp.bfloat16)
        ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
        for name, form in (("plain", plain), ("banded", banded)):
            def step(q, k, v, seg, blocks, form=form):
                loss = lambda *xs: jnp.sum(form(*xs, seg, blocks).astype(jnp.float32))  # noqa: E731
                return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

            start = time.time()
            compiled = jax.jit(step).lower(q, kv, kv, ids, ids).compile()
            m = compiled.memory_analysis()
            print(f"T={length} {name} forward+backward: arguments {m.argument_size_in_bytes / 2**20:.1f} MiB, outputs "
                  f"{m.output_size_in_bytes / 2**20:.1f} MiB, temporaries {m.temp_size_in_bytes / 2**20:.1f} MiB "
                  f"(compiled in {time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    run_cli("image_band_memory", main)
