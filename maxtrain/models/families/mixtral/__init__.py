"""Mixtral (Jiang et al. 2024): Mistral's attention with a sparse mixture of SwiGLU experts in every layer.

    x = x + attention(rmsnorm(x))              grouped-query attention, RoPE; optional sliding window
    x = x + moe(rmsnorm(x))                    sum over the token's top-K experts of w_k expert_k(x),
                                               w = softmax over the K largest router logits (models/moe/)

Every layer is of kind "moe" (params["layers"]["moe"]).
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, moe, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["mixtral"]  # its Hugging Face model_type and architecture
ROUTER = "topk_softmax"


def param_specs(model):
    config = model.config
    layer_specs = standard_layers.decoder_specs(config, mlp=moe.specs(config))
    return {**blocks.embedding_specs(config), "layers": {"moe": stacked(layer_specs, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    pattern = FAMILY.attention_plan(config.base_num_decoder_layers, config.sliding_window_size, [])
    return attention_types(config, pattern, kind="moe", mlp="moe")


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    return standard_layers.prenorm_layer(x, p, inputs, layer_type, model, rt, router=ROUTER,
                                         num_moe_layers=config.base_num_decoder_layers)


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return moe.flops_per_token(config, model.layer_types, dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    "layers/moe/attn_norm": ("model.layers.{i}.input_layernorm.weight", hf.SAME),
    "layers/moe/mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", hf.SAME),
    **hf.for_kind(hf.ATTENTION_NAMES, "moe"),
    "layers/moe/router": ("model.layers.{i}.block_sparse_moe.gate.weight", hf.Linear(1)),
    "layers/moe/w_gate": ("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", hf.Linear(1)),
    "layers/moe/w_up": ("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", hf.Linear(1)),
    "layers/moe/w_down": ("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", hf.Linear(1)),
}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu"})
    if notes is not None and float(config.get("router_jitter_noise") or 0.0) > 0:
        notes.append(f"router_jitter_noise={config['router_jitter_noise']} (training-time noise on the router "
                     "input) is not implemented; inference is unaffected")
    if config.get("layer_types") is not None:
        raise hf.ConversionError("a Mixtral config with layer_types (alternating attention) is not implemented")
    window = config.get("sliding_window") or 0
    return {**hf.common_keys(config), **hf.rope_keys(config, notes), "sliding_window_size": int(window),
            **hf.experts_keys(config), "base_moe_mlp_dim": -1, "norm_topk_prob": True}


def to_hf_config(keys: dict) -> dict:
    out = {**hf.common_config(keys, FAMILY), **hf.rope_config(keys), "hidden_act": "silu",
           "sliding_window": keys["sliding_window_size"] or None,
           "num_local_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"]}
    if keys["base_moe_mlp_dim"] > 0:
        out["intermediate_size"] = keys["base_moe_mlp_dim"]  # the experts' width; Mixtral has no dense MLP
    return out


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed, layer=layer,
    logits=standard_layers.logits, flops_per_token=flops_per_token, hf_names=HF_NAMES,
    from_hf_config=from_hf_config, to_hf_config=to_hf_config)
