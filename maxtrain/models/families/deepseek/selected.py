"""DeepSeek Sparse Attention over the selected keys alone: MLA in its absorbed ("MQA") form, query block by query
block, each query reading only the index_topk latent keys its indexer chose. No [T, S] array exists: per block of
Bq queries the indexer's scores [B, Bq, I, S] and [B, Bq, S] (float32, no gradient), the chosen keys' latents
[B, Bq, K, C + Hr] and the logits [B, Bq, N, K]. The attention's memory and time grow as T x K; the indexer's
scoring and top_k read, for each query, the keys up to the end of its run of blocks (the blocks are split into
PREFIX_GROUPS runs of static length, each scoring only the keys before its end: about (G + 1) / 2G of T x S, so a
little over half; float32, docs/performance.md measures what that costs on CPU).

For a block of queries (K = min(index_topk, S)):

    I[t, s]    the indexer's score (indexer.py), -inf where the causal mask or the documents hide key s
    idx, I_k   = top_k(I[t, :], K)                        [B, Bq, K]; a query that sees fewer than K keys
                                                           gets -inf for the rest, which are masked out
    c_k, r_k   = c[idx], RoPE(k_r)[idx]                   the chosen keys' latent [.., K, C] and RoPE key [.., K, Hr]
    logits     = (q_c . c_k + q_r . r_k) * scale          q_c = q_nope W_kvb^k (absorbed: [B, T, N, C])
    o_c        = softmax(logits) . c_k                    [B, Bq, N, C]
and after the blocks out = o_c W_kvb^v [B, T, N, Hv]: W_kvb^k q_nope . c = q_nope . W_kvb^k c, the same logits as
MLA's expanded keys (mla.attention), in another order of the same sums (float32: within ~1e-6 relative).

The selection is top_k's: exactly K keys, ties at the K-th score broken towards the earlier key (indexer.top, which
decoding and the plain form use, keeps the same ones). The gradient reaches q, c and k_r through the gathers
(scatter-adds into the K chosen rows); the indexer takes none (its scores are computed under stop_gradient). With
more than one block each runs under jax.checkpoint, so the backward pass recomputes its gathers and logits rather
than keeping them for every block: what is kept for the backward is the blocks' inputs, o_c and the chosen keys'
indices ([B, T, K] int32 and a bool: the backward does not score again; under remat_policy=full the layer's
recomputed forward scores once more).

Training the indexer (indexer_training=sparse, attention's `indexer_kl`): each block also takes the indexer's KL over
its queries' selected keys, p the block's probabilities averaged over the heads (no gradient) against the softmax of
the indexer's scores at the same keys (their gradient to its weights alone): [B, Bq, I, K] and [B, Bq, K] more per
block, still no [T, S] array; with the kernel the KL comes from a plain-jnp side computation over the same keys.

Ours, not a library's: no kernel library (tokamax, cuDNN, splash) takes per-query key indices for MLA's latent keys
yet. With kernel= the same chosen keys (`chosen`: every query's idx and kept, [B, T, K]) go to our selected-key Pallas
kernel (kernels/selected_attention.py, Triton; kernels/selected_attention_tpu.py, Mosaic, on TPUs), run per device's
batch rows and heads inside shard_map; this plain form is what both are checked against
(tests/models/test_deepseek_selected.py, tests/kernels/test_selected_attention*.py). Under context parallelism
(all_gather) selected_context.py runs the same blocks (`run`, `chosen_at`) per device, its queries at their original
indices against the gathered keys.

Einsum letters: as blocks.py and mla.py (C the latent rank, R the RoPE width), K the selected keys, I the indexer's
heads and E their width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import attention as attention_lib
from maxtrain.models.families.deepseek import indexer
from maxtrain.parallel import sharding

QUERY_BLOCK = 128  # queries per block (the largest power of two up to it that divides T)
# What a checkpointed block keeps for its backward: the chosen keys' indices and which are real ([B, bq, K] each), so
# that the backward recomputes the gathers and logits but not the indexer's scores and top_k.
KEEP_CHOICE = jax.checkpoint_policies.save_only_these_names("selected_keys")
PREFIX_GROUPS = 8  # runs of query blocks, each scoring only the keys before its last query (a static length each)


def query_block(length: int, largest: int | None = None) -> int:
    """The queries per block: the largest power of two <= `largest` (QUERY_BLOCK) that divides `length`."""
    largest, block = largest or QUERY_BLOCK, 1
    while block * 2 <= largest and length % (block * 2) == 0:
        block *= 2
    return block


def prefix_groups(length: int, block: int) -> list[tuple[int, int]]:
    """The runs of query blocks, [(first query, end)]: up to PREFIX_GROUPS runs of (about) equal numbers of blocks;
    the queries of a run see no key at or after its end (causal), so its indexer scores keys [0, end) alone."""
    blocks = length // block
    groups = min(PREFIX_GROUPS, blocks)
    bounds = [round(i * blocks / groups) * block for i in range(groups + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def scored_keys(length: int) -> float:
    """Mean keys the indexer scores per query (and top_k sorts) at `length`: its run's end (prefix_groups)."""
    return sum((end - start) * end for start, end in prefix_groups(length, query_block(length))) / length


