"""TPU flash attention: JAX's own Pallas splash-attention kernel behind maxtrain's interface.

`jax.experimental.pallas.ops.tpu.splash_attention` ("sparse flash") computes attention block by
block in VMEM and skips every (query block, key block) pair its mask says is empty: causal
attention visits about half the pairs, a sliding window of W about W / S of them. This module
only adapts shapes and the masking rule of maxtrain.models.attention.make_attention_mask to it:

    maxtrain                              splash
    q [B, T, N, H], k/v [B, S, G, H]      per batch row (vmap): q [N, T, H], k/v [G, S, H]; query head
                                          n reads kv head n // (N // G) (its MHA kernel does GQA itself)
    segment_ids [B, T]                    SegmentIds(q=[T], kv=[S]) per row
    causal                                CausalMask: s <= t
    sliding_window W (causal)             LocalMask, window (W - 1, 0): t - W < s <= t
    scale (default H ** -0.5)             q is multiplied by it first (splash does not scale)
    logits_soft_cap                       attn_logits_soft_cap: cap * tanh(scores / cap)

Splash needs lengths that are multiples of its blocks, and kv blocks that are multiples of 128
(the TPU's lanes): blocks are clamped to the padded length, and T is padded to a block multiple
with segment id -1 (no real token has it, so padding keys are never visible to real queries;
padded queries are sliced off). The kernel is built per call from static shapes (its block masks
are numpy arrays made at trace time, by kernels/splash_tables.py: splash's own pass costs T^2), so
the same code runs inside `shard_map` on each device's shard. `interpret=True` runs it on CPU in Pallas' interpreter (for tests).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from maxtrain.kernels import splash_tables

LANES = 128  # splash's kv compute blocks must be multiples of this
_PAD_SEGMENT = -1


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _mask(length: int, causal: bool, sliding_window: int) -> masks.Mask:
    shape = (length, length)
    if sliding_window > 0:
        return masks.LocalMask(shape, window_size=(sliding_window - 1, 0 if causal else None), offset=0)
    return masks.CausalMask(shape) if causal else masks.FullMask(shape)


def block_sizes(length: int, block_q: int, block_kv: int) -> splash.BlockSizes:
    """Forward and backward blocks: the requested ones, clamped to the length rounded up to 128."""
    top = _round_up(length, LANES)
    bq, bkv = min(block_q, top), min(_round_up(block_kv, LANES), top)
    return splash.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                             block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                             block_q_dq=bq, block_kv_dq=bkv)


@jax.custom_vjp
def _float32_gradient(x):
    """x unchanged; its gradient cast to float32 (splash returns the sinks' gradient in q's dtype)."""
    return x


_float32_gradient.defvjp(lambda x: (x, None), lambda _, g: (g.astype(jnp.float32),))


def splash_attention(q, k, v, segment_ids=None, *, causal=True, sliding_window=0, logits_soft_cap=0.0,
                     scale=None, block_q=512, block_kv=512, interpret=False, sinks=None):
    """Self-attention of q [B, T, N, H] over k [B, T, G, H], v [B, T, G, Hv] (N % G == 0) with TPU splash
    kernels.

    segment_ids [B, T] (int32) or None; masking as maxtrain.models.attention.make_attention_mask.
    sinks [N] (or None): a logit per query head in each softmax's denominator (gpt-oss), which the
    splash kernel implements. Returns [B, T, N, Hv] in q.dtype; differentiable in q, k, v and sinks. A
    value head dim Hv != H (MLA) runs with the narrower side zero-padded to the wider (q.k and the
    output unchanged; scale from H).
    """
    batch, length, num_heads, head_dim = q.shape
    v_head_dim = v.shape[3]
    if k.shape[:3] != v.shape[:3] or k.shape[:2] != (batch, length) or k.shape[3] != head_dim:
        raise ValueError(f"splash attention is self-attention: q {q.shape} needs k of shape "
                         f"[{batch}, {length}, G, {head_dim}] and v [{batch}, {length}, G, Hv], got k {k.shape}, "
                         f"v {v.shape}")
    if num_heads % k.shape[2]:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({k.shape[2]})")
    if block_q % 8 or block_q <= 0 or block_kv <= 0:
        raise ValueError(f"block_q={block_q} must be a positive multiple of 8 and block_kv={block_kv} positive")
    sizes = block_sizes(length, block_q, block_kv)
    padded = _round_up(length, math.lcm(sizes.block_q, sizes.block_kv))
    if segment_ids is None:
        segment_ids = jnp.zeros((batch, length), jnp.int32)
    pad = [(0, 0), (0, padded - length)]
    segment_ids = jnp.pad(segment_ids.astype(jnp.int32), pad, constant_values=_PAD_SEGMENT)
    width = max(head_dim, v_head_dim)  # the kernels take one head dim: pad the narrower side with zeros
    q = jnp.pad(q * jnp.asarray(head_dim**-0.5 if scale is None else scale, q.dtype),
                pad + [(0, 0), (0, width - head_dim)])
    k = jnp.pad(k, pad + [(0, 0), (0, width - head_dim)])
    v = jnp.pad(v, pad + [(0, 0), (0, width - v_head_dim)])

    kernel = splash_tables.make_kernel(_mask(padded, causal, sliding_window), sizes, interpret=interpret,
                                       attn_logits_soft_cap=logits_soft_cap if logits_soft_cap > 0 else None)

    def one_row(q, k, v, seg):  # q [T, N, H] -> splash's head-major [N, T, H]
        out = kernel(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1),
                     segment_ids=splash.SegmentIds(q=seg, kv=seg),
                     sinks=None if sinks is None else _float32_gradient(sinks.astype(jnp.float32)))
        return out.swapaxes(0, 1)

    out = jax.vmap(one_row)(q, k, v, segment_ids)
    return out[:, :length, :, :v_head_dim].astype(q.dtype)
