"""Ulysses attention: context parallelism (context_parallel_strategy=ulysses) by an all-to-all over the heads.

The sequence is split over the context mesh axes in a load-balanced layout (parallel/context.py): each of the C
devices of a context group holds T / C tokens of every head. Inside shard_map over those axes one all-to-all
trades that for every token of N / C query heads (and G / C kv heads): the T / C-token pieces of the C devices,
concatenated in device order, are the whole sequence in the layout's order, so the mask compares the original
token indices `order` [T] (same segment, causal, sliding window) as all_gather's does. Each device runs the
plain-jnp reference on its heads, and a second all-to-all gives the output back split along T with every head.
The query heads of a kv head stay together: head n = g R + r, and the C groups of N / C query heads are those of
the C groups of G / C kv heads. So N and G (per tensor-parallel shard) must be multiples of C
(config/context_checks.py `_ulysses_heads_divide` refuses other models before compiling).

Per device: q, k, v of T tokens x N / C heads (as many numbers as T / C tokens x N heads) and, with the plain-jnp
form, the scores of its heads, [N / C, T, T]. With a kernel (attention=flash, cudnn or tokamax: attention.local_kernel)
each device puts its whole sequences back into the original token order (a permutation within the device), runs the
kernel on them as attention without context parallelism does, and permutes the output back to the layout: the
kernel's masks (causal by position, windows, segment ids) then hold as they are, and no [T, T] array is made.
On TPUs the kernel is splash on all T tokens, whose block tables grow as (T / block)^2 in the chip's scalar memory
(SMEM): long sequences need larger sa_block_q / sa_block_kv (train_compile names them when libtpu refuses). Those
tables are built by kernels/splash_tables.py (splash's own build is a T^2 pass: about 20 minutes a table at 1M).

Letters as in attention/__init__.py: B batch, T tokens, N query heads = G kv heads x R, H head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.attention import dot_product_attention
from maxtrain.parallel import context, sharding


def ulysses_attention_shard(q, k, v, segment_ids, order, inverse, sinks=None, *, axes: tuple[str, ...], ways: int,
                            causal: bool = True, sliding_window: int = 0, logits_soft_cap: float = 0.0,
                            scale: float | None = None, kernel=None):
    """One device's part, inside shard_map over the context mesh `axes` (`ways` devices): q [B, T/C, N, H],
    k and v [B, T/C, G, H], segment_ids [B, T/C] of this device, order [T] the layout's original indices, inverse
    [T] its inverse (the position of original token t in the layout; made on the host, as an argsort in the
    program XLA constant-folds it: 23 s of an H100 compile at 512k tokens), sinks [N] or None; kernel(q, k, v, segment_ids, sinks) a kernel on whole sequences in their original order, or None
    for the plain-jnp form. Returns [B, T/C, N, Hv] in q.dtype."""
    n, g = q.shape[2], k.shape[2]
    if n % ways or g % ways:
        raise ValueError(f"ulysses attention splits the heads {ways} ways over the context group: query heads ({n}) "
                         f"and kv heads ({g}) per device must be multiples of {ways}")

    def by_heads(x):  # [B, T/C, heads, H] -> [B, T, heads/C, H]
        return jax.lax.all_to_all(x, axes, split_axis=2, concat_axis=1, tiled=True)
    q, k, v = by_heads(q), by_heads(k), by_heads(v)
    segment_ids = jax.lax.all_gather(segment_ids, axes, axis=1, tiled=True)  # [B, T], the layout's order
    if sinks is not None:  # this device's N / C heads of the sinks
        sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(axes) * (n // ways), n // ways)
    if kernel is not None:
        def original(x):
            return jnp.take(x, inverse, axis=1)
        out = kernel(original(q), original(k), original(v), original(segment_ids), *([] if sinks is None else [sinks]))
        out = jnp.take(out, order, axis=1)  # back into the layout's order
        return jax.lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True)
    t, s = order[:, None], order[None, :]
    mask = segment_ids[:, :, None] == segment_ids[:, None, :]
    if causal:
        mask = mask & (s <= t)[None]
    if sliding_window > 0:
        mask = mask & (t - s < sliding_window)[None]
    out = dot_product_attention(q, k, v, mask, scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks)
    return jax.lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True)  # back: [B, T/C, N, Hv]


def ulysses_attention(q, k, v, segment_ids, *, reorder: str = "dual_chunk_swap", causal: bool = True,
                      sliding_window: int = 0, logits_soft_cap: float = 0.0, scale: float | None = None, sinks=None,
                      kernel=None):
    """Attention of q [B, T, N, H] over k, v [B, T, G, H] in the load-balanced layout `reorder`, sharded along T over
    the context mesh axes of the active mesh: heads traded for tokens by all-to-all (the module docstring). Equals
    the reference attention over the unsplit sequence (tests/parallel/test_context_ring.py)."""
    active = sharding.active_mesh()
    if active is None:
        raise ValueError("ulysses attention runs under sharding.activation_sharding (a mesh with a context axis)")
    mesh, rules = active
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    ways = sharding.ways("length")
    layout = context.layout(q.shape[1], ways, reorder)
    order, inverse = jnp.asarray(layout, jnp.int32), jnp.asarray(np.argsort(layout), jnp.int32)
    q_axes, kv_axes = ("batch", "length", "heads", None), ("batch", "length", "kv_heads", None)
    specs = sharding.active_specs([q_axes, kv_axes])
    if specs is not None and specs[0][2] != specs[1][2]:
        raise ValueError(f"logical_axis_rules put 'heads' on {specs[0][2]} but 'kv_heads' on {specs[1][2]}: ulysses "
                         "attention needs both on the same mesh axes. Map them to the same axes, or use "
                         "context_parallel_strategy=all_gather.")

    def shard_fn(q, k, v, segment_ids, order, inverse, *rest):
        return ulysses_attention_shard(q, k, v, segment_ids, order, inverse, *rest, axes=axes, ways=ways, causal=causal,
                                       sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                                       kernel=kernel)
    args = [q, k, v, segment_ids, order, inverse]
    in_axes = [q_axes, kv_axes, kv_axes, ("batch", "length"), (None,), (None,)]
    if sinks is not None:
        args.append(sinks)
        in_axes.append(("heads",))
    return sharding.run_in_shards(shard_fn, args, in_axes, q_axes)
