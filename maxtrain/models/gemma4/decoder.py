"""Gemma 4's text decoder (transformers' Gemma4TextModel), shared by the families gemma4_text (Gemma4ForCausalLM)
and gemma4 (Gemma4ForConditionalGeneration, with the vision tower): Gemma 3's pattern of
five sliding-window layers per full-attention one, with

    q, k, v RMS-normed per head (v without a scale) and unscaled scores   (models/gemma4/normed_attention.py)
    full-attention layers of their own head dim (global_head_dim) and kv heads (global_num_kv_heads):
        a parameter stack of their own, kind "full" beside "sliding"
    their RoPE "proportional": the first rope_proportion (0.25) of the frequency pairs rotate, at the
        whole head's frequencies, theta 1M; the sliding layers' the default RoPE at theta 10k
    attention_k_eq_v: the full-attention layers' values are their key projection (no W_v)
    per-layer input embeddings (per_layer_input_dim > 0, models/gemma4/per_layer_embed.py)
    norms in the plain scale form (not Gemma 2/3's 1 + scale); each layer's output times a fixed
    layer_scalar (a buffer in transformers: a fixed parameter here, ParamSpec.fixed: no gradient nor weight decay)

    shared-KV layers: the last num_kv_shared_layers layers (kinds "sliding_shared", "full_shared") have no
        key/value projections and attend to those of the last earlier layer of their attention type,
        handed on through the decoder's layer state; with double_wide_mlp their MLP is twice as wide

    the MoE block (num_experts > 1; enable_moe_block): every layer runs experts beside its dense MLP
        (models/gemma4/moe_parallel.py)

Not implemented, refused at import naming the field: attention biases, use_bidirectional_attention "all",
a per-layer vocabulary other than the main one. "vision" (an image's tokens attending to each other both
ways) is the gemma4 family's bidirectional_image_attention; text alone is causal, as in transformers.
Decoding keeps one cache head shape, the largest (models/gemma4/normed_attention.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from maxtrain.config import registry
from maxtrain.models import blocks, hf, moe, standard_layers
from maxtrain.models.gemma4 import moe_parallel, normed_attention, per_layer_embed
from maxtrain.models.layers import LayerType, attention_types
from maxtrain.models.params import ParamSpec, dense
from maxtrain.parallel.sharding import shard

FAMILY = registry.FAMILIES["gemma4_text"]  # the text model's row: its attention pattern, its HF config
_pattern = FAMILY.pattern


def global_head_dim(config) -> int:
    return config.global_head_dim if config.global_head_dim > 0 else config.head_dim


def global_kv_heads(config) -> int:
    return config.global_num_kv_heads if config.global_num_kv_heads > 0 else config.base_num_kv_heads


KINDS = ("sliding", "full", "sliding_shared", "full_shared")


def layer_types(config) -> list[LayerType]:
    """Kind "sliding" (head_dim, local RoPE) or "full" (global_head_dim, the global RoPE) per layer; the last
    num_kv_shared_layers "sliding_shared" / "full_shared" (no key/value projections of their own)."""
    names = list(config.attention_layer_types) or _pattern(config.base_num_decoder_layers)
    first_shared = len(names) - config.num_kv_shared_layers
    mlp = "moe+shared" if config.num_experts > 1 else "dense"  # experts beside the dense MLP in every layer
    return [dataclasses.replace(t, kind=name + ("_shared" if i >= first_shared else ""),
                                head_dim=global_head_dim(config) if name == "full" else 0, mlp=mlp)
            for i, (t, name) in enumerate(zip(attention_types(config, names), names))]


def _shape(config, kind: str) -> tuple[int, int, int, int]:
    """(head dim, kv heads, key/value projections 0-2, MLP width) of a layer of `kind`."""
    full, shared = kind.startswith("full"), kind.endswith("_shared")
    head_dim, kv_heads = (global_head_dim(config), global_kv_heads(config)) if full else (config.head_dim,
                                                                                          config.base_num_kv_heads)
    projections = 0 if shared else 1 if (full and config.attention_k_eq_v) else 2
    return head_dim, kv_heads, projections, config.base_mlp_dim * (2 if shared and config.double_wide_mlp else 1)


def _layer_specs(config, kind: str) -> dict:
    norm = blocks.norm_spec(config)
    head_dim, kv_heads, projections, f = _shape(config, kind)
    d = config.base_emb_dim
    specs = {"attn_norm": norm, **normed_attention.specs(config, head_dim, kv_heads, values=projections == 2,
                                                         keys=projections > 0),
             "post_attn_norm": norm, "mlp_norm": norm, "w_gate": dense((d, f), ("embed", "mlp"), d),
             "w_up": dense((d, f), ("embed", "mlp"), d), "w_down": dense((f, d), ("mlp", "embed"), f),
             "post_mlp_norm": norm, "layer_scalar": ParamSpec((1,), (None,), "ones", fixed=True)}
    if config.per_layer_input_dim > 0:
        specs.update(per_layer_embed.layer_specs(config))
    if config.num_experts > 1:
        specs.update(moe_parallel.specs(config))
    return specs


def param_specs(model):
    config = model.config
    top = blocks.embedding_specs(config)
    if config.per_layer_input_dim > 0:
        top.update(per_layer_embed.model_specs(config))
    per_kind = {kind: _layer_specs(config, kind) for kind in KINDS}
    return {**top, "layers": standard_layers.stacks(config, model.layer_types, per_kind)}


def layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    eps, attention, aux = config.normalization_layer_epsilon, layer_type.kind.split("_")[0], {}
    shared = None if "wk" in p else inputs.state[attention]
    h, kv = normed_attention.attention(normed_attention.rms(x, eps, p["attn_norm"]), p, inputs, config, rt,
                                       layer_type, shared)
    if inputs.cache is not None:  # decoding: (the slots attended, this layer's cache slots)
        kv, aux["cache"] = kv
    if inputs.state is not None and shared is None:  # the last layer of its type before the shared ones wins
        aux["state"] = {**inputs.state, attention: kv}
    x = shard(x + normed_attention.rms(h, eps, p["post_attn_norm"]), ("batch", "length", "embed"))
    h = blocks.mlp(normed_attention.rms(x, eps, p["mlp_norm"]), p, rt, "gelu_tanh")
    if layer_type.is_moe:
        h, moe_aux = moe_parallel.block(x, h, p, inputs.segment_ids, config, rt, config.base_num_decoder_layers,
                                          inputs.routing)
        aux.update(moe_aux)
    x = x + normed_attention.rms(h, eps, p["post_mlp_norm"])
    if inputs.per_layer is not None:
        x = per_layer_embed.add(x, p, inputs.per_layer, config, rt)
    x = x * jax.lax.stop_gradient(p["layer_scalar"]).astype(x.dtype)  # fixed, as transformers' buffer
    return shard(x, ("batch", "length", "embed")), aux


def per_layer_inputs(params, tokens, x, config, rt):
    return per_layer_embed.inputs(params, tokens, x, config, rt) if config.per_layer_input_dim > 0 else None


def layer_state(x, config, rt, length: int):
    """With shared-KV layers: {attention type: (k, v) [B, length, G, H]} the layers before them leave (length:
    the tokens, or when decoding the cache slots)."""
    if config.num_kv_shared_layers == 0:
        return None
    b, t = x.shape[0], length
    return {kind: tuple(jnp.zeros((b, t, heads, dim), rt.dtype) for _ in range(2))
            for kind, (dim, heads) in (("sliding", (config.head_dim, config.base_num_kv_heads)),
                                       ("full", (global_head_dim(config), global_kv_heads(config))))}


def cache_heads(config):
    """One head shape for every layer's slots: the larger kv heads and head dim (normed_attention._decode)."""
    shape = (max(config.base_num_kv_heads, global_kv_heads(config)), max(config.head_dim, global_head_dim(config)))
    return shape, shape


