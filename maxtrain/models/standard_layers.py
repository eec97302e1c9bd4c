"""The decoder layers several families share, so that no family module imports another.

    prenorm_layer    x = x + attention(norm(x)); x = x + mlp(norm(x))        (Llama, Mistral, Qwen 2/3,
                     the MLP a gated MLP or, in a layer whose type says so,     Mixtral, Qwen3-MoE, gpt-oss)
                     a mixture of experts (models/moe/)
    sandwich_layer   x = x + norm(attention(norm(x))); x = x + norm(mlp(norm(x)))   (Gemma 2 and 3): norms
                     in the (1 + scale) form, scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped
    embed, logits    the token embedding (optionally times sqrt(D), Gemma) and the output head
    decoder_specs    one layer's parameters for a pre-norm decoder (attention options passed through)

Each is a pure function of (params, inputs, layer type, config, runtime); a family picks one and says
what differs (a router, an activation, qk-norm by declaring its parameters).
"""

from __future__ import annotations

from maxtrain.models import blocks, moe
from maxtrain.models.layers import LayerType
from maxtrain.models.params import stacked
from maxtrain.parallel.sharding import shard


def embed(params, tokens, config, rt):
    return blocks.embed(params["token_embedding"], tokens, rt.dtype)


def scaled_embed(params, tokens, config, rt):
    """Gemma's embedding: the rows times sqrt(D), rounded to the compute dtype."""
    return blocks.embed(params["token_embedding"], tokens, rt.dtype, multiplier=config.base_emb_dim**0.5)


def logits(params, x, config, rt):
    return blocks.logits(params, x, config, rt)


def plus_one_logits(params, x, config, rt):
    """The head after a final norm in the (1 + scale) form (Gemma)."""
    return blocks.logits(params, x, config, rt, norm_plus_one=True)


def decoder_specs(config, mlp: dict | None = None, **attention) -> dict:
    """One pre-norm layer's parameters: norms, attention (`attention`: blocks.attention_specs' options) and
    `mlp` (default: the gated MLP of base_mlp_dim)."""
    return {"attn_norm": blocks.norm_spec(config), **blocks.attention_specs(config, **attention),
            "mlp_norm": blocks.norm_spec(config), **(blocks.mlp_specs(config) if mlp is None else mlp)}


def stacks(config, types: list[LayerType], per_kind: dict) -> dict:
    """params["layers"]: each kind's layer parameters stacked over the layers of that kind."""
    counts = {kind: sum(t.kind == kind for t in types) for kind in per_kind}
    return {kind: stacked(specs, counts[kind]) for kind, specs in per_kind.items() if counts[kind]}


def prenorm_layer(x, p, inputs, layer_type: LayerType, model, rt, *, router: str = "", num_moe_layers: int = 0,
                  activation: str = "swiglu"):
    """attention then a gated MLP, or a mixture of experts where the layer type's `mlp` is one, each
    pre-normed; `router` and `activation`: the experts' (models/moe/); `num_moe_layers`: over how many
    layers the balance losses are averaged."""
    config = model.config
    eps = config.normalization_layer_epsilon
    h, aux = blocks.attention(blocks.rms_norm(x, p["attn_norm"], eps), p, inputs, config, rt, layer_type)
    x = shard(x + h, ("batch", "length", "embed"))
    normed = blocks.rms_norm(x, p["mlp_norm"], eps)
    if layer_type.is_moe:
        h, moe_aux = moe.block(normed, p, inputs.segment_ids, config, rt, router=router,
                               num_moe_layers=num_moe_layers, activation=activation, routing=inputs.routing)
        aux = {**aux, **moe_aux}
    else:
        h = blocks.mlp(normed, p, rt, "silu")
    return shard(x + h, ("batch", "length", "embed")), aux


def sandwich_specs(config, qk_norm: str | None = None) -> dict:
    """Gemma's layer: pre- and post-norms (the (1 + scale) form: scale 0 is the identity) around each sublayer."""
    norm = blocks.norm_spec(config, "zeros")
    return {"attn_norm": norm, **blocks.attention_specs(config, qk_norm=qk_norm), "post_attn_norm": norm,
            "mlp_norm": norm, **blocks.mlp_specs(config), "post_mlp_norm": norm}


def query_scale(config) -> float:
    """query_pre_attn_scalar ** -0.5 (head_dim when unset): Gemma's score scale."""
    scalar = config.query_pre_attn_scalar if config.query_pre_attn_scalar > 0 else config.head_dim
    return scalar**-0.5


def sandwich_layer(x, p, inputs, layer_type: LayerType, model, rt):
    config = model.config
    eps = config.normalization_layer_epsilon
    h, aux = blocks.attention(blocks.rms_norm(x, p["attn_norm"], eps, plus_one=True), p, inputs, config, rt,
                              layer_type, scale=query_scale(config), logits_soft_cap=config.attn_logits_soft_cap,
                              norm_plus_one=True)
    x = shard(x + blocks.rms_norm(h, p["post_attn_norm"], eps, plus_one=True), ("batch", "length", "embed"))
    h = blocks.mlp(blocks.rms_norm(x, p["mlp_norm"], eps, plus_one=True), p, rt, "gelu_tanh")
    x = x + blocks.rms_norm(h, p["post_mlp_norm"], eps, plus_one=True)
    return shard(x, ("batch", "length", "embed")), aux
