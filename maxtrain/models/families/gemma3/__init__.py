"""Gemma 3 text models (Gemma Team 2025): Gemma 2's layers with qk-norm, five local layers per global
one, and a RoPE per layer type.

    q, k = rmsnorm_H(x W_q), rmsnorm_H(x W_k)     (1 + scale) form, before RoPE
    layer i is global if (i + 1) % 6 == 0, else a sliding-window layer
    global layers: RoPE at rope_max_timescale (1M), with linear scaling in the 4B and larger models;
    local layers:  RoPE at local_rope_max_timescale (10k)

No attention-logit soft-cap (transformers ignores attn_logit_softcapping for Gemma 3); the final
logits are soft-capped only when final_logits_soft_cap is set.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["gemma3"]  # its Hugging Face model_type and architecture
PERIOD = len(FAMILY.attention_pattern)  # one global layer closes every group of six (registry.py)
_pattern = FAMILY.pattern


def param_specs(model):  # the attention block applies qk-norm because q_norm and k_norm exist
    config = model.config
    layer_specs = standard_layers.sandwich_specs(config, qk_norm="zeros")
    return {**blocks.embedding_specs(config, norm_init="zeros"),
            "layers": {"decoder": stacked(layer_specs, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return attention_types(config, _pattern(config.base_num_decoder_layers))


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return blocks.decoder_flops(config, model.layer_types, dense_attention)


HF_NAMES = {**hf.SANDWICH_NAMES, **hf.QK_NORM_NAMES}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": False})
    if config.get("use_bidirectional_attention"):
        raise hf.ConversionError("use_bidirectional_attention=true (maxtrain's decoders are causal)")
    full, sliding = _rope_parameters(config, notes)
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise hf.ConversionError(f"the sliding-window layers' RoPE is {sliding} (maxtrain's local RoPE has no scaling)")
    if config.get("attn_logit_softcapping") and notes is not None:
        notes.append(f"attn_logit_softcapping={config['attn_logit_softcapping']} is ignored, as transformers "
                     "ignores it for Gemma 3")
    keys = {**hf.common_keys(config, tie_word_embeddings=True),
            **hf.rope_keys(config, notes, rope=full, default_theta=1_000_000.0),
            "local_rope_max_timescale": float(sliding.get("rope_theta", 10_000.0))}
    pattern = config.get("sliding_window_pattern", PERIOD)
    default = ["sliding" if (i + 1) % pattern else "full" for i in range(config["num_hidden_layers"])]
    sliding_keys = hf.sliding_keys(config, default, config.get("sliding_window", 4096))
    if not sliding_keys["attention_layer_types"] and default != _pattern(config["num_hidden_layers"]):
        sliding_keys["attention_layer_types"] = default
    return {**keys, **sliding_keys, "query_pre_attn_scalar": float(config.get("query_pre_attn_scalar", 256)),
            "attn_logits_soft_cap": 0.0,
            "final_logits_soft_cap": float(config.get("final_logit_softcapping") or 0.0)}


def _rope_parameters(config: dict, notes) -> tuple[dict, dict]:
    """(full-attention, sliding-attention) RoPE parameter dicts, as transformers 5 reads them."""
    given = config.get("rope_parameters")
    if given is not None and not ({"full_attention", "sliding_attention"} & set(given)):
        raise hf.ConversionError(f"rope_parameters={given} is not split by layer type (full_attention, "
                                 "sliding_attention), as Gemma 3 configs are")
    full = dict((given or {}).get("full_attention") or {"rope_type": "default"})
    sliding = dict((given or {}).get("sliding_attention") or {"rope_type": "default"})
    scaling = config.get("rope_scaling")
    if scaling:
        if given and given.get("full_attention") and notes is not None and any(
                full.get(k) != v for k, v in scaling.items()):
            notes.append(f"config.json states RoPE twice: rope_scaling={scaling} is merged over "
                         f"rope_parameters.full_attention={given['full_attention']}, as transformers reads it")
        full.update(scaling)
    full.setdefault("rope_theta", config.get("rope_theta", 1_000_000.0))
    sliding.setdefault("rope_theta", config.get("rope_local_base_freq", 10_000.0))
    return full, sliding


def to_hf_config(keys: dict) -> dict:
    local = keys["local_rope_max_timescale"] if keys["local_rope_max_timescale"] > 0 else keys["rope_max_timescale"]
    out = {**hf.common_config(keys, FAMILY),
           **hf.layer_types_config(keys, _pattern(keys["base_num_decoder_layers"])),
           "rope_parameters": {"full_attention": hf.rope_parameters(keys),
                               "sliding_attention": {"rope_type": "default", "rope_theta": local}},
           "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
           "query_pre_attn_scalar": hf.whole(keys["query_pre_attn_scalar"] if keys["query_pre_attn_scalar"] > 0 else keys["head_dim"]),
           "attn_logit_softcapping": None, "final_logit_softcapping": keys["final_logits_soft_cap"] or None}
    return out


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.scaled_embed,
    layer=standard_layers.sandwich_layer, logits=standard_layers.plus_one_logits, flops_per_token=flops_per_token,
    hf_names=HF_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config)