def flops_per_token(model, dense_attention: bool = False) -> float:
    """3 x (2 x the weights a token multiplies + attention's q.k and p.v), per layer at its own head shape."""
    config = model.config
    d, n, p = config.base_emb_dim, config.base_num_query_heads, config.per_layer_input_dim
    types = model.layer_types
    matmul = d * config.vocab_size + d * p * len(types)  # the head; the per-layer inputs' projection
    for t in types:
        h, g, kv, f = _shape(config, t.kind)
        matmul += 2 * d * n * h + kv * d * g * h + 3 * d * f + 2 * d * p
        if t.is_moe:  # the router and K experts
            matmul += d * config.num_experts + 3 * config.num_experts_per_tok * d * moe.expert_dim(config)
    return 3.0 * (2 * matmul + blocks.attention_flops(config, types, dense_attention))


_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", hf.SAME), "post_attn_norm": ("post_attention_layernorm.weight", hf.SAME),
    "mlp_norm": ("pre_feedforward_layernorm.weight", hf.SAME),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", hf.SAME),
    "wq": ("self_attn.q_proj.weight", hf.Linear(1)), "wk": ("self_attn.k_proj.weight", hf.Linear(1)),
    "wv": ("self_attn.v_proj.weight", hf.Linear(1)),
    "wo": ("self_attn.o_proj.weight", hf.Linear(2)), "q_norm": ("self_attn.q_norm.weight", hf.SAME),
    "k_norm": ("self_attn.k_norm.weight", hf.SAME), "w_gate": ("mlp.gate_proj.weight", hf.Linear(1)),
    "w_up": ("mlp.up_proj.weight", hf.Linear(1)), "w_down": ("mlp.down_proj.weight", hf.Linear(1)),
    "layer_scalar": ("layer_scalar", hf.SAME),
    "ple_gate": ("per_layer_input_gate.weight", hf.Linear(1)),
    "ple_proj": ("per_layer_projection.weight", hf.Linear(1)),
    "ple_norm": ("post_per_layer_input_norm.weight", hf.SAME),
    "dense_post_norm": ("post_feedforward_layernorm_1.weight", hf.SAME),
    "moe_pre_norm": ("pre_feedforward_layernorm_2.weight", hf.SAME),
    "moe_post_norm": ("post_feedforward_layernorm_2.weight", hf.SAME), "router": ("router.proj.weight", hf.Linear(1)),
    "router_scale": ("router.scale", hf.SAME), "expert_scale": ("router.per_expert_scale", hf.SAME),
    "experts_gate_up": ("experts.gate_up_proj", hf.SAME), "experts_down": ("experts.down_proj", hf.SAME),
}
HF_NAMES = {**hf.EMBEDDING_NAMES,
            "ple_embedding": ("model.embed_tokens_per_layer.weight", hf.SAME),
            "ple_model_proj": ("model.per_layer_model_projection.weight", hf.Linear(1)),
            "ple_proj_norm": ("model.per_layer_projection_norm.weight", hf.SAME),
            **{f"layers/{kind}/{name}": (f"model.layers.{{i}}.{hf_name}", n_in)
               for kind in KINDS for name, (hf_name, n_in) in _LAYER_NAMES.items()}}

