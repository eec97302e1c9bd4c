"""Qwen 2 and 2.5 (Yang et al. 2024): Llama's layers with biases on the q, k and v projections.

    q, k, v = x W_q + b_q, x W_k + b_k, x W_v + b_v        (the output projection has no bias)

Sliding-window attention (use_sliding_window, off in the released models) applies to layers at or
above max_window_layers; it is imported as an explicit attention_layer_types list.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["qwen2"]  # its Hugging Face model_type and architecture


def param_specs(model):
    config = model.config
    layer_specs = standard_layers.decoder_specs(config, qkv_bias=True)  # the attention block adds the biases
    return {**blocks.embedding_specs(config),
            "layers": {"decoder": stacked(layer_specs, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return attention_types(config, ["full"] * config.base_num_decoder_layers)


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return blocks.decoder_flops(config, model.layer_types, dense_attention)


HF_NAMES = {**hf.DECODER_NAMES, **hf.QKV_BIAS_NAMES}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu"})
    return {**hf.common_keys(config), **hf.rope_keys(config, notes), **hf.qwen_window_keys(config)}


def to_hf_config(keys: dict) -> dict:
    return {**hf.common_config(keys, FAMILY), **hf.rope_config(keys), "hidden_act": "silu",
            **hf.qwen_window_config(keys)}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed,
    layer=standard_layers.prenorm_layer, logits=standard_layers.logits, flops_per_token=flops_per_token,
    hf_names=HF_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config)
