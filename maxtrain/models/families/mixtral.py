"""Mixtral (Jiang et al. 2024): Mistral's attention with a sparse mixture of SwiGLU experts in every layer.

    x = x + attention(rmsnorm(x))              grouped-query attention, RoPE; optional sliding window
    x = x + moe(rmsnorm(x))                    sum over the token's top-K experts of w_k expert_k(x),
                                               w = softmax over the K largest router logits (models/moe.py)

Every layer is of kind "moe" (params["layers"]["moe"]). qwen3_moe reuses this layer with its own
router and qk-norm, and mixes in dense layers.
"""

from __future__ import annotations

import dataclasses

from maxtrain.config import registry
from maxtrain.models import blocks, hf, moe
from maxtrain.models.families import llama, mistral
from maxtrain.models.decoder import LayerType
from maxtrain.models.params import stacked
from maxtrain.parallel.sharding import shard

FAMILY = registry.FAMILIES["mixtral"]  # its Hugging Face model_type and architecture
ROUTER = "topk_softmax"

embed = llama.embed
logits = llama.logits


def param_specs(config):
    layer_specs = {"attn_norm": blocks.norm_spec(config), **blocks.attention_specs(config),
                   "mlp_norm": blocks.norm_spec(config), **moe.specs(config)}
    return {**blocks.embedding_specs(config), "layers": {"moe": stacked(layer_specs, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return [dataclasses.replace(t, kind="moe") for t in mistral.layer_types(config)]


def layer(x, p, inputs, layer_type: LayerType, config, rt):
    return moe_decoder_layer(x, p, inputs, layer_type, config, rt, ROUTER, layer_types(config))


def moe_decoder_layer(x, p, inputs, layer_type: LayerType, config, rt, router: str, types: list[LayerType],
                      activation: str = "swiglu"):
    """attention then a mixture of experts (kind "moe") or a gated MLP (any other kind), each pre-normed;
    `activation`: the experts' (models/moe.py)."""
    eps = config.normalization_layer_epsilon
    window = config.sliding_window_size if layer_type.attention == "sliding" else 0
    h, aux = blocks.attention(blocks.rms_norm(x, p["attn_norm"], eps), p, inputs, config, rt,
                              rope=layer_type.rope, sliding_window=window)
    x = shard(x + h, ("batch", "length", "embed"))
    normed = blocks.rms_norm(x, p["mlp_norm"], eps)
    if layer_type.kind == "moe":
        h, moe_aux = moe.block(normed, p, inputs.segment_ids, config, rt, router=router,
                               num_moe_layers=sum(t.kind == "moe" for t in types), activation=activation)
        aux = {**aux, **moe_aux}
    else:
        h = blocks.mlp(normed, p, rt, "silu")
    return shard(x + h, ("batch", "length", "embed")), aux


def flops_per_token(config, dense_attention: bool = False) -> float:
    return moe.flops_per_token(config, layer_types(config), dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------


def for_kind(names: dict, kind: str) -> dict:
    """Shared HF_NAMES written for kind "decoder", for the layers of another kind."""
    return {k.replace("layers/decoder/", f"layers/{kind}/"): v for k, v in names.items()}


HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    "layers/moe/attn_norm": ("model.layers.{i}.input_layernorm.weight", None),
    "layers/moe/mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", None),
    **for_kind(hf.ATTENTION_NAMES, "moe"),
    "layers/moe/router": ("model.layers.{i}.block_sparse_moe.gate.weight", 1),
    "layers/moe/w_gate": ("model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight", 1),
    "layers/moe/w_up": ("model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight", 1),
    "layers/moe/w_down": ("model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight", 1),
}


def experts_keys(config: dict) -> dict:
    """num_experts and num_experts_per_tok from config.json (num_local_experts, or num_experts as the
    Qwen3-MoE checkpoints name it)."""
    experts = config.get("num_local_experts") if config.get("num_local_experts") is not None \
        else config.get("num_experts")
    if experts is None:
        raise hf.ConversionError("config.json has no 'num_local_experts' (or 'num_experts'), which the model's "
                                 "shape needs")
    return {"num_experts": int(experts), "num_experts_per_tok": int(hf.require(config, "num_experts_per_tok"))}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu"})
    if notes is not None and float(config.get("router_jitter_noise") or 0.0) > 0:
        notes.append(f"router_jitter_noise={config['router_jitter_noise']} (training-time noise on the router "
                     "input) is not implemented; inference is unaffected")
    return {**mistral.from_hf_config(config, notes), **experts_keys(config),
            "base_moe_mlp_dim": -1, "norm_topk_prob": True}


def to_hf_config(keys: dict) -> dict:
    out = {**mistral.to_hf_config(keys), "architectures": [FAMILY.hf_architecture], "model_type": FAMILY.hf_model_types[0],
           "num_local_experts": keys["num_experts"], "num_experts_per_tok": keys["num_experts_per_tok"]}
    if keys["base_moe_mlp_dim"] > 0:
        out["intermediate_size"] = keys["base_moe_mlp_dim"]  # the experts' width; Mixtral has no dense MLP
    return out
