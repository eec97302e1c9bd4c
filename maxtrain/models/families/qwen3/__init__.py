"""Qwen 3 dense models (Yang et al. 2025): Llama's layers with RMSNorm on each query and key head.

    q, k = rmsnorm_H(x W_q), rmsnorm_H(x W_k)     over the head dim H, before RoPE ("qk-norm")

No q/k/v biases (Qwen 2 had them).
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["qwen3"]  # its Hugging Face model_type and architecture


def param_specs(model):
    config = model.config
    layer_specs = standard_layers.decoder_specs(config, qk_norm="ones")  # the attention block applies qk-norm
    return {**blocks.embedding_specs(config),
            "layers": {"decoder": stacked(layer_specs, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return attention_types(config, ["full"] * config.base_num_decoder_layers)


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return blocks.decoder_flops(config, model.layer_types, dense_attention)


HF_NAMES = {**hf.DECODER_NAMES, **hf.QK_NORM_NAMES}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False})
    return {**hf.common_keys(config), **hf.rope_keys(config, notes), **hf.qwen_window_keys(config)}


def to_hf_config(keys: dict) -> dict:
    return {**hf.common_config(keys, FAMILY), **hf.rope_config(keys), "hidden_act": "silu",
            **hf.qwen_window_config(keys), "attention_bias": False}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed,
    layer=standard_layers.prenorm_layer, logits=standard_layers.logits, flops_per_token=flops_per_token,
    hf_names=HF_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config)
