"""Context parallelism: each sequence split over the `context` mesh axis, attention across the pieces.

With context parallelism C (the mesh axes the logical axis "length" maps to; rule ["length",
"context"]), every activation [B, T, ...] is sharded along T, so each device holds T / C tokens
of every row of its batch shard. Everything in a layer is per token except attention, which needs
every earlier key of the sequence: here each device all-gathers the keys, values and segment ids
of its context group and attends its own queries to all T keys. Activation
memory and the attention scores per device fall by C; the gathered keys and values of one layer
(2 x T x G x H) are the price, briefly, per layer.

Causal load balancing (context_parallel_reorder_strategy). Cut into C contiguous pieces, the last
device's queries would see every key and the first device's almost none. dual_chunk_swap (the
default) cuts the sequence into 2C chunks and device i holds chunks i and 2C - 1 - i (an early one
and the matching late one); striped deals the tokens round-robin, token t to device t mod C. Both
give every device about the same number of (query, key) pairs under the causal mask (exactly, for
dual_chunk_swap; striped gives each query of device i at most C - 1 keys more than device 0's):

    C = 2, T = 8, dual_chunk_swap:  device 0 holds [0 1, 6 7], device 1 holds [2 3, 4 5]
    C = 2, T = 8, striped:          device 0 holds [0 2 4 6], device 1 holds [1 3 5 7]

`models/decoder.py` puts each batch into this layout (`to_layout`) before the embedding, and takes
the logits out of it (`from_layout`) only where a caller wants them in order (the loss is a sum over
tokens and needs no reordering). RoPE reads each token's own position and the mask compares
original token indices (`layout`), so the result equals attention over the unsplit sequence:
packed segment ids, causality and sliding windows hold exactly. The attention itself is
`models.attention.context_parallel.attention`, which dispatches on context_parallel_strategy (all_gather,
ring, ulysses, usp).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


REORDER_STRATEGIES = ("dual_chunk_swap", "striped")


def layout(length: int, cp: int, reorder: str = "dual_chunk_swap") -> np.ndarray:
    """order[p] = the original index of the token at position p of the load-balanced layout, device i holding
    positions [i T / C, (i + 1) T / C). dual_chunk_swap: chunks i and 2C - 1 - i of 2C; striped: tokens i, i + C, ..."""
    if reorder == "striped":
        if length % cp:
            raise ValueError(f"a sequence of {length} tokens does not deal evenly to {cp} devices (context "
                             f"parallelism, striped); use a max_target_length that is a multiple of {cp}")
        return np.arange(length).reshape(length // cp, cp).T.reshape(-1)
    if reorder != "dual_chunk_swap":
        raise ValueError(f"context_parallel_reorder_strategy={reorder!r} is not one of {', '.join(REORDER_STRATEGIES)}")
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} tokens does not cut into {2 * cp} equal chunks "
                         f"(2 x context parallelism {cp}); use a max_target_length that is a multiple of {2 * cp}")
    chunks = np.arange(length).reshape(2 * cp, length // (2 * cp))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def to_layout(tree, cp: int, axis: int = 1, reorder: str = "dual_chunk_swap"):
    """Every array of `tree` (dims [B, T, ...] at `axis`) reordered into the load-balanced layout."""
    def reorder_one(a):
        return jnp.take(a, jnp.asarray(layout(a.shape[axis], cp, reorder)), axis=axis)
    return jax.tree.map(reorder_one, tree)


def from_layout(a, cp: int, axis: int = 1, reorder: str = "dual_chunk_swap"):
    """The inverse of to_layout for one array: back to the original token order."""
    inverse = np.argsort(layout(a.shape[axis], cp, reorder))
    return jnp.take(a, jnp.asarray(inverse), axis=axis)