# config.json fields whose other values maxtrain does not compute (the field names the feature).
_REFUSED = {"attention_bias": False, "hidden_activation": "gelu_pytorch_tanh"}


def from_hf_config(config: dict, notes: list | None = None) -> dict:
    hf.refuse(config, _REFUSED)
    if config.get("use_bidirectional_attention") not in (None, "vision"):
        raise hf.ConversionError(f"use_bidirectional_attention={config['use_bidirectional_attention']!r} (every "
                                 "token attending both ways) is not implemented: maxtrain's gemma4 attention is "
                                 "causal, an image's tokens both ways with 'vision'; use a checkpoint with None or "
                                 "'vision'")
    layers = hf.require(config, "num_hidden_layers")
    names = config.get("layer_types") or ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(layers)]
    names = [*names[:-1], "full_attention"]  # transformers makes the last layer a full-attention one
    head_dim, kv_heads = _full_layer_shape(config, names)
    full, sliding = _rope(config)
    ple = int(config.get("hidden_size_per_layer_input") or 0)
    if ple and config.get("vocab_size_per_layer_input", config.get("vocab_size")) != config.get("vocab_size"):
        raise hf.ConversionError(f"vocab_size_per_layer_input={config['vocab_size_per_layer_input']} differs from "
                                 f"vocab_size={config.get('vocab_size')} (maxtrain's per-layer table has the main "
                                 "vocabulary)")
    keys = {**hf.common_keys(config, tie_word_embeddings=True),
            **hf.rope_keys(config, rope=full, default_theta=1_000_000.0),
            "local_rope_max_timescale": float(sliding.get("rope_theta", 10_000.0))}
    sliding_keys = hf.sliding_keys({**config, "layer_types": names}, _pattern(layers), config.get("sliding_window", 512))
    return {**keys, **sliding_keys, "global_head_dim": head_dim if head_dim != keys["head_dim"] else -1,
            "global_num_kv_heads": kv_heads if kv_heads != keys["base_num_kv_heads"] else -1,
            "attention_k_eq_v": bool(config.get("attention_k_eq_v")), "per_layer_input_dim": ple,
            **_shared_kv_keys(config, names), **_moe_keys(config),
            "final_logits_soft_cap": float(config.get("final_logit_softcapping") or 0.0)}


