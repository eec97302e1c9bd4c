"""The lightning indexer's scores (DeepSeek-V3.2, GLM-5) in one Pallas kernel: Triton on NVIDIA GPUs, interpret mode on
CPU; forward only (the scores choose keys and take no gradient).

What: for queries q [B, T, I, E] (I heads of width E), head weights w [B, T, I] and keys k [B, S, E],

    scores[b, t, s] = sum_i w[b, t, i] * relu(q[b, t, i] . k[b, s] / sqrt(E))                  [B, T, S] float32

the same numbers as models/families/deepseek/indexer.combine (its reference), which materialises the per-head scores
[B, T, I, S] in HBM before the weighted sum over heads: at DeepSeek-V3.2's I = 64 heads that is 64x the bytes of the
result, and on an H200 (2026-12-01, docs/gpu.md "Sparse attention on a GPU") choosing the keys at 64k tokens took
863 ms, more than the selected-key attention's forward and backward together (670 ms), and 3.4x dense cuDNN
attention's whole forward and backward. Here the per-head scores live only in registers: one program per (batch,
block of `block_q` queries, block of `block_k` keys) loops over the I heads, each a [block_q, E] x [E, block_k]
matmul, its ReLU, times the head's weight, summed into the [block_q, block_k] tile it writes once.

Why ours: the indexer's weighted sum of ReLU'd per-head scores is no library's kernel (cuDNN, tokamax, splash attend;
DeepSeek's own FP8 indexer kernel is CUDA for inference).

Callers keep the causal and document masks and the top_k (selected.py): a query block's run of keys is what it is
handed. Operands in float32 as the indexer's reference computes them (transformers does too); the dots run at the
backend's default precision for float32 (TF32 tensor cores on NVIDIA GPUs, as XLA's own einsum there).
Not yet: a TPU (Mosaic) variant, and the top_k fused in (each tile's block top-k merged across key blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_BLOCK = 16  # Triton's dots: every tile side >= 16


def _kernel(q_ref, w_ref, k_ref, out_ref, *, scale: float):
    """Grid (B, T / bq, S / bk). q [bq, I, E], w [bq, I], k [bk, E] -> out [bq, bk]."""
    k = k_ref[...]
    heads = q_ref.shape[1]

    def body(i, acc):
        q = q_ref[:, i, :]  # [bq, E]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        return acc + jnp.maximum(s, 0.0) * w_ref[:, i][:, None]

    out_ref[...] = lax.fori_loop(0, heads, body, jnp.zeros(out_ref.shape, jnp.float32))


def _pad(x, axis: int, size: int):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def index_scores(q, w, k, *, block_q: int = 64, block_k: int = 64, interpret: bool | None = None,
                 num_warps: int = 4, num_stages: int = 2):
    """scores [B, T, S] float32 = sum_i w[.., i] relu(q[.., i, :] . k / sqrt(E)); q [B, T, I, E], w [B, T, I],
    k [B, S, E]. T and S are padded up to the blocks (and E to a power of two, at least 16 on GPUs) with zeros, which
    add nothing; the padding is cut off the result. interpret: None runs interpret mode off GPUs."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, t, heads, e = q.shape
    s = k.shape[1]
    least = 1 if interpret else MIN_BLOCK
    bq = min(block_q, max(least, pl.next_power_of_2(t)))
    bk = min(block_k, max(least, pl.next_power_of_2(s)))
    e_pad = max(least, pl.next_power_of_2(e))
    t_pad, s_pad = -(-t // bq) * bq, -(-s // bk) * bk
    q = _pad(_pad(q.astype(jnp.float32), 1, t_pad), 3, e_pad)
    w = _pad(w.astype(jnp.float32), 1, t_pad)
    k = _pad(_pad(k.astype(jnp.float32), 1, s_pad), 2, e_pad)
    out = pl.pallas_call(
        functools.partial(_kernel, scale=e ** -0.5), grid=(b, t_pad // bq, s_pad // bk),
        in_specs=[pl.BlockSpec((None, bq, heads, e_pad), lambda b, i, j: (b, i, 0, 0)),
                  pl.BlockSpec((None, bq, heads), lambda b, i, j: (b, i, 0)),
                  pl.BlockSpec((None, bk, e_pad), lambda b, i, j: (b, j, 0))],
        out_specs=pl.BlockSpec((None, bq, bk), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((b, t_pad, s_pad), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages), interpret=interpret,
        name="index_scores",
    )(q, w, k)
    return out[:, :t, :s]
