"""Qwen 3 dense models (Yang et al. 2025): Llama's layers with RMSNorm on each query and key head.

    q, k = rmsnorm_H(x W_q), rmsnorm_H(x W_k)     over the head dim H, before RoPE ("qk-norm")

No q/k/v biases (Qwen 2 had them).
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, hf
from maxtrain.models.families import llama, qwen2
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["qwen3"]  # its Hugging Face model_type and architecture

embed = llama.embed
layer = llama.layer  # the attention block applies qk-norm because q_norm and k_norm exist
logits = llama.logits
layer_types = qwen2.layer_types
flops_per_token = qwen2.flops_per_token


def param_specs(config):
    layer_specs = {"attn_norm": blocks.norm_spec(config), **blocks.attention_specs(config, qk_norm="ones"),
                   "mlp_norm": blocks.norm_spec(config), **blocks.mlp_specs(config)}
    return {**blocks.embedding_specs(config),
            "layers": {"decoder": stacked(layer_specs, config.base_num_decoder_layers)}}


HF_NAMES = {**llama.HF_NAMES, **hf.QK_NORM_NAMES}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"attention_bias": False})
    return qwen2.from_hf_config(config, notes)


def to_hf_config(keys: dict) -> dict:
    return {**qwen2.to_hf_config(keys, FAMILY), "attention_bias": False}
