"""GLM-5's shared indexer layers (config indexer_types; Hugging Face's glm_moe_dsa): a "shared" layer runs no
indexer and attends to the keys the previous "full" layer chose (transformers' prev_topk_indices).

The choice travels between layers in the decoder's layer state (contract.FamilyModel.layer_state):

    state = (idx [B, T, K] int32, kept [B, T, K] bool)      K = min(index_topk, S), S the keys (T, or the cache's
                                                            slots when decoding)

each query's K chosen keys and which of them are real (a query that sees fewer than K keys: the rest not kept), as
selected.chosen gives them in training and scoring, and indexer.choose when decoding. A full layer replaces the state
by its choice (aux["state"]); a shared layer reads it: selected.attention's plain and kernel forms take it as their
`choice`, decoding's masked form its [B, T, S] mask (`mask`). Where the keys are no more than index_topk every query
keeps them all, no layer chooses, and the state passes through unread. A shared layer holds no indexer weights and
caches no indexer key (transformers' shared layers have no indexer module).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def shared_layers(config) -> list[bool]:
    """Per layer, whether it is a "shared" indexer layer (indexer_types; [] or no indexer: none is)."""
    types = list(config.indexer_types) if config.index_n_heads > 0 else []
    return [t == "shared" for t in types] or [False] * config.base_num_decoder_layers


def layer_state(x, config, rt, length: int):  # pylint: disable=unused-argument
    """The carried choice before the first layer (none made yet: no key kept), or None where no layer shares."""
    if not any(shared_layers(config)):
        return None
    k = min(config.index_topk, length)
    return jnp.zeros((*x.shape[:2], k), jnp.int32), jnp.zeros((*x.shape[:2], k), bool)


def mask(choice, slots: int) -> jax.Array:
    """[B, T, S] bool: the keys a choice (idx, kept [B, T, K]) keeps among S slots."""
    idx, kept = choice
    one = jax.vmap(jax.vmap(lambda row, at, real: row.at[at].max(real)))  # per query: its kept keys (max: a
    return one(jnp.zeros((*idx.shape[:2], slots), jnp.int8), idx, kept.astype(jnp.int8)) > 0  # padded slot repeats)