def attention(q_nope, q_rope, c, k_rope, w_k, index_q, index_w, index_k, segment_ids, *, topk: int,
              scale: float, block: int | None = None, with_max_logits: bool = False, kernel: str | None = None,
              choice=None, indexer_kl: bool = False, dtype: str = "float32"):
    """MLA under the indexer's top-k, reading only the chosen keys.

    q_nope [B, T, N, Hn], q_rope [B, T, N, R] (after RoPE), c [B, S, C] (the normed latent), k_rope [B, S, R]
    (after RoPE), w_k [C, N, Hn] (W_kvb's key half); index_q [B, T, I, E] (after RoPE), index_w [B, T, I] and
    index_k [B, S, E] (indexer.queries and indexer.keys); segment_ids [B, T] (T = S: training and scoring).
    Returns o_c [B, T, N, C] in c's dtype (times W_kvb's value half, the caller's, it is the attention's output),
    and with with_max_logits each head's largest logit over the kept keys [N] float32 (QK-clip's statistic).
    kernel: the platform (gpu, or cpu: interpreted) to run the selected-key Pallas kernel on, over the same keys
    (`chosen`); None: this plain form. choice: (idx, kept [B, T, K]) as `chosen` gives them, already made (a
    shared indexer layer's, families/deepseek/shared_topk.py): both forms read those keys, and the indexer's
    operands (index_q, index_w, index_k: None then) are not read, but for the KL below. dtype: the precision of the
    scores that choose the keys (indexer_dtype, indexer.combine); the KL's scores stay float32.

    indexer_kl (the sparse stage of indexer_training): returns (what it would return, kl), kl the indexer's loss
    indexer.kl_to_attention over the selected keys alone: per query block, p = the attention's probabilities over
    its K selected keys averaged over the heads (no gradient), I = the indexer's scores at those keys
    (indexer.selected_scores, its gradient reaching index_q, index_w, index_k), KL(p || softmax(I)) summed over the
    block's real queries (segment id > 0); their total over the real queries. No [T, S] array, work as T x K. The
    plain form takes p from the block's own softmax; the kernel's probabilities stay inside it, so beside it a
    plain-jnp side computation (`kl_beside_kernel`) recomputes p block by block from the gathered latents."""
    b, t, n, _ = q_nope.shape
    bq = block or query_block(t)
    if t % bq:
        raise ValueError(f"the query block ({bq}) must divide the sequence ({t})")
    real = jnp.maximum(jnp.sum((segment_ids > 0).astype(jnp.float32)), 1.0)
    q_c = jnp.einsum("BTNH,CNH->BTNC", q_nope, w_k.astype(q_nope.dtype))
    if kernel is not None:
        idx, kept = choice if choice is not None else chosen(*(jax.lax.stop_gradient(a) for a in (
            index_q, index_w, index_k)), segment_ids, topk=topk, block=bq, dtype=dtype)
        out = _kernel(q_c, q_rope, c, k_rope, idx, kept, scale=scale, platform=kernel, with_max_logits=with_max_logits)
        if not indexer_kl:
            return out
        return out, kl_beside_kernel(q_c, q_rope, c, k_rope, idx, kept, index_q, index_w, index_k, segment_ids,
                                     scale=scale, block=bq) / real
    out, head_max, kl = [], [], []
    for start, end in prefix_groups(t, bq):  # each run reads the keys before its end alone
        part = lambda a, start=start, end=end: None if a is None else a[:, start:end]  # noqa: E731
        o_c, m, run_kl = run(q_c[:, start:end], q_rope[:, start:end], part(index_q), part(index_w),
                             None if choice is None else tuple(map(part, choice)), segment_ids[:, start:end],
                             start + jnp.arange(end - start, dtype=jnp.int32),
                             c[:, :end], k_rope[:, :end], None if index_k is None else index_k[:, :end],
                             segment_ids[:, :end], topk=topk, scale=scale, block=bq, checkpointed=t > bq,
                             indexer_kl=indexer_kl, dtype=dtype)
        out.append(o_c)
        head_max.append(m)
        kl.append(run_kl)
    o_c = jnp.concatenate(out, axis=1) if len(out) > 1 else out[0]
    out = (o_c, jnp.max(jnp.stack(head_max), axis=0)) if with_max_logits else o_c
    return (out, sum(kl) / real) if indexer_kl else out


