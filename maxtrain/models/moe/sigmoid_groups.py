"""DeepSeek-V3's parts of the mixture-of-experts block (models/moe/ calls them): the sigmoid group-limited
router, the selection bias and its update outside the gradient, shared experts, the sequence-wise balance loss.

    s = sigmoid(logits)                                        [n, E] scores, float32
    c = s + b                                                  b: routed_bias [E], for choosing only
    group score = sum of the 2 largest c in each of the n_routing_groups groups of E / groups experts
    experts     = top K of c among the experts of the topk_routing_group best groups
    w_k         = s_{e_k} (/ sum_k s_{e_k} when norm_topk_prob) x routed_scaling_factor
    y           = sum_k w_k expert_{e_k}(x) + shared(x)       shared: one SwiGLU of width shared_experts x F

Aux-loss-free balancing (Wang et al. 2024; DeepSeek-V3): after each optimizer step, outside the
gradient, b_e += routed_bias_update_rate x sign(mean_e' c_e' - c_e) with c_e the routed pairs expert e
took in the step (all micro-batches, all devices): overloaded experts are chosen less, idle ones more.
The bias is a parameter (it is part of the model: it changes inference routing; Hugging Face's
e_score_correction_bias) that the optimizer never changes: the train step overwrites its update.

`s` below is the block's moe.Settings (its num_experts, top_k, groups, topk_groups, scaling, norm_topk_prob,
router, seq_balance_loss_weight).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.models import blocks
from maxtrain.models.aux_names import PER_LAYER, STEP_STATS, per_layer_name
from maxtrain.models.params import ParamSpec, dense


def shared_width(shared_experts: int, shared_expert_mlp_dim: int, f: int) -> int:
    """The shared experts' SwiGLU width: shared_experts x F (F: one expert's width), or shared_expert_mlp_dim where
    the shared expert is one MLP of its own width (Qwen3-Next's shared_expert_intermediate_size)."""
    if shared_experts == 0:
        return 0
    return shared_expert_mlp_dim if shared_expert_mlp_dim > 0 else shared_experts * f


def bias_and_shared_specs(config, f: int) -> dict[str, ParamSpec]:
    """The selection bias [E] (routed_bias) and the shared experts' SwiGLU [D, shared_width]."""
    d, e = config.base_emb_dim, config.num_experts
    out = {}
    if config.routed_bias:
        out["router_bias"] = ParamSpec((e,), (None,), "zeros")
    if config.shared_experts > 0:
        w = shared_width(config.shared_experts, config.shared_expert_mlp_dim, f)
        out.update(shared_gate=dense((d, w), ("embed", "mlp"), d), shared_up=dense((d, w), ("embed", "mlp"), d),
                   shared_down=dense((w, d), ("mlp", "embed"), w))
    return out


def shared_experts(x, p, rt):
    """The shared experts, as one dense SwiGLU every token goes through: [B, T, D] -> [B, T, D]; where the
    layer declares `shared_expert_gate` [D, 1] (Qwen3-Next), each token's output is scaled by
    sigmoid(x . shared_expert_gate)."""
    out = blocks.mlp(x, {"w_gate": p["shared_gate"], "w_up": p["shared_up"], "w_down": p["shared_down"]}, rt)
    if "shared_expert_gate" in p:
        gate = jnp.einsum("btd,dk->btk", x.astype(jnp.float32), p["shared_expert_gate"].astype(jnp.float32))
        out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate)).astype(out.dtype)
    return out


