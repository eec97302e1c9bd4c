"""Qwen 2 and 2.5 (Yang et al. 2024): Llama's layers with biases on the q, k and v projections.

    q, k, v = x W_q + b_q, x W_k + b_k, x W_v + b_v        (the output projection has no bias)

Sliding-window attention (use_sliding_window, off in the released models) applies to layers at or
above max_window_layers; it is imported as an explicit attention_layer_types list.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, hf
from maxtrain.models.families import llama
from maxtrain.models.decoder import LayerType, default_layer_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["qwen2"]  # its Hugging Face model_type and architecture

embed = llama.embed
layer = llama.layer  # the attention block adds the biases because the parameters exist
logits = llama.logits


def param_specs(config):
    layer_specs = {"attn_norm": blocks.norm_spec(config), **blocks.attention_specs(config, qkv_bias=True),
                   "mlp_norm": blocks.norm_spec(config), **blocks.mlp_specs(config)}
    return {**blocks.embedding_specs(config),
            "layers": {"decoder": stacked(layer_specs, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return default_layer_types(config, ["full"] * config.base_num_decoder_layers)


def flops_per_token(config, dense_attention: bool = False) -> float:
    return blocks.decoder_flops(config, layer_types(config), dense_attention)


HF_NAMES = {**llama.HF_NAMES, **hf.QKV_BIAS_NAMES}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu"})
    window = config.get("sliding_window") if config.get("use_sliding_window") else None
    default = ["full"] * config["num_hidden_layers"]
    if window and config.get("layer_types") is None:  # transformers' rule when layer_types is absent
        first = config.get("max_window_layers", 28)
        config = {**config, "layer_types": ["sliding_attention" if i >= first else "full_attention"
                                            for i in range(config["num_hidden_layers"])]}
    return {**hf.common_keys(config), **hf.rope_keys(config, notes), **hf.sliding_keys(config, default, window)}


def to_hf_config(keys: dict, family: registry.Family = FAMILY) -> dict:
    types = keys["attention_layer_types"] or ["full"] * keys["base_num_decoder_layers"]
    return {**hf.common_config(keys, family), **hf.rope_config(keys), "hidden_act": "silu",
            "use_sliding_window": "sliding" in types and keys["sliding_window_size"] > 0,
            "sliding_window": keys["sliding_window_size"] or None, "max_window_layers": keys["base_num_decoder_layers"],
            "layer_types": [f"{t}_attention" for t in types]}