def run(q_c, q_rope, index_q, index_w, choice, q_segment_ids, positions, c, k_rope, index_k, k_segment_ids, *, topk,
        scale, block, checkpointed, indexer_kl=False, dtype: str = "float32"):
    """One run of query blocks (T queries, T a multiple of `block`, at the key positions `positions` [T] int32: a
    query at p sees keys 0 .. p of its document) against keys [0, S) in their order: (o_c [B, T, N, C], each head's
    largest kept logit [N], the indexer's KL summed over the run's real queries, 0.0 without indexer_kl). choice:
    the run's chosen keys (idx, kept [B, T, K']: `chosen`'s, K' >= the run's K, its padded slots not kept), or None:
    the indexer (index_q, index_w against index_k) chooses them. One device: the positions first .. first + T of a
    run of the sequence; context parallelism (selected_context.py): a device's own queries' original indices."""
    b, t, n, _ = q_c.shape
    k = min(topk, c.shape[1])

    def blocks(x):  # [B, T, ...] -> [T / block, B, block, ...]
        return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)

    def one_block(q_c_blk, q_r_blk, iq_blk, iw_blk, choice_blk, seg_blk, pos_blk):
        idx, kept = (choice_blk if choice_blk is not None                          # [B, bq, K] each
                     else _choose(iq_blk, iw_blk, seg_blk, pos_blk, index_k, k_segment_ids, k, dtype=dtype))
        kept = checkpoint_name(kept, "selected_keys")
        idx = checkpoint_name(idx, "selected_keys")  # kept for the backward: it need not score again
        logits, probs, c_k = _probabilities(q_c_blk, q_r_blk, c, k_rope, idx, kept, scale)  # [B, bq, N, K]
        o_c = jnp.einsum("BTNK,BTKC->BTNC", probs.astype(c.dtype), c_k)
        head_max = jnp.max(jnp.where(kept[:, :, None, :], jax.lax.stop_gradient(logits), -jnp.inf), axis=(0, 1, 3))
        kl = _block_kl(probs, kept, idx, iq_blk, iw_blk, index_k, seg_blk) if indexer_kl else jnp.zeros(())
        return o_c, head_max, kl

    body = jax.checkpoint(one_block, policy=KEEP_CHOICE) if checkpointed else one_block  # one block: nothing to redo
    blocked = lambda x: None if x is None else jax.tree.map(blocks, x)  # noqa: E731
    o_c, head_max, kl = jax.lax.map(lambda xs: body(*xs), (blocks(q_c), blocks(q_rope), blocked(index_q),
                                                           blocked(index_w), blocked(choice), blocks(q_segment_ids),
                                                           positions.reshape(t // block, block)))
    return jnp.moveaxis(o_c, 0, 1).reshape(b, t, n, c.shape[-1]), jnp.max(head_max, axis=0), jnp.sum(kl)


def _probabilities(q_c_blk, q_r_blk, c, k_rope, idx, kept, scale):
    """A block's (logits, probabilities [B, bq, N, K] float32, -inf and 0 at the slots not kept, and the chosen
    keys' latents c_k [B, bq, K, C]): the queries' softmax over their chosen keys, gathered from c and k_rope."""
    gather = jax.vmap(lambda rows_of, at: rows_of[at])                            # per sequence: [S, X] by [bq, K]
    c_k, r_k = gather(c, idx), gather(k_rope, idx)                                # [B, bq, K, C], [B, bq, K, R]
    logits = (jnp.einsum("BTNC,BTKC->BTNK", q_c_blk, c_k.astype(q_c_blk.dtype), preferred_element_type=jnp.float32)
              + jnp.einsum("BTNR,BTKR->BTNK", q_r_blk, r_k.astype(q_r_blk.dtype),
                           preferred_element_type=jnp.float32)) * scale
    logits = jnp.where(kept[:, :, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    probs = jnp.where(kept[:, :, None, :], probs, 0.0)  # a query with no key (none: it sees itself) gives 0
    return logits, probs, c_k


def _block_kl(probs, kept, idx, iq_blk, iw_blk, index_k, seg_blk):
    """A block's indexer KL summed over its real queries: the attention's probabilities [B, bq, N, K] averaged over
    the heads (no gradient) against softmax of the indexer's scores at the same K slots (indexer.kl_per_query)."""
    target = jax.lax.stop_gradient(jnp.mean(probs.astype(jnp.float32), axis=2))                     # [B, bq, K]
    index = indexer.selected_scores(iq_blk, iw_blk, index_k, idx)                                     # [B, bq, K]
    return jnp.sum(indexer.kl_per_query(target, index, kept) * (seg_blk > 0))


def kl_beside_kernel(q_c, q_rope, c, k_rope, idx, kept, index_q, index_w, index_k, segment_ids, *, scale, block):
    """The indexer's KL summed over the real queries where the selected-key kernel computes the attention (its
    probabilities never leave it): plain jnp beside it, block by block, the probabilities recomputed from the
    chosen keys' gathered latents without gradient (the kernel's own backward trains the model)."""
    b, t = segment_ids.shape
    q_c, q_rope, c, k_rope = (jax.lax.stop_gradient(a) for a in (q_c, q_rope, c, k_rope))

    def blocks(x):  # [B, T, ...] -> [T / block, B, block, ...]
        return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)

    def one_block(q_c_blk, q_r_blk, iq_blk, iw_blk, idx_blk, kept_blk, seg_blk):
        _, probs, _ = _probabilities(q_c_blk, q_r_blk, c, k_rope, idx_blk, kept_blk, scale)
        return _block_kl(probs, kept_blk, idx_blk, iq_blk, iw_blk, index_k, seg_blk)

    body = jax.checkpoint(one_block) if t > block else one_block  # the backward recomputes a block's gathers
    return jnp.sum(jax.lax.map(lambda xs: body(*xs), tuple(map(blocks, (q_c, q_rope, index_q, index_w, idx, kept,
                                                                         segment_ids)))))


def _choose(iq_blk, iw_blk, seg_blk, pos_blk, index_k, k_segment_ids, k, fused: bool = False,
            dtype: str = "float32"):
    """A block of queries' chosen keys (idx [B, bq, K] int32, kept [B, bq, K] bool): top_k of the indexer's scores
    over the keys its causal mask (key index <= the query's position, pos_blk [bq]) and documents let it see (-inf
    elsewhere: never chosen as kept), no gradient. fused: the scores from kernels/index_scores.py (no
    [B, bq, I, S] per-head scores in memory), float32 alone. dtype: the scores' precision (indexer.combine)."""
    visible = visible_keys(seg_blk, k_segment_ids, pos_blk)                                         # [B, bq, S]
    if fused and dtype != "float32":
        raise ValueError(f"the fused index-scores kernel (kernels/index_scores.py) scores in float32 alone, not "
                         f"indexer_dtype={dtype}; set indexer_dtype=float32 or score without it (fused=False)")
    if fused:
        # deferred: the Pallas kernel's import, only where it runs
        from maxtrain.kernels import index_scores  # pylint: disable=import-outside-toplevel
        scores = index_scores.index_scores(jax.lax.stop_gradient(iq_blk), jax.lax.stop_gradient(iw_blk),
                                           jax.lax.stop_gradient(index_k))
    else:
        scores = indexer.combine(iq_blk, iw_blk, index_k, dtype)
    index = jax.lax.stop_gradient(jnp.where(visible, scores, -jnp.inf))
    top, idx = jax.lax.top_k(index, k)
    return idx, top > -jnp.inf


def visible_keys(q_segment_ids, k_segment_ids, positions) -> jax.Array:
    """[B, T, S] bool: key s (its index) visible to the query at position positions[t]: s <= it, same document."""
    mask = attention_lib.make_attention_mask(q_segment_ids, k_segment_ids, causal=False)
    return mask & (jnp.arange(k_segment_ids.shape[1])[None, :] <= positions[:, None])[None]


def chosen(index_q, index_w, index_k, segment_ids, *, topk: int, block: int, fused: bool = False,
           dtype: str = "float32"):
    """Every query's chosen keys (idx [B, T, K] int32, kept [B, T, K] bool; K = min(topk, S)), block by block and
    run by run as the plain form chooses them (a run's queries score the keys before its end alone), for the
    kernel: [B, T, K] int32 and bool in memory, the blocks' scores one at a time. fused: each block's scores from
    kernels/index_scores.py (timed on a GPU by scripts/gpu_selected_check.py; not yet the model's choice)."""
    k = min(topk, index_k.shape[1])
    idx, kept = [], []
    for start, end in prefix_groups(segment_ids.shape[1], block):
        i, m = chosen_at(index_q[:, start:end], index_w[:, start:end], index_k[:, :end], segment_ids[:, start:end],
                         segment_ids[:, :end], start + jnp.arange(end - start, dtype=jnp.int32), topk=topk,
                         block=block, fused=fused, dtype=dtype)
        pad = [(0, 0), (0, 0), (0, k - i.shape[-1])]  # a run before index_topk keys: its missing slots not kept
        idx.append(jnp.pad(i, pad))
        kept.append(jnp.pad(m, pad, constant_values=False))
    return jnp.concatenate(idx, axis=1), jnp.concatenate(kept, axis=1)


def chosen_at(index_q, index_w, index_k, q_segment_ids, k_segment_ids, positions, *, topk: int, block: int,
              fused: bool = False, dtype: str = "float32"):
    """The chosen keys (idx, kept [B, T, K], K = min(topk, S)) of T queries at key positions `positions` [T] against
    the keys [0, S) of index_k [B, S, E], `block` queries at a time (a run of `chosen`'s; a device's own queries
    under context parallelism, selected_context.py)."""
    b, t = q_segment_ids.shape
    k = min(topk, index_k.shape[1])

    def blocks(x):  # [B, T, ...] -> [T / block, B, block, ...]
        return jnp.moveaxis(x.reshape(b, t // block, block, *x.shape[2:]), 1, 0)

    i, m = jax.lax.map(lambda xs: _choose(*xs, index_k, k_segment_ids, k, fused, dtype),
                       (blocks(index_q), blocks(index_w), blocks(q_segment_ids), positions.reshape(-1, block)))
    return tuple(jnp.moveaxis(x, 0, 1).reshape(b, t, k) for x in (i, m))


# The kernel's operands split as the flash kernel's (models/attention/kernels.py): over the batch and heads, whole
# along the sequence (each query may choose any earlier key of its row) and the latent.
_HEADS = ("batch", None, "heads", None)
_ROWS = ("batch", None, None)


def kernel_module(platform: str):
    """The selected-key kernel's module for `platform`: kernels/selected_attention_tpu.py (Mosaic) on tpu, else
    kernels/selected_attention.py (Triton; interpreted on cpu). Both take selected_attention's arguments."""
    if platform == "tpu":
        # deferred: the Pallas Mosaic kernel's import, only where it runs
        from maxtrain.kernels import selected_attention_tpu  # pylint: disable=import-outside-toplevel
        return selected_attention_tpu
    # deferred: the Pallas Triton kernel's import, only where it runs
    from maxtrain.kernels import selected_attention  # pylint: disable=import-outside-toplevel
    return selected_attention


def _kernel(q_c, q_rope, c, k_rope, idx, kept, *, scale: float, platform: str, with_max_logits: bool):
    """o_c [B, T, N, C] (and each head's largest kept logit [N]) from kernels/selected_attention.py (Triton; cpu:
    interpreted) or, on tpu, kernels/selected_attention_tpu.py (Mosaic), run on each device's batch rows and heads
    inside shard_map (GSPMD cannot partition a Pallas call)."""
    kernel = kernel_module(platform)

    def local(q_c, q_rope, c, k_rope, idx, kept):
        o_c, head_max = kernel.selected_attention(q_c, q_rope, c, k_rope, idx, kept, scale=scale,
                                                  interpret=platform == "cpu", with_max_logits=True)
        return o_c, head_max[None]  # [1, N / heads' ways] per device: their maximum below

    o_c, head_max = sharding.run_in_shards(local, (q_c, q_rope, c, k_rope, idx, kept),
                                           (_HEADS, _HEADS, _ROWS, _ROWS, _ROWS, _ROWS), (_HEADS, ("batch", "heads")))
    return (o_c, jnp.max(head_max, axis=0)) if with_max_logits else o_c
