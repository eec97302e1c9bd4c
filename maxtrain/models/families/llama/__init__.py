"""Llama 2, 3, 3.1 and 3.2 (Touvron et al. 2023; Grattafiori et al. 2024).

    x   = embed(tokens)
    x   = x + attention(rmsnorm(x))          grouped-query attention, RoPE (default or llama3 scaling)
    x   = x + swiglu_mlp(rmsnorm(x))         down(silu(gate(x)) * up(x))
    out = rmsnorm(x) @ W_out                 or the tied embedding (Llama 3.2 1B/3B)

Every layer is the same ("decoder"); a sliding window (Mistral) or biases (Qwen 2) are other families.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["llama"]  # its Hugging Face model_type and architecture


def param_specs(model):
    config = model.config
    layer = standard_layers.decoder_specs(config)
    return {**blocks.embedding_specs(config), "layers": {"decoder": stacked(layer, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return attention_types(config, ["full"] * config.base_num_decoder_layers)


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return blocks.decoder_flops(config, model.layer_types, dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

# maxtrain parameter path -> Hugging Face tensor name ("{i}": layer index); see hf.py for the layouts.
HF_NAMES = hf.DECODER_NAMES


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False})
    return {**hf.common_keys(config), **hf.rope_keys(config, notes)}


def to_hf_config(keys: dict) -> dict:
    return {**hf.common_config(keys, FAMILY), **hf.rope_config(keys),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed,
    layer=standard_layers.prenorm_layer, logits=standard_layers.logits, flops_per_token=flops_per_token,
    hf_names=HF_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config)
