"""Llama 4's text decoder (Meta 2025; Scout and Maverick), shared by the families llama4_text (the language model
alone) and llama4 (the same decoder reading images): interleaved RoPE and NoPE layers, chunked attention, and
mixture-of-experts layers with one shared expert and a sigmoid top-1 router.

    x = x + attention(rmsnorm(x))      grouped-query attention, in two kinds of layer:
                                       RoPE layers: RoPE, then q and k normalized per head without a scale
                                       (use_qk_norm: x / rms(x), its "L2 norm"), attending only within
                                       blocks of chunk_attn_window_size positions (chunked attention)
                                       NoPE layers (every nope_layer_interval-th: 3, 7, ... with 4): no RoPE,
                                       full causal attention, the queries at position p multiplied by
                                       1 + scale x ln(1 + floor((p + 1) / floor_scale)) (temperature_tuning)
    x = x + mlp(rmsnorm(x))            layer i when (i + 1) % decoder_sparse_step == 0 (transformers'
                                       interleave_moe_layer_step): routed experts of width base_moe_mlp_dim,
                                       each token's expert fed sigmoid(its logit) x x (models/moe/topk_sigmoid.py),
                                       plus a shared expert of the same width (shared_experts=1); the other
                                       layers: a dense SwiGLU of width base_mlp_dim (intermediate_size_mlp)
    out = rmsnorm(x) @ W_out           untied

Two layer kinds, "moe" and "dense". Hugging Face stores q and k with RoPE's pairs side by side (it rotates
them as complex numbers) and each layer's experts fused, gate_up_proj [E, D, 2F] (gate, then up): the
import reorders both (hf_layouts.py: PairedRope, Halves).

The families bind these functions into their contract.FamilyModel (to_hf_config takes the family's registry row).
"""

from __future__ import annotations

import jax.numpy as jnp

from maxtrain.models import blocks, hf, moe, standard_layers
from maxtrain.models.llama4 import hf_layouts
from maxtrain.models.layers import LayerType
from maxtrain.parallel.sharding import shard

ROUTER = "topk_sigmoid"
DEFAULT_THETA = 500000.0  # transformers' Llama4TextConfig defaults, read where config.json omits the field
DEFAULTS = {"num_local_experts": 16, "num_experts_per_tok": 1, "intermediate_size_mlp": 16384,
            "interleave_moe_layer_step": 1, "no_rope_layer_interval": 4, "attention_chunk_size": 8192,
            "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}


def uses_rope(config, i: int) -> bool:
    """Layer i rotates by RoPE unless it is a NoPE layer: (i + 1) % nope_layer_interval == 0."""
    return not (config.nope_layer_interval > 0 and (i + 1) % config.nope_layer_interval == 0)


def is_moe_layer(config, i: int) -> bool:
    return (i + 1) % config.decoder_sparse_step == 0


def layer_types(config) -> list[LayerType]:
    chunk, mlp = config.chunk_attn_window_size, "moe+shared" if config.shared_experts > 0 else "moe"
    out = []
    for i in range(config.base_num_decoder_layers):
        rope, moe_layer = uses_rope(config, i), is_moe_layer(config, i)
        out.append(LayerType(kind="moe" if moe_layer else "dense", attention="chunked" if rope and chunk else "full",
                             window=chunk if rope else 0, rope="global" if rope else None,
                             mlp=mlp if moe_layer else "dense"))
    return out


def param_specs(model):
    config = model.config
    per_kind = {"moe": standard_layers.decoder_specs(config, mlp=moe.specs(config)),
                "dense": standard_layers.decoder_specs(config)}
    return {**blocks.embedding_specs(config), "layers": standard_layers.stacks(config, model.layer_types, per_kind)}


def temperature(positions, config):
    """The NoPE layers' query multipliers [B, T] (float32) at positions [B, T]."""
    steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / config.temperature_tuning_floor_scale)
    return 1.0 + config.temperature_tuning_scale * jnp.log1p(steps)


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    eps = config.normalization_layer_epsilon
    rope = layer_type.rope is not None
    scales = temperature(inputs.positions, config) if config.temperature_tuning and not rope else None
    h, aux = blocks.attention(blocks.rms_norm(x, p["attn_norm"], eps), p, inputs, config, rt, layer_type,
                              qk_l2_norm=config.use_qk_norm and rope, query_scales=scales)
    x = shard(x + h, ("batch", "length", "embed"))
    normed = blocks.rms_norm(x, p["mlp_norm"], eps)
    if layer_type.is_moe:  # the routed experts and the shared one (moe.block adds it)
        h, moe_aux = moe.block(normed, p, inputs.segment_ids, config, rt, router=ROUTER,
                               num_moe_layers=model.num_moe_layers, routing=inputs.routing)
        aux = {**aux, **moe_aux}
    else:
        h = blocks.mlp(normed, p, rt, "silu")
    return shard(x + h, ("batch", "length", "embed")), aux


