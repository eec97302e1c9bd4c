"""QK-clip (Kimi K2's MuonClip): after each optimizer step, the query and key weights of every attention head
whose largest logit passed a threshold tau are scaled down so that the same logit would have been tau.

    S_max[n]  the step's largest logit of query head n in a layer (models/attention/max_logits.py; the max over
              the micro-batches: models/aux_names.STEP_MAX), read from the step's forward
    eta[n]    = min(1, tau / S_max[n])

The logits of head n are q_n . k_g(n) * scale, linear in the query and the key weights, so scaling them by factors
whose product is eta[n] scales that head's logits by eta[n]. Kimi K2 splits it evenly, sqrt(eta) on each side, and
so does this module where each query head has its own key head. Multi-head latent attention (DeepSeek-V3, Kimi K2)
does as Kimi K2 describes: the head's own parts, q's and k's non-rotary features (wq_b's or wq's first
qk_nope_head_dim, wkv_b's key part), by sqrt(eta); q's rotary features by eta; the rotary key, shared by every
head, not at all. With grouped-query attention (G key heads for N query heads) key head g takes
sqrt(min over its group of eta), the largest factor that clips none of its query heads more than asked, and each
query head the rest, eta[n] / that (biases, where the family has them, with their weights). A key group with no
head past tau is left bitwise as it was; another head of a clipped group keeps its logits up to rounding.

The optimizer's state is not touched (as in Kimi K2). The multi-token-prediction module's attention is not
clipped (its figures are not per layer: models/mtp.py). A q/k norm (qwen3, gemma3, use_qk_norm) normalises q and
k after the projections, which would undo the scaling and already bounds the logits: `check` refuses QK-clip
there, and under LoRA (the scaled weights are frozen) and pipeline stages (whose per-layer figures are named per
stage), in one line before compiling.
"""

from __future__ import annotations

import jax.numpy as jnp

from maxtrain.models.aux_names import MAX_ATTENTION_LOGIT, per_layer_name


def check(config, model) -> None:
    """Refuses qk_clip_threshold > 0 where QK-clip cannot do what it says (the module docstring)."""
    if config.qk_clip_threshold <= 0:
        return
    fix = "set qk_clip_threshold=0"
    stacks = model.param_specs["layers"]
    normed = [kind for kind, p in stacks.items() if "q_norm" in p]
    if normed or getattr(config, "use_qk_norm", False):
        raise ValueError(f"qk_clip_threshold={config.qk_clip_threshold}: {model.name} normalises queries and keys per "
                         "head (a q/k norm), which undoes QK-clip's scaling of their weights and already bounds the "
                         f"attention logits; {fix}")
    if config.lora_rank > 0:
        raise ValueError(f"qk_clip_threshold={config.qk_clip_threshold} scales the query and key weights, which "
                         f"lora_rank={config.lora_rank} freezes; {fix} or lora_rank=0")
    if config.ici_pipeline_parallelism * config.dcn_pipeline_parallelism > 1:
        raise ValueError(f"qk_clip_threshold={config.qk_clip_threshold} does not run in pipeline stages yet (each "
                         f"stage names its layers from 0); {fix}, or ici_pipeline_parallelism=1 and "
                         "dcn_pipeline_parallelism=1")
    if not any(lt.attention in ("full", "sliding", "chunked") for lt in model.layer_types):
        raise ValueError(f"qk_clip_threshold={config.qk_clip_threshold}: {model.name} has no attention layer; {fix}")


def _scale_heads(w, factor, head_axis: int, features=None):
    """w with each head h (axis head_axis) times factor[..., h] ([L, heads]: a layer axis first), on the
    last axis's `features` slice only when given; float32 arithmetic, w's dtype kept."""
    shape = [1] * w.ndim
    shape[0], shape[head_axis] = factor.shape
    f = factor.reshape(shape)
    w32 = w.astype(jnp.float32)
    if features is None:
        return (w32 * f).astype(w.dtype)
    return w32.at[..., features].multiply(f).astype(w.dtype)


def clip(params: dict, stats: dict, config, layer_types) -> dict:
    """params with QK-clip applied from the step's statistics `stats` (each attention layer's
    "step_stats/max_attention_logit/layer_<i>" [N]); params unchanged when qk_clip_threshold is 0."""
    tau = config.qk_clip_threshold
    if tau <= 0:
        return params
    layers = dict(params["layers"])
    num = len(layer_types)
    for kind in dict.fromkeys(lt.kind for lt in layer_types):
        indices = [i for i, lt in enumerate(layer_types) if lt.kind == kind]
        names = [per_layer_name(MAX_ATTENTION_LOGIT, i, num) for i in indices]
        if not all(name in stats for name in names):
            continue  # a kind without attention (a gated delta-net layer)
        s_max = jnp.stack([stats[name] for name in names])                         # [L_kind, N]
        eta = jnp.where(s_max > tau, tau / jnp.maximum(s_max, tau), 1.0)
        p = dict(layers[kind])
        if "wkv_b" in p:  # multi-head latent attention
            hn = config.qk_nope_head_dim
            root = jnp.sqrt(eta)
            wq = "wq_b" if "wq_b" in p else "wq"
            p[wq] = _scale_heads(_scale_heads(p[wq], root, 2, slice(0, hn)), eta, 2, slice(hn, None))
            p["wkv_b"] = _scale_heads(p["wkv_b"], root, 2, slice(0, hn))
        else:
            g = p["wk"].shape[2]
            key = jnp.sqrt(jnp.min(eta.reshape(eta.shape[0], g, -1), axis=-1))   # [L_kind, G]
            query = eta / jnp.repeat(key, eta.shape[1] // g, axis=1)             # [L_kind, N]
            p["wq"], p["wk"] = _scale_heads(p["wq"], query, 2), _scale_heads(p["wk"], key, 2)
            if "bq" in p:
                p["bq"], p["bk"] = _scale_heads(p["bq"], query, 1), _scale_heads(p["bk"], key, 1)
        layers[kind] = p
    return {**params, "layers": layers}
