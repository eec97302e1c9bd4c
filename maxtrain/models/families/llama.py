"""Llama 2, 3, 3.1 and 3.2 (Touvron et al. 2023; Grattafiori et al. 2024).

    x   = embed(tokens)
    x   = x + attention(rmsnorm(x))          grouped-query attention, RoPE (default or llama3 scaling)
    x   = x + swiglu_mlp(rmsnorm(x))         down(silu(gate(x)) * up(x))
    out = rmsnorm(x) @ W_out                 or the tied embedding (Llama 3.2 1B/3B)

Every layer is the same ("decoder"); a sliding window (Mistral) or biases (Qwen 2) are other families.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, hf
from maxtrain.models.decoder import LayerType, default_layer_types
from maxtrain.models.params import stacked
from maxtrain.parallel.sharding import shard

FAMILY = registry.FAMILIES["llama"]  # its Hugging Face model_type and architecture


def param_specs(config):
    layer = {"attn_norm": blocks.norm_spec(config), **blocks.attention_specs(config),
             "mlp_norm": blocks.norm_spec(config), **blocks.mlp_specs(config)}
    return {**blocks.embedding_specs(config), "layers": {"decoder": stacked(layer, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return default_layer_types(config, ["full"] * config.base_num_decoder_layers)


def embed(params, tokens, config, rt):
    return blocks.embed(params["token_embedding"], tokens, rt.dtype)


def layer(x, p, inputs, layer_type: LayerType, config, rt):
    eps = config.normalization_layer_epsilon
    window = config.sliding_window_size if layer_type.attention == "sliding" else 0
    h, aux = blocks.attention(blocks.rms_norm(x, p["attn_norm"], eps), p, inputs, config, rt,
                              rope=layer_type.rope, sliding_window=window)
    x = shard(x + h, ("batch", "length", "embed"))
    x = x + blocks.mlp(blocks.rms_norm(x, p["mlp_norm"], eps), p, rt, "silu")
    return shard(x, ("batch", "length", "embed")), aux


def logits(params, x, config, rt):
    return blocks.logits(params, x, config, rt)


def flops_per_token(config, dense_attention: bool = False) -> float:
    return blocks.decoder_flops(config, layer_types(config), dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

# maxtrain parameter path -> Hugging Face tensor name ("{i}": layer index); see hf.py for the layouts.
HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    "layers/decoder/attn_norm": ("model.layers.{i}.input_layernorm.weight", None),
    "layers/decoder/mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", None),
    **hf.ATTENTION_NAMES, **hf.MLP_NAMES,
}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False})
    return {**hf.common_keys(config), **hf.rope_keys(config, notes)}


def to_hf_config(keys: dict) -> dict:
    return {**hf.common_config(keys, FAMILY), **hf.rope_config(keys),
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
