"""DeepSeek Sparse Attention with the sequence split over the context group (context_parallel_strategy=all_gather):
selected.py's attention and choice, each device attending its own queries to the whole sequence's keys.

Under context parallelism C every activation [B, T, ...] is in the load-balanced layout (parallel/context.py:
dual_chunk_swap or striped) and split along T. Inside shard_map each device keeps its T / C queries (MLA's absorbed
queries, the indexer's queries and head weights, their segment ids and their original indices: `context.layout`)
and all-gathers what the keys need, put back in the sequence's order:

    c, k_r     MLA's latent and RoPE key         [B, T, C + Hr]   (576 numbers a token for DeepSeek-V3.2)
    k_I        the indexer's keys                [B, T, E]        (128 more, float32)
    segment ids                                  [B, T]

then runs selected.py's blocks on them: the indexer scores its queries against every key, the causal mask by the
queries' original indices (a query at p sees keys 0 .. p) and the documents by the gathered segment ids, top_k per
query, and the attention over the chosen keys (the plain form, or the selected-key Pallas kernel where attention
resolves to flash). The keys in the sequence's order make the choice that of one device, ties included (top_k's,
towards the earlier key). The backward reduce-scatters the keys' gradients (all_gather's transpose) to the devices
that hold them. The indexer's KL (indexer_training's sparse stage) is summed per device over its real queries and
the sums added outside. Per device: the gathered keys [B, T, C + Hr + E] and one query block's scores [B, bq, I, T];
no [T, T] array. A device scores all T keys (selected.py's one-device runs score only the keys before each run's
end), a little under 2x the indexer's work per query on one device, as dense all_gather attention.

The heads stay whole inside (the KL's target averages over all of them): under tensor parallelism each device of a
tensor group computes its queries' attention for every head. Ring, ulysses and usp do not serve DSA (a query's
chosen keys may lie anywhere before it); config/context_checks.py refuses them with the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models import attention as attention_lib
from maxtrain.models.families.deepseek import selected
from maxtrain.parallel import context, sharding

_SPLIT = ("batch", "length", None, None)   # [B, T, heads, X]: the device's queries, every head
_TOKENS = ("batch", "length", None)        # [B, T, X]
_PER_DEVICE = ("batch", "length")          # one number (or a row) per device, summed or maxed outside


def splits() -> bool:
    """Whether the active mesh splits the sequence (context parallelism > 1)."""
    return sharding.ways("length") > 1


def _context_axes():
    mesh, rules = sharding.active_mesh()
    return tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)


def _gatherer(length: int, reorder: str):
    """x [B, T / C, ...] (a device's tokens) -> [B, T, ...] the whole sequence's, in its original order."""
    axes = _context_axes()
    inverse = jnp.asarray(np.argsort(context.layout(length, sharding.ways("length"), reorder)), jnp.int32)
    return lambda x: None if x is None else jnp.take(jax.lax.all_gather(x, axes, axis=1, tiled=True), inverse, axis=1)


def _positions(length: int, reorder: str):
    """[T] int32: each layout position's original index (a device receives its own queries')."""
    return jnp.asarray(context.layout(length, sharding.ways("length"), reorder), jnp.int32)


def visible(segment_ids, reorder: str) -> jax.Array:
    """[B, T, S] bool of tokens in the layout `reorder` (queries and keys alike): the causal mask and the documents
    by the tokens' original indices, split along the queries (the dense forms' mask: indexer_training's dense
    warm-up); make_attention_mask's causal mask where the sequence is not split."""
    if not splits():
        return attention_lib.make_attention_mask(segment_ids, segment_ids, causal=True)
    order = _positions(segment_ids.shape[1], reorder)
    mask = attention_lib.make_attention_mask(segment_ids, segment_ids, causal=False)
    return sharding.shard(mask & (order[None, :] <= order[:, None])[None], _TOKENS)


def in_sequence_order(choice, reorder: str):
    """A choice (idx, kept) whose idx count keys in the layout, with idx counting them in the sequence's order, as
    `chosen` gives them (the same choice where the sequence is not split)."""
    if not splits():
        return choice
    idx, kept = choice
    return _positions(idx.shape[1], reorder)[idx], kept


