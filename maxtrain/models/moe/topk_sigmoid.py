"""Llama 4's router for the mixture-of-experts block (models/moe/ calls it): sigmoid scores of the top-k
logits that scale the experts' inputs, not their outputs.

    experts = top K of the logits                                   [n, K]
    w_k     = sigmoid(logit of expert e_k)                           float32; the others' weights are 0
    y       = sum_k expert_{e_k}(w_k x)  (+ the shared expert of x)  the weight multiplies the expert's
                                                                     input: expert(w x) != w expert(x)
                                                                     (SwiGLU is not linear)

Llama 4 routes each token to one expert (K = 1), beside one always-on shared expert of the experts'
width (sigmoid_groups.shared_experts, shared_experts=1). The dispatch (dropless or capacity) multiplies
each (token, choice) pair's row by its weight before the experts and adds the experts' outputs
unweighted (`weights_inputs`). The balance losses read the softmax of the logits, as for the other
routers (transformers' Llama 4 computes no balance loss).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROUTER = "topk_sigmoid"


def route_topk_sigmoid(logits, s, bias=None):
    """(weights [..., K] float32, experts [..., K]) of Llama 4's router; bias [E] (routed_bias), when given,
    only changes which experts are chosen."""
    experts = jax.lax.top_k(logits if bias is None else logits + bias, s.top_k)[1]
    return jax.nn.sigmoid(jnp.take_along_axis(logits, experts, axis=-1)), experts


def weights_inputs(s) -> bool:
    """Whether the router's weights multiply the experts' inputs (Llama 4) rather than their outputs."""
    return s.router == ROUTER
