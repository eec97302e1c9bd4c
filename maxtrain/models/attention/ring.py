"""Ring attention: context parallelism (context_parallel_strategy=ring) without gathering the keys and values.

The sequence is split over the context mesh axes in a load-balanced layout (parallel/context.py): each of the C
devices of a context group holds T / C queries, keys, values and segment ids, and `order` [T] says which
original token sits at each position. Inside shard_map over those axes every device keeps its queries and passes
its key/value block, with the block's segment ids and original token indices, to the next device of the ring
(`jax.lax.ppermute`, device c to c + 1 mod C). After C - 1 passes it has seen every block once. Each block's
attention is merged into the running output with the online softmax (float32): per query and head the running
max m, the running sum l of exp(score - m) and the running output sum acc of exp(score - m) x v,

    m' = max(m, max_s score_s),   l' = l exp(m - m') + sum_s exp(score_s - m'),
    acc' = acc exp(m - m') + sum_s exp(score_s - m') v_s,   out = acc / l   (after the last block)

and an attention sink (gpt-oss) is one more column of the softmax, joined once at the end. The mask of each
(query block, key block) pair compares the tokens' original indices and segment ids (same segment; causal
s <= t; sliding window t - s < W), so packed documents, causality and windows are those of attention over the
unsplit sequence, whichever reorder strategy made the layout. Per device there are only T / C keys and values
at a time in the forward pass: no [T, ...] buffer.

Not yet here (issue 60): the gradient is JAX's autodiff of the scan over the ring, which keeps each step's
key/value block for the backward pass (C blocks of T / C, so T keys and values per device during the backward);
a custom VJP that passes the blocks around the ring again in the backward pass brings that to T / C. Every
block is computed in full, masked entries included (no skipping of blocks the causal mask hides), the
ppermute is not overlapped with the block's attention by hand (XLA may schedule it so), and the blocks run in
the plain-jnp form, not the flash, cuDNN or splash kernels.

Letters as in attention/__init__.py: B batch, T queries of this device, S keys of the block in hand, N query
heads = G kv heads x R, H head dim (Hv the value's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.attention import soft_cap
from maxtrain.parallel import context, sharding

# Finite "minus infinity" (as attention/__init__.py's): exp() of a difference to it is exactly 0, never NaN.
_NO_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)


def block_mask(q_segment_ids, kv_segment_ids, q_index, kv_index, *, causal: bool, sliding_window: int):
    """[B, T, S]: query t may attend to key s (same segment; causal and windowed by original token indices
    q_index [T] and kv_index [S])."""
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    t, s = q_index[:, None], kv_index[None, :]
    if causal:
        mask = mask & (s <= t)[None]
    if sliding_window > 0:
        mask = mask & (t - s < sliding_window)[None]
    return mask


def merge_block(state, q, k, v, mask, *, scale: float, logits_soft_cap: float):
    """The running (m, l, acc) after one more key block: q [B, T, G, R, H], k [B, S, G, H], v [B, S, G, Hv],
    mask [B, T, S]; m and l [B, T, G, R], acc [B, T, G, R, Hv], all float32."""
    m, l, acc = state
    scores = jnp.einsum("BTGRH,BSGH->BTGRS", q, k, preferred_element_type=jnp.float32)
    scores = soft_cap(scores * scale, logits_soft_cap)
    mask = mask[:, :, None, None, :]
    scores = jnp.where(mask, scores, _NO_SCORE)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.where(mask, jnp.exp(scores - m_new[..., None]), 0.0)  # no inf: masked scores are _NO_SCORE
    alpha = jnp.exp(m - m_new)
    l_new = l * alpha + p.sum(axis=-1)
    pv = jnp.einsum("BTGRS,BSGH->BTGRH", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l_new, acc * alpha[..., None] + pv


def ring_attention_shard(q, k, v, segment_ids, q_index, sinks=None, *, axes: tuple[str, ...], ways: int,
                         causal: bool = True, sliding_window: int = 0, logits_soft_cap: float = 0.0,
                         scale: float | None = None):
    """One device's part, inside shard_map over the context mesh `axes` (a ring of `ways` devices): q [B, T, N, H],
    k [B, T, G, H], v [B, T, G, Hv], segment_ids [B, T] and q_index [T] (original token indices) of this device;
    sinks [N] or None. Returns [B, T, N, Hv] in q.dtype."""
    b, t, n, h = q.shape
    g, hv = k.shape[2], v.shape[-1]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({g})")
    scale = h**-0.5 if scale is None else scale
    q5 = q.reshape(b, t, g, n // g, h)
    state = (jnp.full((b, t, g, n // g), _NO_SCORE, jnp.float32), jnp.zeros((b, t, g, n // g), jnp.float32),
             jnp.zeros((b, t, g, n // g, hv), jnp.float32))
    ring = [(i, (i + 1) % ways) for i in range(ways)]

    def attend(state, block):
        k, v, kv_segment_ids, kv_index = block
        mask = block_mask(segment_ids, kv_segment_ids, q_index, kv_index, causal=causal, sliding_window=sliding_window)
        return merge_block(state, q5, k, v, mask, scale=scale, logits_soft_cap=logits_soft_cap)

    def step(carry, _):
        state, block = carry
        block = jax.lax.ppermute(block, axes, ring)  # the previous device's block (k, v, segment ids, indices)
        return (attend(state, block), block), None

    block = (k, v, segment_ids, q_index)
    state = attend(state, block)  # this device's own block, then the C - 1 others as they come round
    (state, _), _ = jax.lax.scan(step, (state, block), None, length=ways - 1)
    m, l, acc = state
    if sinks is not None:  # the sink of query head n = g R + r: one more column of each softmax, no value row
        sink = sinks.astype(jnp.float32).reshape(g, n // g)[None, None]
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp(m - m_new)
        l, acc = l * alpha + jnp.exp(sink - m_new), acc * alpha[..., None]
    return (acc / l[..., None]).reshape(b, t, n, hv).astype(q.dtype)


def ring_attention(q, k, v, segment_ids, *, reorder: str = "dual_chunk_swap", causal: bool = True,
                   sliding_window: int = 0, logits_soft_cap: float = 0.0, scale: float | None = None, sinks=None):
    """Attention of q [B, T, N, H] over k, v [B, T, G, H] in the load-balanced layout `reorder` (parallel/context.py),
    sharded along T over the context mesh axes of the active mesh (sharding.activation_sharding): each device's
    queries against every key, its key/value blocks passed around the ring. Equals the reference attention over
    the unsplit sequence (tests/parallel/test_context_ring.py)."""
    active = sharding.active_mesh()
    if active is None:
        raise ValueError("ring attention runs under sharding.activation_sharding (a mesh with a context axis)")
    mesh, rules = active
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    q_index = jnp.asarray(context.layout(q.shape[1], ways, reorder), jnp.int32)

    def shard_fn(q, k, v, segment_ids, q_index, *rest):
        return ring_attention_shard(q, k, v, segment_ids, q_index, *rest, axes=axes, ways=ways, causal=causal,
                                    sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale)
    q_axes, kv_axes = ("batch", "length", "heads", None), ("batch", "length", "kv_heads", None)
    specs = sharding.active_specs([q_axes, kv_axes])
    if specs is not None and specs[0][2] != specs[1][2]:
        raise ValueError(f"logical_axis_rules put 'heads' on {specs[0][2]} but 'kv_heads' on {specs[1][2]}: ring "
                         "attention needs both on the same mesh axes (whole groups of query heads with their kv head "
                         "on each device). Map them to the same axes, or use context_parallel_strategy=all_gather.")
    args, in_axes = [q, k, v, segment_ids, q_index], [q_axes, kv_axes, kv_axes, ("batch", "length"), ("length",)]
    if sinks is not None:
        args.append(sinks)
        in_axes.append(("heads",))
    return sharding.run_in_shards(shard_fn, args, in_axes, q_axes)
