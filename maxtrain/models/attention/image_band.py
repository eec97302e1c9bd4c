"""Sliding-window attention in which the tokens of one image also see each other both ways (Gemma 4's
bidirectional_image_attention), in its banded form: each block of queries against only the keys it can see.

The mask (make_attention_mask with q_blocks/kv_blocks): query t sees key s of its segment when
(s <= t or t and s lie in one image block) and t - s < W. A key s of query t is then either behind it, t - W < s <= t,
or ahead of it in t's image, t < s <= t + (L - 1), where L, the `span`, is at least the longest image block's length.
A block of `block` queries [i b, (i + 1) b) so sees only the W - 1 + b + L - 1 keys [i b - W + 1, (i + 1) b + L - 1).

    plain   dot_product_attention over the whole [T, T] mask: the reference, memory O(T^2) a head
    banded  image_band_attention: a lax.scan of checkpointed query blocks, each against its W - 1 + b + L - 1 keys;
            scores and probabilities live for one block at a time (forward, and again in the backward): memory
            O(b (W + b + L)) a head for them, O(T) for the rest; the same values as the plain form

The banded form is exact only while every image block is at most `span` tokens long: the host refuses longer runs
before compiling (families/gemma4: check_image_runs, naming the setting image_attention_span).
models/gemma4/normed_attention.py runs the banded form whenever its band is narrower than the sequence (`use_band`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.attention.reference import dot_product_attention, make_attention_mask

_OUTSIDE = jnp.iinfo(jnp.int32).min  # the segment id of the padding around the sequence: no real token has it


def band_width(sliding_window: int, span: int, block: int) -> int:
    """The keys one block of `block` queries reads: W - 1 behind its first query, the block, L - 1 past its last."""
    return (sliding_window - 1) + block + (span - 1)


def use_band(length: int, sliding_window: int, span: int, block: int) -> bool:
    """Whether the banded form reads fewer keys per query than the plain form's T (a window and a span given)."""
    return sliding_window > 0 and span > 0 and length > block and band_width(sliding_window, span, block) < length


def image_band_attention(q, k, v, segment_ids, blocks, *, sliding_window: int, span: int, block: int = 512,
                         scale: float | None = None, logits_soft_cap: float = 0.0, compact_scores: bool = False,
                         heads_major: bool = False):
    """The banded form of the module docstring: q [B, T, N, H], k and v [B, T, G, H], segment_ids and blocks [B, T]
    (image block ids >= 0, -1 for text) -> [B, T, N, H], equal to

        dot_product_attention(q, k, v, make_attention_mask(segment_ids, segment_ids, sliding_window=W,
                              q_blocks=blocks, kv_blocks=blocks))

    wherever no image block is longer than `span` tokens (W = sliding_window >= 1). The queries are padded to a
    multiple of `block` (padded rows are dropped), the keys by W - 1 before and the rest after (seen by no query)."""
    if sliding_window < 1 or span < 1:
        raise ValueError(f"the banded form needs a sliding window and an image span, not W={sliding_window}, "
                         f"span={span}; use dot_product_attention over the whole mask")
    b, t = q.shape[:2]
    n = -(-t // block)
    behind, width = sliding_window - 1, band_width(sliding_window, span, block)
    after = n * block + span - 1 - t  # the keys padded past T: the last block's band ends at n b + L - 1
    seg = segment_ids.astype(jnp.int32)
    ids = blocks.astype(jnp.int32)
    q_pad = jnp.pad(q, ((0, 0), (0, n * block - t), (0, 0), (0, 0)))
    q_subs = q_pad.reshape(b, n, block, *q.shape[2:]).swapaxes(0, 1)                  # [n, B, b, N, H]
    q_seg = jnp.pad(seg, ((0, 0), (0, n * block - t)), constant_values=_OUTSIDE).reshape(b, n, block).swapaxes(0, 1)
    q_ids = jnp.pad(ids, ((0, 0), (0, n * block - t)), constant_values=-1).reshape(b, n, block).swapaxes(0, 1)
    around = ((0, 0), (behind, after))
    k_pad = jnp.pad(k, around + ((0, 0), (0, 0)))
    v_pad = jnp.pad(v, around + ((0, 0), (0, 0)))
    kv_seg = jnp.pad(seg, around, constant_values=_OUTSIDE)
    kv_ids = jnp.pad(ids, around, constant_values=-1)

    @jax.checkpoint  # the backward recomputes one block's scores at a time
    def body(carry, xs):
        q_sub, seg_sub, ids_sub, i = xs
        start = i * block  # in the padded keys: absolute key i b - (W - 1), behind the block's first query
        take = lambda a: jax.lax.dynamic_slice_in_dim(a, start, width, axis=1)  # noqa: E731
        # query j of the block is absolute i b + j, key m of the band absolute i b - (W - 1) + m: offset W - 1
        mask = make_attention_mask(seg_sub, take(kv_seg), q_offset=behind, sliding_window=sliding_window,
                                   q_blocks=ids_sub, kv_blocks=take(kv_ids))
        return carry, dot_product_attention(q_sub, take(k_pad), take(v_pad), mask, scale=scale,
                                            logits_soft_cap=logits_soft_cap, compact_scores=compact_scores,
                                            heads_major=heads_major)

    _, out = jax.lax.scan(body, None, (q_subs, q_seg, q_ids, jnp.arange(n)))  # [n, B, b, N, Hv]
    return out.swapaxes(0, 1).reshape(b, n * block, *out.shape[3:])[:, :t]


def longest_run(vision) -> int:
    """The longest run of True along each row of vision [B, T] (host numpy), 0 for none: an image block's length."""
    vision = np.asarray(vision, bool)
    longest = 0
    for row in vision:
        edges = np.flatnonzero(np.diff(np.concatenate([[0], row.astype(np.int8), [0]])))
        if len(edges):
            longest = max(longest, int(np.max(edges[1::2] - edges[::2])))
    return longest
