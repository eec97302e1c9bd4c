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
from maxtrain.models import blocks, hf
from maxtrain.models.decoder import LayerType, default_layer_types
from maxtrain.models.params import stacked
from maxtrain.parallel.sharding import shard

FAMILY = registry.FAMILIES["gemma2"]  # its Hugging Face model_type and architecture, its attention pattern


def param_specs(config, qk_norm: str | None = None):
    norm = blocks.norm_spec(config, "zeros")  # the (1 + scale) form: scale 0 is the identity
    layer_specs = {"attn_norm": norm, **blocks.attention_specs(config, qk_norm=qk_norm), "post_attn_norm": norm,
                   "mlp_norm": norm, **blocks.mlp_specs(config), "post_mlp_norm": norm}
    return {**blocks.embedding_specs(config, norm_init="zeros"),
            "layers": {"decoder": stacked(layer_specs, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    n = config.base_num_decoder_layers
    return default_layer_types(config, FAMILY.pattern(n))


def embed(params, tokens, config, rt):
    return blocks.embed(params["token_embedding"], tokens, rt.dtype, multiplier=config.base_emb_dim**0.5)


def attention_scale(config) -> float:
    scalar = config.query_pre_attn_scalar if config.query_pre_attn_scalar > 0 else config.head_dim
    return scalar**-0.5


def layer(x, p, inputs, layer_type: LayerType, config, rt):
    eps = config.normalization_layer_epsilon
    window = config.sliding_window_size if layer_type.attention == "sliding" else 0
    h, aux = blocks.attention(blocks.rms_norm(x, p["attn_norm"], eps, plus_one=True), p, inputs, config, rt,
                              rope=layer_type.rope, sliding_window=window, scale=attention_scale(config),
                              logits_soft_cap=config.attn_logits_soft_cap, norm_plus_one=True)
    x = shard(x + blocks.rms_norm(h, p["post_attn_norm"], eps, plus_one=True), ("batch", "length", "embed"))
    h = blocks.mlp(blocks.rms_norm(x, p["mlp_norm"], eps, plus_one=True), p, rt, "gelu_tanh")
    x = x + blocks.rms_norm(h, p["post_mlp_norm"], eps, plus_one=True)
    return shard(x, ("batch", "length", "embed")), aux


def logits(params, x, config, rt):
    return blocks.logits(params, x, config, rt, norm_plus_one=True)


def flops_per_token(config, dense_attention: bool = False) -> float:
    return blocks.decoder_flops(config, layer_types(config), dense_attention)


HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    "layers/decoder/attn_norm": ("model.layers.{i}.input_layernorm.weight", None),
    "layers/decoder/post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", None),
    "layers/decoder/mlp_norm": ("model.layers.{i}.pre_feedforward_layernorm.weight", None),
    "layers/decoder/post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", None),
    **hf.ATTENTION_NAMES, **hf.MLP_NAMES,
}


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
