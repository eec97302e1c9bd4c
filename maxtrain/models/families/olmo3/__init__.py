"""OLMo 3 (Olmo Team 2025): OLMo 2's post-normed layers with sliding-window attention in three layers of four.

    x = x + rmsnorm(attention(x)); x = x + rmsnorm(mlp(x))     no norm before a sublayer (`layer` below)
    q, k = rmsnorm_{N*H}(x W_q), rmsnorm_{G*H}(x W_k)          qk-norm over ALL heads' features together
                                                               (one scale of N*H / G*H), before RoPE
    layer i is full attention if (i + 1) % 4 == 0, else a sliding window (4,096 in the released models)
    full layers: RoPE at rope_max_timescale with its scaling (YaRN, factor 8, in the released models);
    sliding layers: unscaled RoPE at local_rope_max_timescale

SwiGLU MLP, no biases, untied output. transformers reads one quirk of config.json that the import keeps: a
top-level rope_theta sets only the full layers' RoPE; the sliding layers' is 500,000 unless
rope_parameters.sliding_attention names its own.
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, standard_layers
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked
from maxtrain.parallel.sharding import shard

FAMILY = registry.FAMILIES["olmo3"]  # its Hugging Face model_type and architecture
_pattern = FAMILY.pattern
DEFAULT_THETA = 500_000.0  # transformers' Olmo3Config.default_theta


def layer_specs(config, qk_norm_over_heads: bool = True) -> dict:
    """OLMo's layer: a norm after attention and one after the MLP (none before), qk-norm over all heads'
    features by default (OLMo 2 and 3)."""
    return {**blocks.attention_specs(config, qk_norm="ones", qk_norm_over_heads=qk_norm_over_heads),
            "post_attn_norm": blocks.norm_spec(config), **blocks.mlp_specs(config),
            "post_mlp_norm": blocks.norm_spec(config)}


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    eps = config.normalization_layer_epsilon
    h, aux = blocks.attention(x, p, inputs, config, rt, layer_type)
    x = shard(x + blocks.rms_norm(h, p["post_attn_norm"], eps), ("batch", "length", "embed"))
    x = x + blocks.rms_norm(blocks.mlp(x, p, rt, "silu"), p["post_mlp_norm"], eps)
    return shard(x, ("batch", "length", "embed")), aux


def param_specs(model):  # the attention block normalizes q and k over all heads: q_norm [N, H], k_norm [G, H]
    config = model.config
    return {**blocks.embedding_specs(config),
            "layers": {"decoder": stacked(layer_specs(config), config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return attention_types(config, _pattern(config.base_num_decoder_layers))


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return blocks.decoder_flops(config, model.layer_types, dense_attention)


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False})
    full, sliding = _rope_parameters(config, notes)
    if sliding.get("rope_type", sliding.get("type", "default")) != "default":
        raise hf.ConversionError(f"rope_parameters.sliding_attention={sliding} (maxtrain's sliding-window layers "
                                 "rotate by an unscaled RoPE)")
    keys = {**hf.common_keys(config, rms_norm_eps=1e-5),
            **hf.rope_keys(config, notes, rope=full, default_theta=DEFAULT_THETA)}
    num_layers = config["num_hidden_layers"]
    names = config.get("layer_types") or [f"{t}_attention" for t in _pattern(num_layers)]
    if "sliding_attention" not in names:  # every layer attends fully: no window, no local RoPE
        # (a window of 1 only makes sliding_keys read and check layer_types)
        return {**keys, **hf.sliding_keys(config, _pattern(num_layers), 1), "sliding_window_size": 0}
    if not config.get("sliding_window", 4096):  # transformers' sliding mask needs a size
        raise hf.ConversionError(f"sliding_window={config['sliding_window']!r} with sliding_attention layers; "
                                 "set the window size")
    return {**keys, **hf.sliding_keys(config, _pattern(num_layers), config.get("sliding_window", 4096)),
            "local_rope_max_timescale": float(sliding.get("rope_theta", DEFAULT_THETA))}


def _rope_parameters(config: dict, notes) -> tuple[dict, dict]:
    """(full-attention, sliding-attention) RoPE parameter dicts, as transformers 5's Olmo3Config reads them."""
    given = config.get("rope_parameters")
    if given is not None and not ({"full_attention", "sliding_attention"} & set(given)):
        raise hf.ConversionError(f"rope_parameters={given} is not split by layer type (full_attention, "
                                 "sliding_attention), as OLMo 3 configs are")
    full = dict((given or {}).get("full_attention") or {"rope_type": "default"})
    sliding = dict((given or {}).get("sliding_attention") or {"rope_type": "default"})
    if config.get("rope_scaling"):
        full.update(config["rope_scaling"])
    full.setdefault("rope_theta", config.get("rope_theta", DEFAULT_THETA))
    if "rope_theta" not in sliding and config.get("rope_theta", DEFAULT_THETA) != DEFAULT_THETA and notes is not None:
        notes.append(f"rope_theta={config['rope_theta']} sets only the full-attention layers' RoPE; the sliding "
                     f"layers' is {DEFAULT_THETA:g}, as transformers reads it")
    sliding.setdefault("rope_theta", DEFAULT_THETA)
    return full, sliding


def to_hf_config(keys: dict) -> dict:
    local = keys["local_rope_max_timescale"]
    types = hf.layer_types_config(keys, _pattern(keys["base_num_decoder_layers"]))
    if local <= 0 and keys["rope_type"] != "default" and "sliding_attention" in types["layer_types"]:
        raise hf.ConversionError(f"rope_type={keys['rope_type']} with local_rope_max_timescale={local}: OLMo 3's "
                                 "sliding layers rotate by an unscaled RoPE; set local_rope_max_timescale (500000.0)")
    return {**hf.common_config(keys, FAMILY), **types,
            "rope_parameters": {"full_attention": hf.rope_parameters(keys), "sliding_attention": {
                "rope_type": "default", "rope_theta": local if local > 0 else keys["rope_max_timescale"]}},
            "hidden_act": "silu", "attention_bias": False,
            **({"max_position_embeddings": hf.whole(keys["rope_factor"] * keys["original_max_position_embeddings"])}
               if keys["rope_type"] == "yarn" else {})}  # the context YaRN extends to (65,536 in OLMo 3)


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed,
    layer=layer, logits=standard_layers.logits, flops_per_token=flops_per_token,
    hf_names=hf.POSTNORM_NAMES, from_hf_config=from_hf_config, to_hf_config=to_hf_config)