def route_sigmoid_groups(logits, s, bias=None):
    """DeepSeek-V3's router (the formulas above): (weights [..., K], experts [..., K])."""
    scores = jax.nn.sigmoid(logits)
    choice = scores if bias is None else scores + bias
    if s.groups > 1:
        e, g = s.num_experts, s.groups
        grouped = choice.reshape(choice.shape[:-1] + (g, e // g))
        group_scores = jnp.sum(jax.lax.top_k(grouped, min(2, e // g))[0], axis=-1)   # [..., G]
        best = jax.lax.top_k(group_scores, s.topk_groups)[1]                          # [..., topk_groups]
        keep = jnp.any(best[..., :, None] == jnp.arange(g), axis=-2)                  # [..., G]
        choice = jnp.where(keep[..., None], grouped, -jnp.inf).reshape(choice.shape)
    experts = jax.lax.top_k(choice, s.top_k)[1]
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if s.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * s.scaling, experts


def router_probabilities(logits, s):
    """Each token's distribution over the experts that the balance losses read: the softmax, or for the
    sigmoid router its scores normalized to sum 1 (DeepSeek-V3's s'_{i,t})."""
    if s.router == "sigmoid_group_topk":
        scores = jax.nn.sigmoid(logits)
        return scores / jnp.sum(scores, axis=-1, keepdims=True)
    return jax.nn.softmax(logits, axis=-1)


def sequence_balance_sums(probs, experts, real, s) -> dict:
    """DeepSeek-V3's sequence-wise balance loss before its weight, summed over the sequences of x
    (a mean over them once summed across devices):

        per sequence  sum_e f_e P_e,   f_e = E / (K T') x (pairs of the T' real tokens routed to e),
                                       P_e = mean over the T' real tokens of s'_e"""
    e, k = s.num_experts, s.top_k
    b = probs.shape[0]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None, None], experts.shape)
    counts = jnp.zeros((b, e), jnp.float32).at[rows, experts].add(jnp.broadcast_to(real[..., None], experts.shape))
    length = jnp.sum(real, axis=-1)                                          # T' per sequence
    f = jax.lax.stop_gradient(counts) * e / (k * jnp.maximum(length, 1.0))[:, None]
    p_mean = jnp.einsum("bte,bt->be", probs, real) / jnp.maximum(length, 1.0)[:, None]
    return {"seq_balance": jnp.sum(f * p_mean), "sequences": jnp.sum((length > 0).astype(jnp.float32))}


def update_router_bias(params: dict, old_params: dict, stats: dict, config, layer_types) -> dict:
    """`params` (the optimizer's new ones) with each MoE layer's router_bias set to old_params' moved by the
    sign rule (above) from the step's expert counts, `stats` = {"step_stats/moe_expert_counts/layer_<i>": [E]}
    (aux_names.STEP_STATS, summed over the step's micro-batches). Without counts (routed_bias_update_rate =
    0) the bias stays as old_params have it: the optimizer's update of it (weight decay) is discarded. The MTP
    modules' bias (params["mtp"]) always stays as old_params have it."""
    if "router_bias" in params.get("mtp", {}):  # the MTP modules' bias (models/mtp.py) stays as loaded
        params = {**params, "mtp": {**params["mtp"], "router_bias": old_params["mtp"]["router_bias"]}}
    layers = params.get("layers", {})
    if "router_bias" not in layers.get("moe", {}):
        return params
    bias = old_params["layers"]["moe"]["router_bias"]
    moe_layers = [i for i, t in enumerate(layer_types) if t.is_moe]
    names = [expert_counts_name(i, len(layer_types)) for i in moe_layers]
    if config.routed_bias_update_rate > 0 and all(n in stats for n in names):
        counts = jnp.stack([stats[n] for n in names])                                  # [L_moe, E]
        step = jnp.sign(jnp.mean(counts, axis=-1, keepdims=True) - counts)
        bias = (bias.astype(jnp.float32) + config.routed_bias_update_rate * step).astype(bias.dtype)
    moe_params = {**layers["moe"], "router_bias": bias}
    return {**params, "layers": {**layers, "moe": moe_params}}


def expert_counts_name(layer: int, num_layers: int) -> str:
    return per_layer_name(PER_LAYER + STEP_STATS + "moe_expert_counts", layer, num_layers)
