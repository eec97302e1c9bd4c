"""DeepSeek-V4's compressors over packed documents: every document compressed as if it ran alone from position 0.

A row holds documents (segment ids s [B, T], 0 = padding) whose positions p [B, T] restart at 0 in each one
(data/packing.py). A compressor of rate m closes an entry at every token of a document with (p + 1) % m == 0: the
entry pools that document's m tokens p - m + 1 .. p (the token's own window, never another document's), its
position-bias slot j = p' % m, RoPE at the entry's start (p + 1 - m), and a CSA entry's previous half is that
document's previous window (none for its first entry). A document of n tokens closes n // m entries; its partial
last window is dropped, as unpacked. Padding closes none.

Layout. The closed entries of a row fill the W = T // m slots in the order they close (sum over documents of
n_d // m <= T // m); slot w pools the m tokens ending at the token that closed it, end[w]. Slots left over are
empty (valid = False) and hidden from every query. With a single document from position 0 filling the row, slot w
is window w, pooled from the very values the unpacked reshape gives: the results are bitwise the unpacked ones.

Visibility: the query (s_t, p_t) sees slot w when it is valid, of its own document, and closed before it:
index[w] < (p_t + 1) // m, the unpacked causal rule (compressed.causal_entries) on the document's own count. The
indexer scores only those entries, so its top-k never picks another document's; the sliding window reads keys of
the query's own document (`sliding`)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Layout(NamedTuple):
    """Where a rate-m compressor's entries come from in a packed row ([B, W] each, W = T // m)."""

    src: jax.Array       # [B, W, m] int32: the row indices of each slot's m tokens
    valid: jax.Array     # [B, W] bool: the slot holds a closed entry
    segment: jax.Array   # [B, W] int32: its document's segment id (-1: empty slot)
    index: jax.Array     # [B, W] int32: its number within its document (its RoPE position: index * m)


def layout(segment_ids, pos, rate):
    """segment_ids, pos [B, T] -> Layout of the T // rate slots."""
    b, t = segment_ids.shape
    n_slots = t // rate
    closes = (segment_ids != 0) & ((pos + 1) % rate == 0)                # [B, T]
    closed = jnp.cumsum(closes.astype(jnp.int32), axis=1)                # entries closed up to t
    want = jnp.arange(1, n_slots + 1, dtype=jnp.int32)
    end = jax.vmap(lambda c: jnp.searchsorted(c, want, side='left'))(closed)  # [B, W]: T when never
    valid = end < t
    end = jnp.minimum(end, t - 1).astype(jnp.int32)
    src = jnp.clip(end[..., None] - (rate - 1) + jnp.arange(rate, dtype=jnp.int32), 0, t - 1)
    segment = jnp.where(valid, jnp.take_along_axis(segment_ids, end, axis=1), -1)
    index = jnp.where(valid, jnp.take_along_axis(pos, end, axis=1) // rate, 0)
    return Layout(src, valid, segment.astype(jnp.int32), index.astype(jnp.int32))


def windows(p, kv, gate, lay):
    """Projections [B, T, C] -> each slot's window [B, W, m, C], the gate with its slot bias (as
    compressed.windows_of, gathered by the layout instead of cut every m tokens)."""
    b, n_slots, rate = lay.src.shape
    flat = lay.src.reshape(b, n_slots * rate)[..., None]

    def take(a):
        return jnp.take_along_axis(a, flat, axis=1).reshape(b, n_slots, rate, a.shape[-1])

    return take(kv), take(gate) + p['position_bias']


def entry_positions(lay, rate):
    """[B, W]: each entry's RoPE position, the start of its window within its document."""
    return lay.index * rate


def first_entries(lay):
    """[B, W] bool: the entries with no earlier window in their document (a CSA entry's previous half is empty)."""
    return lay.index == 0


def visible(lay, segment_ids, pos, rate):
    """[B, T, W] bool: the entries each query may read: closed before it, of its own document."""
    closed = lay.index[:, None, :] < ((pos + 1) // rate)[..., None]
    same = lay.segment[:, None, :] == segment_ids[..., None]
    return closed & same & lay.valid[:, None, :]


def same_document(segment_ids, key_segment_ids=None):
    """[B, T, S] bool: query t and key s belong to one document (the sliding window stays inside it);
    key_segment_ids [B, S]: the keys' (None: the queries' own)."""
    keys = segment_ids if key_segment_ids is None else key_segment_ids
    return segment_ids[:, :, None] == keys[:, None, :]
