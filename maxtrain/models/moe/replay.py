"""Routing replay (models/moe/ calls it): the experts a token goes to are given, not chosen; their weights
are still the router's, from its current logits, so the router's weights keep their gradient.

    experts  e [..., K]   recorded where the tokens were sampled (models/sampling.py, record_routing)
    weights  as the router weighs its own choice, for e:
        topk_softmax        softmax over the K logits of e                          (Mixtral)
        softmax_topk        softmax(logits) at e, / their sum when norm_topk_prob    (Qwen3-MoE)
        sigmoid_group_topk  sigmoid(logits) at e, / their sum when norm_topk_prob, x routed_scaling_factor
                            (DeepSeek-V3; the selection bias and the group limit only choose, so they drop out)
        topk_sigmoid        sigmoid(logits) at e                                     (Llama 4)

This is R3 (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning Training and Inference
Routers": the rollout's routing masks, the training router's softmax over them) and the routing replay
of GSPO (Zheng et al. 2025). With e the router's own choice the weights equal `moe.route`'s bitwise
(tests/models/test_routing_replay.py). `mismatched` counts the real tokens whose own top-k set differs
from the replayed one: the block reports their fraction (aux `moe_routing_mismatch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.models.moe import topk_sigmoid


def weights(logits, experts, s):
    """(weights [..., K] float32 of the given experts [..., K], experts) from router logits [..., E] float32."""
    experts = experts.astype(jnp.int32)
    if s.router == "sigmoid_group_topk":
        w = jnp.take_along_axis(jax.nn.sigmoid(logits), experts, axis=-1)
        if s.norm_topk_prob:
            w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
        return w * s.scaling, experts
    if s.router == topk_sigmoid.ROUTER:
        return jax.nn.sigmoid(jnp.take_along_axis(logits, experts, axis=-1)), experts
    if s.router == "topk_softmax":
        return jax.nn.softmax(jnp.take_along_axis(logits, experts, axis=-1), axis=-1), experts
    top = jnp.take_along_axis(jax.nn.softmax(logits, axis=-1), experts, axis=-1)
    if s.norm_topk_prob:
        top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top, experts


def mismatched(own, replayed, valid):
    """How many real tokens (valid [b, T]) the router would send to another set of experts than the replayed
    one: own, replayed [b, T, K] (the order within the K does not count)."""
    differ = jnp.any(jnp.sort(own, axis=-1) != jnp.sort(replayed.astype(own.dtype), axis=-1), axis=-1)
    return jnp.sum((differ & valid).astype(jnp.float32))