def flops_per_token(model, dense_attention: bool = False) -> float:
    """moe.flops_per_token's count (attention, the router and the K routed experts, dense MLPs) plus the
    shared experts of each MoE layer: 3 x 2 x 3 x D x shared_experts x F_e per token and MoE layer."""
    config = model.config
    types = model.layer_types
    shared = 3 * config.base_emb_dim * config.shared_experts * moe.expert_dim(config)
    return moe.flops_per_token(config, types, dense_attention) + 3.0 * 2 * shared * sum(t.is_moe for t in types)


# --------------------------------------------------------------------------------------------
# Hugging Face
# --------------------------------------------------------------------------------------------

_L = "model.layers.{i}."
_LAYER = {
    "attn_norm": (_L + "input_layernorm.weight", hf.SAME),
    "mlp_norm": (_L + "post_attention_layernorm.weight", hf.SAME),
    "wq": (_L + "self_attn.q_proj.weight", hf_layouts.PairedRope(1)),
    "wk": (_L + "self_attn.k_proj.weight", hf_layouts.PairedRope(1)),
    "wv": (_L + "self_attn.v_proj.weight", hf.Linear(1)),
    "wo": (_L + "self_attn.o_proj.weight", hf.Linear(2)),
}
_F = _L + "feed_forward."
HF_NAMES = {
    **hf.EMBEDDING_NAMES,
    **{f"layers/{kind}/{name}": v for kind in ("moe", "dense") for name, v in _LAYER.items()},
    "layers/dense/w_gate": (_F + "gate_proj.weight", hf.Linear(1)),
    "layers/dense/w_up": (_F + "up_proj.weight", hf.Linear(1)),
    "layers/dense/w_down": (_F + "down_proj.weight", hf.Linear(1)),
    "layers/moe/router": (_F + "router.weight", hf.Linear(1)),
    "layers/moe/w_gate": (_F + "experts.gate_up_proj", hf_layouts.Halves(0)),
    "layers/moe/w_up": (_F + "experts.gate_up_proj", hf_layouts.Halves(1)),
    "layers/moe/w_down": (_F + "experts.down_proj", hf.SAME),
    "layers/moe/shared_gate": (_F + "shared_expert.gate_proj.weight", hf.Linear(1)),
    "layers/moe/shared_up": (_F + "shared_expert.up_proj.weight", hf.Linear(1)),
    "layers/moe/shared_down": (_F + "shared_expert.down_proj.weight", hf.Linear(1)),
}


