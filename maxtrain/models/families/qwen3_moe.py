"""Qwen3-MoE (Yang et al. 2025): Qwen 3's qk-norm attention with mixture-of-experts layers, and dense
layers where the config asks for them.

    x = x + attention(rmsnorm(x))        q, k RMS-normed per head before RoPE (as Qwen 3)
    x = x + moe(rmsnorm(x))              layer i when i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0:
                                         p = softmax(router logits) over all E experts, the top K kept
                                         (renormalized to sum 1 when norm_topk_prob), experts of width
                                         base_moe_mlp_dim (models/moe.py)
    x = x + swiglu_mlp(rmsnorm(x))       the other layers: a dense gated MLP of width base_mlp_dim

Two layer kinds, "moe" and "dense", each with its own parameter stack; a stack that mixes them runs
as a scan over the repeating group (decoder.py).
"""

from __future__ import annotations

import dataclasses

from maxtrain.config import registry
from maxtrain.models import blocks, hf, moe
from maxtrain.models.families import llama, mistral, mixtral
from maxtrain.models.decoder import LayerType
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["qwen3_moe"]  # its Hugging Face model_type and architecture
ROUTER = "softmax_topk"

embed = llama.embed
logits = llama.logits


def is_moe_layer(config, i: int) -> bool:
    """Transformers' rule for Qwen3-MoE."""
    return i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0


def layer_types(config) -> list[LayerType]:
    return [dataclasses.replace(t, kind="moe" if is_moe_layer(config, i) else "dense")
            for i, t in enumerate(mistral.layer_types(config))]


def param_specs(config):
    attention = {"attn_norm": blocks.norm_spec(config), **blocks.attention_specs(config, qk_norm="ones"),
                 "mlp_norm": blocks.norm_spec(config)}
    per_kind = {"moe": {**attention, **moe.specs(config)}, "dense": {**attention, **blocks.mlp_specs(config)}}
    counts = {kind: sum(t.kind == kind for t in layer_types(config)) for kind in per_kind}
    return {**blocks.embedding_specs(config),
            "layers": {kind: stacked(specs, counts[kind]) for kind, specs in per_kind.items() if counts[kind]}}


def layer(x, p, inputs, layer_type: LayerType, config, rt):
    return mixtral.moe_decoder_layer(x, p, inputs, layer_type, config, rt, ROUTER, layer_types(config))


def flops_per_token(config, dense_attention: bool = False) -> float:
    return moe.flops_per_token(config, layer_types(config), dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_LAYER = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", None),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", None),
}
HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    **{f"layers/{kind}/{name}": v for kind in ("moe", "dense") for name, v in _LAYER.items()},
    **{k: v for kind in ("moe", "dense")
       for k, v in mixtral.for_kind({**hf.ATTENTION_NAMES, **hf.QK_NORM_NAMES}, kind).items()},
    **mixtral.for_kind(hf.MLP_NAMES, "dense"),
    "layers/moe/router": ("model.layers.{i}.mlp.gate.weight", 1),
    "layers/moe/w_gate": ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", 1),
    "layers/moe/w_up": ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", 1),
    "layers/moe/w_down": ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", 1),
}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False})
    window = config.get("sliding_window") if config.get("use_sliding_window") else None  # then every layer
    return {**hf.common_keys(config), **hf.rope_keys(config, notes), "sliding_window_size": int(window or 0),
            **mixtral.experts_keys(config), "base_moe_mlp_dim": int(hf.require(config, "moe_intermediate_size")),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(config.get("decoder_sparse_step") or 1),
            "mlp_only_layers": [int(i) for i in (config.get("mlp_only_layers") or [])]}


def to_hf_config(keys: dict) -> dict:
    if keys["attention_layer_types"] and len(set(keys["attention_layer_types"])) > 1:
        raise hf.ConversionError("Qwen3-MoE applies one attention type to every layer; attention_layer_types "
                                 f"{keys['attention_layer_types']} cannot be exported")
    window = keys["sliding_window_size"]
    return {**hf.common_config(keys, FAMILY), **hf.rope_config(keys), "hidden_act": "silu",
            "attention_bias": False, "use_sliding_window": window > 0, "sliding_window": window or None,
            "num_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"],
            "moe_intermediate_size": keys["base_moe_mlp_dim"] if keys["base_moe_mlp_dim"] > 0 else keys["base_mlp_dim"],
            "norm_topk_prob": keys["norm_topk_prob"], "decoder_sparse_step": keys["decoder_sparse_step"],
            "mlp_only_layers": list(keys["mlp_only_layers"])}
