"""Gemma 2 (Gemma Team 2024): pre- and post-norms around each sublayer, GeGLU, soft-capped logits.

    x   = embed(tokens) * sqrt(D)
    x   = x + rmsnorm(attention(rmsnorm(x)))      norms in the (1 + scale) form; scores scaled by
                                                  query_pre_attn_scalar ** -0.5 and soft-capped:
                                                  cap * tanh(s / cap) with cap attn_logits_soft_cap
    x   = x + rmsnorm(geglu_mlp(rmsnorm(x)))      down(gelu_tanh(gate(x)) * up(x))
    out = softcap(rmsnorm(x) @ E^T, final_logits_soft_cap)     tied embedding

Layers alternate: sliding-window attention (even layers), then global attention (odd layers).
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["gemma2"]  # its Hugging Face model_type and architecture, its attention pattern


def param_specs(model):
    config = model.config
    return {**blocks.embedding_specs(config, norm_init="zeros"),
            "layers": {"decoder": stacked(standard_layers.sandwich_specs(config), config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return attention_types(config, FAMILY.pattern(config.base_num_decoder_layers))


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return blocks.decoder_flops(config, model.layer_types, dense_attention)


HF_NAMES = hf.SANDWICH_NAMES


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False})
    keys = {**hf.common_keys(config, tie_word_embeddings=True), **hf.rope_keys(config, notes)}
    default = FAMILY.pattern(config["num_hidden_layers"])
    return {**keys, **hf.sliding_keys(config, default, config.get("sliding_window", 4096)),
            "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
            "attn_logits_soft_cap": float(config.get("attn_logit_softcapping", 50.0) or 0.0),
            "final_logits_soft_cap": float(config.get("final_logit_softcapping", 30.0) or 0.0)}


def to_hf_config(keys: dict) -> dict:
    default = FAMILY.pattern(keys["base_num_decoder_layers"])
    return {**hf.common_config(keys, FAMILY), **hf.rope_config(keys),
            **hf.layer_types_config(keys, default), "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": hf.whole(keys["query_pre_attn_scalar"] if keys["query_pre_attn_scalar"] > 0 else keys["head_dim"]),
            "attn_logit_softcapping": keys["attn_logits_soft_cap"] or None,
            "final_logit_softcapping": keys["final_logits_soft_cap"] or None}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.scaled_embed,
    layer=standard_layers.sandwich_layer, logits=standard_layers.plus_one_logits, flops_per_token=flops_per_token,
    hf_names=HF_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config)
