"""The MoE block's balance losses and load statistics (models/moe/'s docstring, "Aux"), over the micro-batch's real
tokens, summed across the token axes.

With router "given" (the caller chose the experts and weighed them: DeepSeek-V4) the block has no router logits:
no balance or z loss is computed, only the loads (and, with capacity dispatch, the dropped fraction)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.models.aux_names import PER_LAYER, STEP_STATS
from maxtrain.models.moe import sigmoid_groups


def aux(logits, experts, valid, dropped, s, axes, mismatched=None) -> dict:
    """The losses and statistics over the micro-batch's real tokens (summed over the token axes); mismatched:
    under routing replay, the real tokens whose replayed experts are not the router's own choice."""
    e, k = s.num_experts, s.top_k
    real = valid.astype(jnp.float32)
    counts = jnp.zeros(e, jnp.float32).at[experts.reshape(-1)].add(jnp.repeat(real.reshape(-1), k))
    sums = {"tokens": jnp.sum(real), "counts": counts}
    if logits is not None:  # None: router "given", no logits to balance
        probs = sigmoid_groups.router_probabilities(logits, s)
        sums.update(probs=jnp.einsum("...e,...->e", probs, real),
                    z=jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)) * real))
    if dropped is not None:
        sums["dropped"] = dropped.astype(jnp.float32)
    if mismatched is not None:
        sums["mismatched"] = mismatched
    if s.seq_balance_loss_weight > 0 and logits is not None:
        sums.update(sigmoid_groups.sequence_balance_sums(probs, experts, real, s))
    if axes.batch:
        sums = jax.lax.psum(sums, axes.batch)
    tokens = jnp.maximum(sums["tokens"], 1.0)
    f = jax.lax.stop_gradient(sums["counts"]) / tokens   # fraction of tokens that chose each expert
    per_layer = 1.0 / s.num_moe_layers
    load = f / k
    aux = {PER_LAYER + "moe_load_min": jnp.min(load), PER_LAYER + "moe_load_max": jnp.max(load)}
    if logits is not None:
        aux.update(moe_lb_loss=s.load_balance_loss_weight * e * jnp.sum(f * sums["probs"] / tokens) * per_layer,
                   moe_z_loss=s.router_z_loss_weight * sums["z"] / tokens * per_layer)
    if dropped is not None:
        aux["moe_dropped_fraction"] = sums["dropped"] / (tokens * k) * per_layer
    if mismatched is not None:  # a mean over the MoE layers, as the losses are
        aux["moe_routing_mismatch"] = sums["mismatched"] / tokens * per_layer
    if s.seq_balance_loss_weight > 0 and logits is not None:
        aux["moe_seq_balance_loss"] = (s.seq_balance_loss_weight * sums["seq_balance"]
                                       / jnp.maximum(sums["sequences"], 1.0) * per_layer)
    if s.count_experts:  # the routed pairs of each expert, for the selection bias's update (sigmoid_groups)
        aux[PER_LAYER + STEP_STATS + "moe_expert_counts"] = sums["counts"]
    return aux