def _moe_keys(config: dict) -> dict:
    if not config.get("enable_moe_block"):
        return {"num_experts": 1}
    return {"num_experts": hf.require(config, "num_experts"), "num_experts_per_tok": hf.require(config, "top_k_experts"),
            "base_moe_mlp_dim": hf.require(config, "moe_intermediate_size")}


def _shared_kv_keys(config: dict, names: list[str]) -> dict:
    shared = int(config.get("num_kv_shared_layers") or 0)
    if shared and not (shared < len(names) and set(names[len(names) - shared:]) <= set(names[:len(names) - shared])):
        raise hf.ConversionError(f"num_kv_shared_layers={shared}: each shared layer needs an earlier layer of its "
                                 "attention type to share the keys and values of")
    return {"num_kv_shared_layers": shared, "double_wide_mlp": bool(shared and config.get("use_double_wide_mlp"))}


def _full_layer_shape(config: dict, names: list[str]) -> tuple[int, int]:
    """(head dim, kv heads) of the full-attention layers: global_head_dim / num_global_key_value_heads as
    Google's configs state them, or transformers' per_layer_config, which must give every full layer the same."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    per_layer = {int(k): v for k, v in (config.get("per_layer_config") or {}).items()}
    if not per_layer:
        shape = (config.get("global_head_dim") or 512,
                 (config.get("num_global_key_value_heads") or kv_heads) if config.get("attention_k_eq_v") else kv_heads)
        return shape
    shapes = {(v.get("head_dim", head_dim), v.get("num_key_value_heads", kv_heads)) for v in per_layer.values()}
    full = {i for i, n in enumerate(names) if n == "full_attention"}
    if len(shapes) != 1 or set(per_layer) != full:
        raise hf.ConversionError(f"per_layer_config={config['per_layer_config']} does not give every full-attention "
                                 "layer (and only those) one head shape, as maxtrain's two layer stacks need")
    return shapes.pop()


def _rope(config: dict) -> tuple[dict, dict]:
    given = config.get("rope_parameters") or {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
    if not ({"full_attention", "sliding_attention"} >= set(given)) or "full_attention" not in given:
        raise hf.ConversionError(f"rope_parameters={given} is not split by layer type (full_attention, "
                                 "sliding_attention), as Gemma 4 configs are")
    sliding = dict(given.get("sliding_attention") or {"rope_type": "default"})
    if sliding.get("rope_type", "default") != "default" or float(sliding.get("partial_rotary_factor") or 1.0) != 1.0:
        raise hf.ConversionError(f"rope_parameters.sliding_attention={sliding} (maxtrain's local RoPE is the default "
                                 "one of whole heads)")
    return dict(given["full_attention"]), sliding


def to_hf_config(keys: dict) -> dict:
    full_shape = {"head_dim": keys["global_head_dim"] if keys["global_head_dim"] > 0 else keys["head_dim"]}
    if keys["global_num_kv_heads"] > 0:  # transformers reads per_layer_config as given
        full_shape["num_key_value_heads"] = keys["global_num_kv_heads"]
    out = {**hf.common_config(keys, FAMILY), **hf.layer_types_config(keys, _pattern(keys["base_num_decoder_layers"]))}
    local = keys["local_rope_max_timescale"] if keys["local_rope_max_timescale"] > 0 else keys["rope_max_timescale"]
    out.update({
        "per_layer_config": {str(i): full_shape for i, t in enumerate(out["layer_types"]) if t == "full_attention"},
        "rope_parameters": {"full_attention": hf.rope_parameters(keys), "sliding_attention": {"rope_type": "default", "rope_theta": local}},
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False, "attention_k_eq_v": keys["attention_k_eq_v"],
        "hidden_size_per_layer_input": keys["per_layer_input_dim"], "vocab_size_per_layer_input": keys["vocab_size"],
        "num_kv_shared_layers": keys["num_kv_shared_layers"], "enable_moe_block": keys["num_experts"] > 1,
        "use_double_wide_mlp": keys["double_wide_mlp"],
        "final_logit_softcapping": keys["final_logits_soft_cap"] or None})
    if keys["num_experts"] > 1:
        out.update(num_experts=keys["num_experts"], top_k_experts=keys["num_experts_per_tok"],
                   moe_intermediate_size=keys["base_moe_mlp_dim"] if keys["base_moe_mlp_dim"] > 0 else keys["base_mlp_dim"])
    return out

