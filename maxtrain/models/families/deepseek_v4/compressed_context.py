"""DeepSeek-V4's attention with the sequence split over the context group (context_parallel_strategy=all_gather):
compressed.attention, each device attending its own queries to the whole sequence's keys and compressed entries.

Under context parallelism C every activation [B, T, ...] is in the load-balanced layout (parallel/context.py:
dual_chunk_swap or striped) and split along T; positions (restarting at 0 in each packed document) and segment
ids travel with the tokens. Inside shard_map each device keeps its T / C queries and all-gathers, over its context
group, what the keys need, put back in the sequence's order (context.layout's inverse):

    x              the layer's input (after the hyper-connections and input_layernorm)   [B, T, D]
    pos, segment ids                                                                      [B, T]

From them it computes what one device computes, on the whole sequence: the sliding window's keys, the compressors'
windows of m tokens (counted from each document's start, packed.py's layout over the gathered row) and their
entries, and the CSA indexer's keys. Its own queries (their query projections, the indexer's queries and head
weights) are scored against them with the masks of their own positions and documents: the window t - W < s <= t,
the entries closed before t, the indexer's top-k among those. Every key-side number is the one-device number,
so the result equals the unsplit layer's. The backward reduce-scatters x's gradient (all_gather's transpose) to
the devices that hold its tokens; the weights' gradients are summed over the devices.

x is the compressors' input: gathering it (D numbers a token, once a layer) is what lets every compressor pool whole
windows however the layout cuts them. The projections would be of similar size (DeepSeek-V4-Flash's CSA layers
project 2 x 2 Dh + 2 x 2 E + Dh = 3,072 numbers a token, against D = 4,096). Per device: the gathered [B, T, D], the
window's keys [B, T, Dh] and one layer's scores [B, H, T / C, T + T / m], 1 / C of one device's. The heads stay
whole on every device of a tensor group (as DeepSeek Sparse Attention's CP form).
Ring, ulysses and usp do not serve DeepSeek-V4; config/context_checks.py refuses them with the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.parallel import context, sharding

from . import compressed

_TOKENS = ("batch", "length", None)   # [B, T, X]
_IDS = ("batch", "length")            # [B, T]


def splits() -> bool:
    """Whether the active mesh splits the sequence (context parallelism > 1)."""
    return sharding.ways("length") > 1


def order(length: int, reorder: str) -> np.ndarray:
    """order[p]: the original index of the token at layout position p."""
    return context.layout(length, sharding.ways("length"), reorder)


def _gatherer(length: int, reorder: str):
    """a [B, T / C, ...] (a device's tokens) -> [B, T, ...] the whole sequence's, in its original order."""
    mesh, rules = sharding.active_mesh()
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    inverse = jnp.asarray(np.argsort(order(length, reorder)), jnp.int32)
    return lambda a: jnp.take(jax.lax.all_gather(a, axes, axis=1, tiled=True), inverse, axis=1)


def attention(p, x, pos, kind, d, segment_ids=None, *, reorder: str = "dual_chunk_swap"):
    """compressed.attention (its arguments and return) with x, pos and segment_ids in the layout `reorder`
    (context_parallel_reorder_strategy), split along T over the context group; compressed.attention itself where
    the mesh does not split the sequence."""
    if not splits():
        return compressed.attention(p, x, pos, kind, d, segment_ids)
    gather = _gatherer(x.shape[1], reorder)
    packed_rows = segment_ids is not None

    def local(p, x, pos, *seg):
        segment_ids = seg[0] if packed_rows else None
        keys = (gather(x), gather(pos), None if segment_ids is None else gather(segment_ids))
        return compressed.attention(p, x, pos, kind, d, segment_ids, keys_from=keys)

    pos = jnp.broadcast_to(pos, x.shape[:2])
    args = [p, x, pos] + ([segment_ids] if packed_rows else [])
    return sharding.run_in_shards(local, args, [(), _TOKENS, _IDS] + ([_IDS] if packed_rows else []), _TOKENS)
