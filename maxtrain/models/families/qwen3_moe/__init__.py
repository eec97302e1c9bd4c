"""Qwen3-MoE (Yang et al. 2025): Qwen 3's qk-norm attention with mixture-of-experts layers, and dense
layers where the config asks for them.

    x = x + attention(rmsnorm(x))        q, k RMS-normed per head before RoPE (as Qwen 3)
    x = x + moe(rmsnorm(x))              layer i when i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0:
                                         p = softmax(router logits) over all E experts, the top K kept
                                         (renormalized to sum 1 when norm_topk_prob), experts of width
                                         base_moe_mlp_dim (models/moe/)
    x = x + swiglu_mlp(rmsnorm(x))       the other layers: a dense gated MLP of width base_mlp_dim

Two layer kinds, "moe" and "dense", each with its own parameter stack; a stack that mixes them runs
as a scan over the repeating group (decoder.py).
"""

from __future__ import annotations

import dataclasses

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, moe, standard_layers
from maxtrain.models.layers import LayerType, attention_types

FAMILY = registry.FAMILIES["qwen3_moe"]  # its Hugging Face model_type and architecture
ROUTER = "softmax_topk"


def is_moe_layer(config, i: int) -> bool:
    """Transformers' rule for Qwen3-MoE."""
    return i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0


def layer_types(config) -> list[LayerType]:
    pattern = FAMILY.attention_plan(config.base_num_decoder_layers, config.sliding_window_size, [])
    return [dataclasses.replace(t, kind="moe", mlp="moe") if is_moe_layer(config, i) else
            dataclasses.replace(t, kind="dense") for i, t in enumerate(attention_types(config, pattern))]


def param_specs(model):
    config = model.config
    per_kind = {"moe": standard_layers.decoder_specs(config, mlp=moe.specs(config), qk_norm="ones"),
                "dense": standard_layers.decoder_specs(config, qk_norm="ones")}
    return {**blocks.embedding_specs(config), "layers": standard_layers.stacks(config, model.layer_types, per_kind)}


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    return standard_layers.prenorm_layer(x, p, inputs, layer_type, model, rt, router=ROUTER,
                                         num_moe_layers=model.num_moe_layers)


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return moe.flops_per_token(config, model.layer_types, dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_LAYER = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", hf.SAME),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", hf.SAME),
}
HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    **{f"layers/{kind}/{name}": v for kind in ("moe", "dense") for name, v in _LAYER.items()},
    **{k: v for kind in ("moe", "dense")
       for k, v in hf.for_kind({**hf.ATTENTION_NAMES, **hf.QK_NORM_NAMES}, kind).items()},
    **hf.for_kind(hf.MLP_NAMES, "dense"),
    "layers/moe/router": ("model.layers.{i}.mlp.gate.weight", hf.Linear(1)),
    "layers/moe/w_gate": ("model.layers.{i}.mlp.experts.{j}.gate_proj.weight", hf.Linear(1)),
    "layers/moe/w_up": ("model.layers.{i}.mlp.experts.{j}.up_proj.weight", hf.Linear(1)),
    "layers/moe/w_down": ("model.layers.{i}.mlp.experts.{j}.down_proj.weight", hf.Linear(1)),
}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False})
    window = config.get("sliding_window") if config.get("use_sliding_window") else None  # then every layer
    return {**hf.common_keys(config), **hf.rope_keys(config, notes), "sliding_window_size": int(window or 0),
            **hf.experts_keys(config), "base_moe_mlp_dim": int(hf.require(config, "moe_intermediate_size")),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
            "decoder_sparse_step": hf.count(config, "decoder_sparse_step", 1),
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


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed, layer=layer,
    logits=standard_layers.logits, flops_per_token=flops_per_token, hf_names=HF_NAMES,
    from_hf_config=from_hf_config, to_hf_config=to_hf_config)