def chosen(index_q, index_w, index_k, segment_ids, *, topk: int, block: int | None = None, reorder: str,
           dtype: str = "float32"):
    """selected.chosen under context parallelism: every query's chosen keys (idx [B, T, K] int32, original key
    indices, and kept [B, T, K] bool) in the layout, split along T; K = min(topk, T). dtype: the scores' precision
    (indexer_dtype)."""
    if not splits():
        return selected.chosen(index_q, index_w, index_k, segment_ids, topk=topk,
                               block=block or selected.query_block(segment_ids.shape[1]), dtype=dtype)
    length = segment_ids.shape[1]
    gather = _gatherer(length, reorder)

    def local(index_q, index_w, index_k, segment_ids, positions):
        bq = block or selected.query_block(segment_ids.shape[1])
        return selected.chosen_at(index_q, index_w, gather(index_k), segment_ids, gather(segment_ids), positions,
                                  topk=topk, block=bq, dtype=dtype)

    args = [jax.lax.stop_gradient(a) for a in (index_q, index_w, index_k)] + [segment_ids, _positions(length, reorder)]
    return sharding.run_in_shards(local, args, (_SPLIT, _TOKENS, _TOKENS, _PER_DEVICE, ("length",)),
                                  (_TOKENS, _TOKENS))


def attention(q_nope, q_rope, c, k_rope, w_k, index_q, index_w, index_k, segment_ids, *, topk: int, scale: float,
              reorder: str, block: int | None = None, with_max_logits: bool = False, kernel: str | None = None,
              choice=None, indexer_kl: bool = False, dtype: str = "float32"):
    """selected.attention (its arguments and returns) with the sequence split over the context group in the layout
    `reorder` (context_parallel_reorder_strategy); selected.attention itself where the mesh does not split it.
    choice: (idx, kept [B, T, K]) as `chosen` gives them, in the layout; None: each device's indexer chooses."""
    if not splits():
        return selected.attention(q_nope, q_rope, c, k_rope, w_k, index_q, index_w, index_k, segment_ids, topk=topk,
                                  scale=scale, block=block, with_max_logits=with_max_logits, kernel=kernel,
                                  choice=choice, indexer_kl=indexer_kl, dtype=dtype)
    length = segment_ids.shape[1]
    gather = _gatherer(length, reorder)
    q_c = jnp.einsum("BTNH,CNH->BTNC", q_nope, w_k.astype(q_nope.dtype))
    real = jnp.maximum(jnp.sum((segment_ids > 0).astype(jnp.float32)), 1.0)
    names = ("index_q", "index_w", "index_k", "idx", "kept")
    optional = dict(zip(names, (index_q, index_w, index_k, *(choice or (None, None)))))
    given = [n for n in names if optional[n] is not None]

    def local(q_c, q_rope, c, k_rope, segment_ids, positions, *rest):
        o = dict(zip(given, rest))
        iq, iw, ik = o.get("index_q"), o.get("index_w"), gather(o.get("index_k"))
        c_all, r_all, seg_all = gather(c), gather(k_rope), gather(segment_ids)
        bq = block or selected.query_block(q_c.shape[1])
        if q_c.shape[1] % bq:
            raise ValueError(f"the query block ({bq}) must divide a device's {q_c.shape[1]} queries")
        mine = (o["idx"], o["kept"]) if "idx" in o else None
        if kernel is None:
            o_c, head_max, kl = selected.run(q_c, q_rope, iq, iw, mine, segment_ids, positions, c_all, r_all, ik,
                                             seg_all, topk=topk, scale=scale, block=bq, checkpointed=q_c.shape[1] > bq,
                                             indexer_kl=indexer_kl, dtype=dtype)
        else:
            if mine is None:
                mine = selected.chosen_at(*(jax.lax.stop_gradient(a) for a in (iq, iw, ik)), segment_ids, seg_all,
                                          positions, topk=topk, block=bq, dtype=dtype)
            o_c, head_max = selected.kernel_module(kernel).selected_attention(
                q_c, q_rope, c_all, r_all, *mine, scale=scale, interpret=kernel == "cpu", with_max_logits=True)
            kl = (selected.kl_beside_kernel(q_c, q_rope, c_all, r_all, *mine, iq, iw, ik, segment_ids, scale=scale,
                                            block=bq) if indexer_kl else jnp.zeros((), jnp.float32))
        return o_c, head_max[None, None], kl.reshape(1, 1)

    in_axes = [_SPLIT, _SPLIT, _TOKENS, _TOKENS, _PER_DEVICE, ("length",)]
    in_axes += [{"index_q": _SPLIT, "index_w": _TOKENS, "index_k": _TOKENS, "idx": _TOKENS, "kept": _TOKENS}[n]
                for n in given]
    o_c, head_max, kl = sharding.run_in_shards(
        local, [q_c, q_rope, c, k_rope, segment_ids, _positions(length, reorder), *(optional[n] for n in given)],
        in_axes, (_SPLIT, (*_PER_DEVICE, None), _PER_DEVICE))
    out = (o_c, jnp.max(head_max, axis=(0, 1))) if with_max_logits else o_c
    return (out, jnp.sum(kl) / real) if indexer_kl else out