def _interval(flags: list, layers: int, field: str, what: str) -> int:
    """The n of flags [layers] (1 = the layer has it) that marks every n-th layer (-1: none marked)."""
    for n in [-1, *range(1, layers + 1)]:
        if flags == [int(n > 0 and (i + 1) % n == 0) for i in range(layers)]:
            return n
    raise hf.ConversionError(f"config.json: {field}={flags} is not implemented (maxtrain's Llama 4 decoder has {what} in "
                             "every n-th layer, layers n-1, 2n-1, ...)")


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, {"hidden_act": "silu", "attention_bias": False})
    if notes is not None and float(config.get("router_jitter_noise") or 0.0) > 0:
        notes.append(f"router_jitter_noise={config['router_jitter_noise']} (training-time noise on the router "
                     "input) is not implemented; inference is unaffected")
    c = {**DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    layers = hf.require(c, "num_hidden_layers")
    if "moe_layers" in c:  # as transformers reads it: moe_layers, else every interleave_moe_layer_step-th layer
        moe_layers = list(c["moe_layers"])
    else:
        step = hf.count(c, "interleave_moe_layer_step", DEFAULTS["interleave_moe_layer_step"])
        moe_layers = list(range(step - 1, layers, step))
    step = _interval([int(i in moe_layers) for i in range(layers)], layers, "moe_layers", "experts")
    if step < 0:
        raise hf.ConversionError("config.json: moe_layers=[] (a Llama 4 without experts) is not implemented")
    nope = [1 - int(r) for r in c["no_rope_layers"][:layers]] if c.get("no_rope_layers") else \
        [int((i + 1) % hf.count(c, "no_rope_layer_interval", DEFAULTS["no_rope_layer_interval"]) == 0)
         for i in range(layers)]
    interval = _interval(nope, layers, "no_rope_layers", "no RoPE (0)")
    chunk = int(config.get("attention_chunk_size", DEFAULTS["attention_chunk_size"]) or 0)
    types = ["chunked_attention" if chunk and not n else "full_attention" for n in nope]
    if config.get("layer_types") is not None and list(config["layer_types"]) != types:
        raise hf.ConversionError(f"config.json: layer_types={config['layer_types']} is not implemented (maxtrain's "
                                 "Llama 4 decoder attends in chunks exactly in the RoPE layers, when attention_chunk_size "
                                 "is set)")
    keys = {**hf.common_keys({**c, "intermediate_size": c["intermediate_size_mlp"]}, rms_norm_eps=1e-5),
            **hf.rope_keys(config, notes, default_theta=DEFAULT_THETA), **hf.experts_keys(c)}
    return {**keys, "base_moe_mlp_dim": int(hf.require(c, "intermediate_size")), "shared_experts": 1,
            "decoder_sparse_step": step, "nope_layer_interval": interval, "chunk_attn_window_size": chunk,
            "use_qk_norm": bool(c["use_qk_norm"]), "temperature_tuning": bool(c["attn_temperature_tuning"]),
            "temperature_tuning_scale": float(c["attn_scale"]),
            "temperature_tuning_floor_scale": float(c["floor_scale"])}


def to_hf_config(keys: dict, row) -> dict:
    """config.json of the decoder (a Llama4TextConfig); row: the family's registry row (architecture, model_type)."""
    if keys["shared_experts"] != 1:
        raise hf.ConversionError(f"shared_experts={keys['shared_experts']}: Llama 4 in transformers has exactly one "
                                 "shared expert in each MoE layer; export a model with shared_experts=1")
    layers, step, interval = keys["base_num_decoder_layers"], keys["decoder_sparse_step"], keys["nope_layer_interval"]
    return {**hf.common_config(keys, row), **hf.rope_config(keys), "hidden_act": "silu", "attention_bias": False,
            "intermediate_size": keys["base_moe_mlp_dim"] if keys["base_moe_mlp_dim"] > 0 else keys["base_mlp_dim"],
            "intermediate_size_mlp": keys["base_mlp_dim"], "num_local_experts": keys["num_experts"],
            "num_experts_per_tok": keys["num_experts_per_tok"], "interleave_moe_layer_step": step,
            "moe_layers": list(range(step - 1, layers, step)),
            "no_rope_layers": [int(not (interval > 0 and (i + 1) % interval == 0)) for i in range(layers)],
            "attention_chunk_size": keys["chunk_attn_window_size"] or None, "use_qk_norm": keys["use_qk_norm"],
            "attn_temperature_tuning": keys["temperature_tuning"], "attn_scale": keys["temperature_tuning_scale"],
            "floor_scale": hf.whole(keys["temperature_tuning_floor_scale"])}

