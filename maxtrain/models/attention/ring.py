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
at a time: no [T, ...] buffer.

The gradient is a custom VJP (`_Ring.backward`): the forward pass keeps only this device's q, k, v, output and
the log of each softmax's denominator (lse), and the backward pass sends the key/value blocks round the ring
again, each carrying its running dk and dv, recomputing each block's probabilities from lse (as flash
attention's backward does); a last pass takes dk and dv home. So the backward pass too holds T / C keys and
values at a time (JAX's autodiff of the scan would keep all C blocks).

Long context: past QUERY_CHUNK queries a device attends each block in pieces of its queries (a lax.map forward,
a scan carrying dk and dv backward), so a block pair's scores are [B, QUERY_CHUNK, S] at a time, not [B, T, S]:
at 65,536 tokens, CP 4 and 4 rows the compiled step of a one-layer model needs 1.87 GiB of temporaries a device
instead of 28.17 GiB (end_to_end/cpu/long_context.py). Shorter shards are computed whole, as before.

Overlap: each step sends the block in hand on to the next device and attends to it, and neither depends on the
other, so the ppermute travels while the block is computed (as ring_flash.py's); backward, k, v and the ids travel
ahead the same way, and the block's running dk and dv follow it once this device's share is added.

Not yet here (issue 60): every block is computed in full, masked entries included (no skipping of blocks the
causal mask hides), and the blocks run in the plain-jnp form (attention=flash runs the ring with the flash or
splash kernel per block pair and causal block skipping instead: ring_flash.py, ring_splash.py; attention=cudnn
the same ring with cuDNN's forward and backward per pair: ring_cudnn.py).

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

# Query rows per piece of a block pair: past this many queries a device attends its queries to each block in
# pieces of at most this many (a lax.map / scan over them), so a block pair's scores are [B, QUERY_CHUNK, S], not
# [B, T, S] (at 65,536 tokens, CP 4 and 4 rows: 28 GiB of temporaries a device without it). Exact: every query's
# softmax state is its own, and dk, dv sum over the pieces.
QUERY_CHUNK = 1024


def query_pieces(t: int) -> int:
    """How many equal pieces a device's t queries are attended in: 1 up to QUERY_CHUNK queries, else the fewest of
    at most QUERY_CHUNK each (1 when t has no divisor from QUERY_CHUNK / 8 up: then the block is done whole)."""
    chunk = QUERY_CHUNK
    if t <= chunk:
        return 1
    size = next((d for d in range(chunk, max(1, chunk // 8) - 1, -1) if t % d == 0), t)
    return t // size


def _pieces(x, n: int, axis: int):
    """x with its `axis` (of n * c) cut into n pieces, leading: [n, ..., c, ...]."""
    return jnp.moveaxis(x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1:]), axis, 0)


def _whole(x, axis: int):
    """The inverse of _pieces."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], x.shape[axis] * x.shape[axis + 1], *x.shape[axis + 2:])


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
                         scale: float | None = None, pairs=None):
    """One device's part, inside shard_map over the context mesh `axes` (a ring of `ways` devices): q [B, T, N, H],
    k [B, T, G, H], v [B, T, G, Hv], segment_ids [B, T] and q_index [T] (original token indices) of this device;
    sinks [N] or None. Returns [B, T, N, Hv] in q.dtype. Its gradient (`_Ring.backward`, through `run_ring`) passes the blocks round the
    ring again, each with its running dk and dv, so the backward pass too holds T / C keys and values at a time.
    pairs: the ring's (source, destination) indices over `axes`, default c -> c + 1 mod `ways`; usp.py passes
    rings of every `inner`-th device (several rings of `ways` devices at once)."""
    n, g, h = q.shape[2], k.shape[2], q.shape[3]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({g})")
    ring = _Ring(axes, ways, causal, sliding_window, logits_soft_cap, h**-0.5 if scale is None else scale, pairs)
    return run_ring(ring, q, k, v, segment_ids, q_index, sinks)


def run_ring(ring, q, k, v, segment_ids, q_index, sinks):
    """ring.forward with ring.backward as its gradient (a custom VJP in q, k, v and sinks): this module's _Ring and
    ring_flash.py's RingFlash share it."""
    with_sinks = sinks is not None

    @jax.custom_vjp
    def attend(q, k, v, sinks, segment_ids, q_index):
        return ring.forward(q, k, v, segment_ids, q_index, sinks if with_sinks else None)[0]

    def forward(q, k, v, sinks, segment_ids, q_index):
        out, lse = ring.forward(q, k, v, segment_ids, q_index, sinks if with_sinks else None)
        return out, (q, k, v, sinks, segment_ids, q_index, out, lse)

    def backward(residuals, d_out):
        q, k, v, sinks, segment_ids, q_index, out, lse = residuals
        dq, dk, dv, d_sinks = ring.backward(q, k, v, segment_ids, q_index, sinks if with_sinks else None, out, lse,
                                            d_out)
        return dq, dk, dv, d_sinks if with_sinks else jnp.zeros_like(sinks), None, None  # no gradient for the ids

    attend.defvjp(forward, backward)
    return attend(q, k, v, sinks if with_sinks else jnp.zeros((q.shape[2],), jnp.float32),
                  segment_ids.astype(jnp.int32), q_index.astype(jnp.int32))


class _Ring:
    """The ring's forward and backward passes for one device, with the settings they share."""

    def __init__(self, axes, ways, causal, sliding_window, logits_soft_cap, scale, pairs=None):
        self.axes, self.ways, self.causal, self.sliding_window = axes, ways, causal, sliding_window
        self.logits_soft_cap, self.scale = logits_soft_cap, scale
        self.pairs = pairs if pairs is not None else [(i, (i + 1) % ways) for i in range(ways)]  # c sends to c + 1

    def pass_on(self, block):
        return jax.lax.ppermute(block, self.axes, self.pairs)

    def mask(self, segment_ids, q_index, kv_segment_ids, kv_index):
        return block_mask(segment_ids, kv_segment_ids, q_index, kv_index, causal=self.causal,
                          sliding_window=self.sliding_window)

    def forward(self, q, k, v, segment_ids, q_index, sinks):
        """(out [B, T, N, Hv] in q.dtype, lse [B, T, G, R] float32: the log of each softmax's denominator)."""
        b, t, n, h = q.shape
        g, hv = k.shape[2], v.shape[-1]
        q5 = q.reshape(b, t, g, n // g, h)
        state = (jnp.full((b, t, g, n // g), _NO_SCORE, jnp.float32), jnp.zeros((b, t, g, n // g), jnp.float32),
                 jnp.zeros((b, t, g, n // g, hv), jnp.float32))

        pieces = query_pieces(t)

        def attend_piece(state, q5, segment_ids, q_index, block):
            k, v, kv_segment_ids, kv_index = block
            mask = self.mask(segment_ids, q_index, kv_segment_ids, kv_index)
            return merge_block(state, q5, k, v, mask, scale=self.scale, logits_soft_cap=self.logits_soft_cap)

        def attend(state, block):
            if pieces == 1:
                return attend_piece(state, q5, segment_ids, q_index, block)
            split = jax.tree.map(lambda a: _pieces(a, pieces, 1), (state, q5, segment_ids))
            out = jax.lax.map(lambda xs: attend_piece(*xs[:3], xs[3], block), (*split, _pieces(q_index, pieces, 0)))
            return jax.tree.map(lambda a: _whole(a, 1), out)

        def step(carry, _):
            state, block = carry
            incoming = self.pass_on(block)  # the next block travels while this one is attended (neither waits)
            return (attend(state, block), incoming), None

        block = (k, v, segment_ids, q_index)
        incoming = self.pass_on(block)  # this device's own block first, then the C - 1 others as they come round
        state = attend(state, block)
        (state, last), _ = jax.lax.scan(step, (state, incoming), None, length=self.ways - 2)
        state = attend(state, last)
        m, l, acc = state
        if sinks is not None:  # the sink of query head n = g R + r: one more column of each softmax, no value row
            sink = sinks.astype(jnp.float32).reshape(g, n // g)[None, None]
            m_new = jnp.maximum(m, sink)
            alpha = jnp.exp(m - m_new)
            m, l, acc = m_new, l * alpha + jnp.exp(sink - m_new), acc * alpha[..., None]
        return (acc / l[..., None]).reshape(b, t, n, hv).astype(q.dtype), m + jnp.log(l)

    def backward(self, q, k, v, segment_ids, q_index, sinks, out, lse, d_out):
        """(dq, dk, dv, d_sinks or None). With p = exp(score - lse) masked and D = sum_h d_out out per query:
        dv = p^T d_out, d_score = p (d_out v^T - D) (times the soft-cap's derivative), dq = d_score k scale,
        dk = d_score^T q scale; dk and dv travel with their block and a last pass takes them home."""
        b, t, n, h = q.shape
        g, hv = k.shape[2], v.shape[-1]
        q5 = q.reshape(b, t, g, n // g, h)
        d_out5 = d_out.reshape(b, t, g, n // g, hv).astype(jnp.float32)
        d_rows = jnp.sum(d_out5 * out.reshape(d_out5.shape).astype(jnp.float32), axis=-1)  # D [B, T, G, R]

        pieces = query_pieces(t)

        def attend(dq, block):
            if pieces == 1:
                return attend_piece(dq, q5, d_out5, d_rows, lse, segment_ids, q_index, block)
            k, v, kv_segment_ids, kv_index, dk, dv = block

            def one(dk_dv, xs):  # one piece of the queries; dk and dv summed over the pieces
                dq, (*_, dk, dv) = attend_piece(*xs, (k, v, kv_segment_ids, kv_index, *dk_dv))
                return (dk, dv), dq
            xs = jax.tree.map(lambda a: _pieces(a, pieces, 1), (dq, q5, d_out5, d_rows, lse, segment_ids))
            (dk, dv), dq = jax.lax.scan(one, (dk, dv), (*xs, _pieces(q_index, pieces, 0)))
            return _whole(dq, 1), (k, v, kv_segment_ids, kv_index, dk, dv)

        def attend_piece(dq, q5, d_out5, d_rows, lse, segment_ids, q_index, block):
            k, v, kv_segment_ids, kv_index, dk, dv = block
            mask = self.mask(segment_ids, q_index, kv_segment_ids, kv_index)[:, :, None, None, :]
            scores = soft_cap(jnp.einsum("BTGRH,BSGH->BTGRS", q5, k, preferred_element_type=jnp.float32) * self.scale,
                              self.logits_soft_cap)
            p = jnp.where(mask, jnp.exp(jnp.where(mask, scores, _NO_SCORE) - lse[..., None]), 0.0)
            dv = dv + jnp.einsum("BTGRS,BTGRH->BSGH", p, d_out5)
            d_scores = p * (jnp.einsum("BTGRH,BSGH->BTGRS", d_out5, v, preferred_element_type=jnp.float32)
                            - d_rows[..., None])
            if self.logits_soft_cap > 0:  # d cap tanh(x / cap) / dx = 1 - (capped / cap)^2
                d_scores = d_scores * (1.0 - (scores / self.logits_soft_cap) ** 2)
            d_scores = d_scores * self.scale
            dq = dq + jnp.einsum("BTGRS,BSGH->BTGRH", d_scores, k.astype(jnp.float32))
            dk = dk + jnp.einsum("BTGRS,BTGRH->BSGH", d_scores, q5.astype(jnp.float32))
            return dq, (k, v, kv_segment_ids, kv_index, dk, dv)

        def step(carry, _):
            dq, block, sums = carry
            incoming = self.pass_on(block)  # k, v, ids of the next block travel while this one is attended
            dq, (*_, dk, dv) = attend(dq, (*block, *sums))
            return (dq, incoming, self.pass_on((dk, dv))), None  # the block's dk, dv follow it round

        block = (k, v, segment_ids, q_index)
        incoming = self.pass_on(block)  # the own block first, as in the forward pass
        dq, (*_, dk, dv) = attend(jnp.zeros(q5.shape, jnp.float32),
                                  (*block, jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32)))
        carry = (dq, incoming, self.pass_on((dk, dv)))
        (dq, last, sums), _ = jax.lax.scan(step, carry, None, length=self.ways - 2)
        dq, (*_, dk, dv) = attend(dq, (*last, *sums))
        dk, dv = self.pass_on((dk, dv))  # each block's dk, dv home to the device that holds its keys
        d_sinks = None
        if sinks is not None:  # d out / d sink = -p_sink out: d sink = -sum over queries of p_sink D
            p_sink = jnp.exp(sinks.astype(jnp.float32).reshape(g, n // g)[None, None] - lse)
            d_sinks = -jnp.sum(p_sink * d_rows, axis=(0, 1)).reshape(n).astype(sinks.dtype)
        return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks


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
