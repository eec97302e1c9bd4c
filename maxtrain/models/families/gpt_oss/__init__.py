"""gpt-oss (OpenAI 2025): biased attention with sinks, alternating sliding-window and full layers, and a
mixture of clamped-SwiGLU experts with biases in every layer.

    x = x + attention(rmsnorm(x))     q, k, v = x W + b; out = o W_o + b_o; each head's softmax has one
                                      more logit, its learned sink, in the denominator:
                                      p_s = exp(x_s) / (exp(sink) + sum_s' exp(x_s'))   (models/attention/)
                                      RoPE with YaRN scaling; layer i attends over a sliding window when i
                                      is even (sliding, full, sliding, ...)
    x = x + moe(rmsnorm(x))           logits = x W_r + b_r; w, e = softmax(top_k(logits)) over the K chosen;
                                      expert(x) = down(g * sigmoid(alpha g) * (u + 1)) + b_down with
                                      g = min(x W_g + b_g, limit), u = clip(x W_u + b_u, -limit, limit)
                                      (models/moe/, activation "clamped_swiglu")
    out = rmsnorm(x) @ W_out          untied

Every layer is of kind "moe". Sinks are computed by dot_product attention and the flash and splash
kernels; cuDNN refuses them (models/attention/ KERNEL_LIMITS).
Hugging Face stores each layer's experts fused: gate_up_proj [E, D, 2F] with gate and up interleaved
column by column, down_proj [E, F, D], and their biases; the released checkpoints quantize the experts to
MXFP4, which the import dequantizes (checkpointing/dequantize.py).
"""

from __future__ import annotations

from maxtrain.config import registry
from maxtrain.models import blocks, contract, hf, moe, standard_layers
from maxtrain.models.families.gpt_oss import hf_layouts
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import stacked

FAMILY = registry.FAMILIES["gpt_oss"]  # its Hugging Face model_type and architecture
ROUTER = "topk_softmax"
ACTIVATION = "clamped_swiglu"
_pattern = FAMILY.pattern  # sliding, full, sliding, ... (registry.py)
# transformers' GptOssConfig defaults, read where config.json omits the field
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150000.0


def param_specs(model):
    config = model.config
    layer_specs = standard_layers.decoder_specs(config, mlp=moe.specs(config, biases=True), qkv_bias=True,
                                                out_bias=True, sinks=FAMILY.attention_sinks)
    return {**blocks.embedding_specs(config), "layers": {"moe": stacked(layer_specs, config.base_num_decoder_layers)}}


def layer_types(config) -> list[LayerType]:
    return attention_types(config, _pattern(config.base_num_decoder_layers), kind="moe", mlp="moe")


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    return standard_layers.prenorm_layer(x, p, inputs, layer_type, model, rt, router=ROUTER,
                                         num_moe_layers=config.base_num_decoder_layers, activation=ACTIVATION)


def flops_per_token(model, dense_attention: bool = False) -> float:
    config = model.config
    return moe.flops_per_token(config, model.layer_types, dense_attention)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_EXPERTS = "model.layers.{i}.mlp.experts."
HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    "layers/moe/attn_norm": ("model.layers.{i}.input_layernorm.weight", hf.SAME),
    "layers/moe/mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", hf.SAME),
    **hf.for_kind({**hf.ATTENTION_NAMES, **hf.QKV_BIAS_NAMES}, "moe"),
    "layers/moe/bo": ("model.layers.{i}.self_attn.o_proj.bias", hf.SAME),
    "layers/moe/sinks": ("model.layers.{i}.self_attn.sinks", hf.SAME),
    "layers/moe/router": ("model.layers.{i}.mlp.router.weight", hf.Linear(1)),
    "layers/moe/b_router": ("model.layers.{i}.mlp.router.bias", hf.SAME),
    "layers/moe/w_gate": (_EXPERTS + "gate_up_proj", hf_layouts.Interleaved(0)),
    "layers/moe/w_up": (_EXPERTS + "gate_up_proj", hf_layouts.Interleaved(1)),
    "layers/moe/b_gate": (_EXPERTS + "gate_up_proj_bias", hf_layouts.Interleaved(0)),
    "layers/moe/b_up": (_EXPERTS + "gate_up_proj_bias", hf_layouts.Interleaved(1)),
    "layers/moe/w_down": (_EXPERTS + "down_proj", hf.SAME),
    "layers/moe/b_down": (_EXPERTS + "down_proj_bias", hf.SAME),
}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"attention_bias": True})
    if not (config.get("rope_scaling") or config.get("rope_parameters")):
        config = {**config, "rope_parameters": {**DEFAULT_ROPE, "rope_theta": config.get("rope_theta", DEFAULT_THETA)}}
    keys = {**hf.common_keys(config, rms_norm_eps=1e-5),
            **hf.rope_keys(config, notes, default_theta=DEFAULT_THETA)}
    window = config.get("sliding_window", 128)
    return {**keys, **hf.sliding_keys(config, _pattern(config["num_hidden_layers"]), window),
            **hf.experts_keys(config), "base_moe_mlp_dim": -1, "norm_topk_prob": True,
            "mlp_activations_limit": float(config.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(config.get("swiglu_alpha", 1.702))}


def to_hf_config(keys: dict) -> dict:
    return {**hf.common_config(keys, FAMILY), **hf.rope_config(keys),
            **hf.layer_types_config(keys, _pattern(keys["base_num_decoder_layers"])),
            "intermediate_size": keys["base_moe_mlp_dim"] if keys["base_moe_mlp_dim"] > 0 else keys["base_mlp_dim"],
            "attention_bias": True, "hidden_act": "silu", "num_local_experts": keys["num_experts"],
            "num_experts_per_tok": keys["num_experts_per_tok"], "swiglu_limit": keys["mlp_activations_limit"],
            "swiglu_alpha": keys["swiglu_alpha"]}


MODEL = contract.FamilyModel(
    row=FAMILY, param_specs=param_specs, layer_types=layer_types, embed=standard_layers.embed, layer=layer,
    logits=standard_layers.logits, flops_per_token=flops_per_token, hf_names=HF_NAMES,
    from_hf_config=from_hf_config, to_hf_config=to_hf_config)
