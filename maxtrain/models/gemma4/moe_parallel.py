"""A dense MLP and a mixture of experts side by side, each with norms of its own (Gemma 4's MoE layers):

    h_dense = rmsnorm(mlp(rmsnorm(x) s_pre) ) s_1                  (the layer's gated MLP, as in a dense layer)
    router  = softmax(((x / rms(x)) * s_router * D ** -0.5) W_router)   -> top K, renormalized
    h_moe   = rmsnorm(sum_k w_k s_expert[e_k] expert_{e_k}(rmsnorm(x) s_pre2)) s_2
    y       = h_dense + h_moe                                      (then the layer's post-MLP norm)

x is the layer's residual stream before the MLP (the router reads it un-normed but for its own scale).
The experts are GeGLU (gelu_tanh); their weights are kept in the Hugging Face layout, gate and up fused
[E, 2F, D] and down [E, D, F], and turned into models/moe/'s [E, D, F] / [E, F, D] at use; the per-expert
scale multiplies each expert's down projection (the same as scaling its routing weight). Routing,
dispatch, parallelism and the balance losses are models/moe/'s ("softmax_topk" with norm_topk_prob).
"""

from __future__ import annotations

import jax.numpy as jnp

from maxtrain.models import moe
from maxtrain.models.gemma4.normed_attention import rms
from maxtrain.models.params import ParamSpec, dense


def specs(config) -> dict[str, ParamSpec]:
    d, e, f = config.base_emb_dim, config.num_experts, moe.expert_dim(config)
    norm = ParamSpec((d,), ("embed",), "ones")
    return {"dense_post_norm": norm, "moe_pre_norm": norm, "moe_post_norm": norm,
            "router": dense((d, e), ("embed", None), d), "router_scale": norm,
            "expert_scale": ParamSpec((e,), (None,), "ones"),
            "experts_gate_up": dense((e, 2 * f, d), ("exp", "mlp", "embed"), d),
            "experts_down": dense((e, d, f), ("exp", "embed", "mlp"), f)}


def block(x, dense_out, p, segment_ids, config, rt, num_moe_layers: int, routing=None):
    """(y [B, T, D], aux) from the residual x [B, T, D] and the dense MLP's output dense_out; routing: the experts
    replayed (moe.block's), or None."""
    eps, f = config.normalization_layer_epsilon, moe.expert_dim(config)
    router_x = rms(x, eps) * p["router_scale"].astype(x.dtype) * jnp.asarray(config.base_emb_dim**-0.5, x.dtype)
    gate_up = jnp.swapaxes(p["experts_gate_up"], 1, 2)  # [E, D, 2F]
    down = jnp.swapaxes(p["experts_down"], 1, 2) * p["expert_scale"][:, None, None].astype(p["experts_down"].dtype)
    experts = {"router": p["router"], "w_gate": gate_up[..., :f], "w_up": gate_up[..., f:], "w_down": down}
    y, aux = moe.block(rms(x, eps, p["moe_pre_norm"]), experts, segment_ids, config, rt, router="softmax_topk",
                       num_moe_layers=num_moe_layers, activation="geglu", router_x=router_x,
                       routing=routing)
    return rms(dense_out, eps, p["dense_post_norm"]) + rms(y, eps, p["moe_post_norm"]), aux
