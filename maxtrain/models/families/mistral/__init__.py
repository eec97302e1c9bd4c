"""Mistral 7B (Jiang et al. 2023): Llama's layers with sliding-window attention in every layer.

    x = x + attention(rmsnorm(x))      each query sees the last sliding_window_size keys (itself included)
    x = x + swiglu_mlp(rmsnorm(x))

With sliding_window_size 0 (Mistral v0.2 onwards) it is exactly Llama.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["mistral"]  # its Hugging Face model_type and architecture


def param_specs(model):
    config = model.config
    layer = standard_layers.decoder_specs(config)
    return {**blocks.embedding_specs(config), "layers": {"decoder": stacked(layer, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return attention_types(config, FAMILY.attention_plan(config.base_num_decoder_layers, config.sliding_window_size, []))


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return blocks.decoder_flops(config, model.layer_types, dense_attention)


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu"})
    if config.get("layer_types") is not None:
        raise hf.ConversionError("a Mistral config with layer_types (alternating attention) is a Ministral model, "
                                 "which maxtrain does not implement")
    window = config.get("sliding_window") or 0
    return {**hf.common_keys(config), **hf.rope_keys(config, notes), "sliding_window_size": int(window)}


def to_hf_config(keys: dict) -> dict:
    return {**hf.common_config(keys, FAMILY), **hf.rope_config(keys), "hidden_act": "silu",
            "sliding_window": keys["sliding_window_size"] or None}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed,
    layer=standard_layers.prenorm_layer, logits=standard_layers.logits, flops_per_token=flops_per_token,
    hf_names=hf.DECODER_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config)
