"""Per-layer input embeddings (Gemma 4's "PLE"): beside the residual stream, each layer l reads an input
of its own, P wide, made once from the tokens and their embedding:

    e_l   = E_ple[token, l] * sqrt(P)                       (one [V, L x P] table, layer l's slice)
    c_l   = rmsnorm_P((x0 W_ple) [l] * D ** -0.5) * s        (x0: the scaled token embedding [B, T, D])
    in_l  = (c_l + e_l) * 2 ** -0.5

and adds, after its MLP:  x = x + rmsnorm_D(gelu_tanh(x W_gate) * in_l W_proj) * s_l.

`inputs` builds [L, B, T, P] for the decoder, which hands layer l its slice as inputs.per_layer
(models/contract.FamilyModel.per_layer_inputs); `add` is the layer's part.
"""

from __future__ import annotations

import jax.numpy as jnp

from maxtrain.models import blocks, ops
from maxtrain.models.gemma4.normed_attention import rms
from maxtrain.models.params import ParamSpec, dense


def model_specs(config) -> dict[str, ParamSpec]:
    """The table, the projection of the embedding and its norm (outside the layers)."""
    d, v, width = config.base_emb_dim, config.vocab_size, config.base_num_decoder_layers * config.per_layer_input_dim
    # Rows start at stddev P ** -0.5: times sqrt(P), each layer's slice is of the size of the normed projection.
    return {"ple_embedding": ParamSpec((v, width), ("vocab", "embed"), "normal", config.per_layer_input_dim**-0.5),
            "ple_model_proj": dense((d, width), ("embed", "mlp"), d),
            "ple_proj_norm": ParamSpec((config.per_layer_input_dim,), (None,), "ones")}


def layer_specs(config) -> dict[str, ParamSpec]:
    """Each layer's gate, projection and post-norm."""
    d, w = config.base_emb_dim, config.per_layer_input_dim
    return {"ple_gate": dense((d, w), ("embed", "mlp"), d), "ple_proj": dense((w, d), ("mlp", "embed"), w),
            "ple_norm": ParamSpec((d,), ("embed",), "ones")}


def inputs(params, tokens, x, config, rt):
    """[L, B, T, P]: every layer's input, from tokens [B, T] and the embedding x [B, T, D]."""
    layers, width, eps = config.base_num_decoder_layers, config.per_layer_input_dim, config.normalization_layer_epsilon
    table = blocks.embed(params["ple_embedding"], tokens, rt.dtype, multiplier=width**0.5)
    table = table.reshape(tokens.shape + (layers, width))
    proj = ops.dense(x, params["ple_model_proj"].astype(rt.dtype), backend=rt.backend)  # "BTD,DW->BTW"
    proj = proj * jnp.asarray(config.base_emb_dim**-0.5, proj.dtype)
    proj = rms(proj.reshape(tokens.shape + (layers, width)), eps, params["ple_proj_norm"])
    both = (proj + table) * jnp.asarray(2**-0.5, proj.dtype)
    return jnp.moveaxis(both, 2, 0)


def add(x, p, per_layer, config, rt):
    """The layer's part: x + rmsnorm(gelu_tanh(x W_gate) * input W_proj) * s."""
    gate = ops.dense(x, p["ple_gate"].astype(rt.dtype), backend=rt.backend)  # "BTD,DP->BTP"
    h = blocks.ACTIVATIONS["gelu_tanh"](gate) * per_layer.astype(gate.dtype)
    h = ops.dense(h, p["ple_proj"].astype(rt.dtype), backend=rt.backend)  # "BTP,PD->BTD"
    return x + rms(h, config.normalization_layer_epsilon, p["ple_norm"])
