"""The shared blocks every family composes: norms, embedding, attention, MLPs and the output logits.

Each block is a pure function of (params, inputs, settings). What a block needs from its parameter
dict it reads by name, so a family switches a feature on by declaring the parameter: q/k/v biases
("bq", "bk", "bv"), the output projection's bias ("bo"), qk-norm ("q_norm", "k_norm": of shape [H], a norm
over each head's features; of shape [N, H] / [G, H], one norm over all heads' features together, OLMo 2/3), attention
sinks ("sinks", one logit per query head; models/attention/), an output gate ("wg": each head's output
times sigmoid(x W_g) before the output projection, Qwen3-Next's gated attention).

Einsum letters (as everywhere in maxtrain): B batch, T query length, S key length, D embed,
N query heads, G kv heads, R = N // G, H head dim, F mlp width, V vocab, L layers.

Precision: parameters arrive in `weight_dtype` and are cast to the compute dtype `rt.dtype` at use;
norms, RoPE, softmax and logits are computed in float32.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import attention as attention_lib
from maxtrain.models import layers, ops
from maxtrain.models.attention import max_logits
from maxtrain.models.aux_names import MAX_ATTENTION_LOGIT
from maxtrain.models import rope as rope_lib
from maxtrain.models.layers import LayerType
from maxtrain.models.params import ParamSpec, dense
from maxtrain.parallel.sharding import shard, shard_for_table, shard_like_params


class LayerInputs(NamedTuple):
    """What every layer of one forward pass shares (a pytree, passed through scan and remat)."""

    positions: Any            # [B, T] int32, restarting at 0 in each packed document
    segment_ids: Any          # [B, T] int32, 0 = padding
    rope: dict                # {"global": (cos, sin), "local": (cos, sin)}, each [B, T, H/2] float32
    cache: Any = None         # decoding only: (the layer's cache entries as its family declares them (attention:
                              # k [B, S, G, H], v [B, S, G, H]), index of the first new slot, first slot each
                              # row attends to [B] or None: left-padded prompts)
    per_layer: Any = None     # this layer's own input beside x (contract.FamilyModel.per_layer_inputs), or None
    state: Any = None         # what earlier layers handed on (contract.FamilyModel.layer_state), or None
    routing: Any = None       # a mixture-of-experts layer's replayed experts [B, T, K] int32 (moe.block's routing:
                              # the decoder slices them per layer from the forward's [L_moe, B, T, K]), or None
    blocks: Any = None        # [B, T] int32: runs of tokens that attend to each other both ways, an image's
                              # (contract.Vision.blocks; -1: none), or None: causal


# --------------------------------------------------------------------------------------------
# Declarations
# --------------------------------------------------------------------------------------------


def attention_specs(config, *, qkv_bias: bool = False, qk_norm: str | None = None, out_bias: bool = False,
                    sinks: bool = False, qk_norm_over_heads: bool = False,
                    out_gate: bool = False) -> dict[str, ParamSpec]:
    """One layer's attention weights; qk_norm is None, "ones" (RMSNorm scale) or "zeros" (the 1 + scale form);
    qk_norm_over_heads: the q and k norms span all heads' features ([N, H], [G, H]), not each head's ([H]);
    out_gate: a sigmoid gate on each head's output (Qwen3-Next)."""
    d, n, g, h = config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads, config.head_dim
    specs = {
        "wq": dense((d, n, h), ("embed", "heads", "head_dim"), d),
        "wk": dense((d, g, h), ("embed", "kv_heads", "head_dim"), d),
        "wv": dense((d, g, h), ("embed", "kv_heads", "head_dim"), d),
        "wo": dense((n, h, d), ("heads", "head_dim", "embed"), n * h),
    }
    if qkv_bias:
        specs.update(bq=ParamSpec((n, h), ("heads", "head_dim"), "zeros"),
                     bk=ParamSpec((g, h), ("kv_heads", "head_dim"), "zeros"),
                     bv=ParamSpec((g, h), ("kv_heads", "head_dim"), "zeros"))
    if qk_norm and qk_norm_over_heads:
        specs.update(q_norm=ParamSpec((n, h), ("heads", "head_dim"), qk_norm),
                     k_norm=ParamSpec((g, h), ("kv_heads", "head_dim"), qk_norm))
    elif qk_norm:
        specs.update(q_norm=ParamSpec((h,), ("head_dim",), qk_norm), k_norm=ParamSpec((h,), ("head_dim",), qk_norm))
    if out_bias:
        specs["bo"] = ParamSpec((d,), ("embed",), "zeros")
    if sinks:
        specs["sinks"] = ParamSpec((n,), ("heads",), "zeros")
    if out_gate:
        specs["wg"] = dense((d, n, h), ("embed", "heads", "head_dim"), d)
    return specs


def mlp_specs(config) -> dict[str, ParamSpec]:
    d, f = config.base_emb_dim, config.base_mlp_dim
    return {"w_gate": dense((d, f), ("embed", "mlp"), d), "w_up": dense((d, f), ("embed", "mlp"), d),
            "w_down": dense((f, d), ("mlp", "embed"), f)}


def norm_spec(config, init: str = "ones") -> ParamSpec:
    return ParamSpec((config.base_emb_dim,), ("embed",), init)


def embedding_specs(config, norm_init: str = "ones") -> dict[str, ParamSpec]:
    """Token embedding, final norm and (untied) output projection."""
    d, v = config.base_emb_dim, config.vocab_size
    # A tied embedding is also the output projection, so it starts at the output's scale.
    specs = {"token_embedding": ParamSpec((v, d), ("vocab", "embed"), "normal",
                                          d**-0.5 if config.logits_via_embedding else 1.0),
             "final_norm": norm_spec(config, norm_init)}
    if not config.logits_via_embedding:
        specs["output"] = dense((d, v), ("embed", "vocab"), d)
    return specs


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------


def rms_norm(x, scale, eps: float, plus_one: bool = False):
    """x / rms(x) * scale, in float32; returns x's dtype. plus_one: scale is stored as (scale - 1) (Gemma).
    The rms is over x's last scale.ndim axes (at least one): a scale [N, H] normalizes [..., N, H] over all N * H
    features; a scalar scale (no learned one, Llama 4's L2 qk-norm) over the last axis."""
    x32 = x.astype(jnp.float32)
    axes = tuple(range(-max(jnp.ndim(scale), 1), 0))
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=axes, keepdims=True) + eps)
    scale = scale.astype(jnp.float32)
    return (x32 * (1.0 + scale if plus_one else scale)).astype(x.dtype)


@jax.custom_vjp
def _lookup(table, tokens):
    return jnp.take(table, tokens, axis=0)


def _lookup_fwd(table, tokens):
    return _lookup(table, tokens), (jax.ShapeDtypeStruct(table.shape, table.dtype), tokens)


def _lookup_bwd(residuals, g):
    """The table's gradient, a scatter-add of the rows' gradients, made in the table's own sharding.
    Left to autodiff, the partitioner built it whole on every chip in float32 when the batch splits
    over slices (data parallelism over the DCN): 2 GiB for Llama 3's [128256, 4096], three copies."""
    table, tokens = residuals
    spec = ParamSpec(table.shape, ("vocab", "embed"))
    rows, tokens = shard_for_table(g.astype(table.dtype), tokens)
    zeros = shard_like_params(jnp.zeros(table.shape, table.dtype), spec)
    return shard_like_params(zeros.at[tokens].add(rows), spec), None


_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def embed(table, tokens, dtype, multiplier: float | None = None):
    """Token embeddings [B, T, D]; Gemma multiplies them by sqrt(D), rounded to the compute dtype."""
    x = _lookup(table, tokens).astype(dtype)
    if multiplier is not None:
        x = x * jnp.asarray(multiplier, dtype)
    return shard(x, ("batch", "length", "embed"))


def attention(x, p, inputs: LayerInputs, config, rt, layer: LayerType, *, scale: float | None = None,
              logits_soft_cap: float = 0.0, norm_plus_one: bool = False, qk_l2_norm: bool = False,
              query_scales=None):
    """Self-attention of x [B, T, D] (already normed) -> ([B, T, D], aux), attending as `layer` says
    (full, a sliding window, chunks; RoPE's table and the fraction of each head it rotates, or none).

    Llama 4's options: qk_l2_norm normalizes q and k per head after RoPE, x / rms(x) with no scale (its
    "L2 norm"); query_scales [B, T] multiply each token's queries after that (attention temperature).

    aux is {} in training; when decoding (inputs.cache set) it carries the updated cache as
    {"cache": (k, v)} for the stack to collect.
    """
    dt, fp8 = rt.dtype, "attention" in rt.fp8
    q = ops.dense(x, p["wq"].astype(dt), backend=rt.backend, fp8=fp8)  # "BTD,DNH->BTNH": queries per head
    k = ops.dense(x, p["wk"].astype(dt), backend=rt.backend, fp8=fp8)  # "BTD,DGH->BTGH": keys per kv head
    v = ops.dense(x, p["wv"].astype(dt), backend=rt.backend, fp8=fp8)  # "BTD,DGH->BTGH": values per kv head
    if "bq" in p:
        q, k, v = q + p["bq"].astype(dt), k + p["bk"].astype(dt), v + p["bv"].astype(dt)
    q = checkpoint_name(q, "query_proj")
    k = checkpoint_name(k, "key_proj")
    v = checkpoint_name(v, "value_proj")
    if "q_norm" in p:  # qk-norm before RoPE: RMSNorm over each head's H features (or all heads', q_norm [N, H])
        eps = config.normalization_layer_epsilon
        q, k = rms_norm(q, p["q_norm"], eps, norm_plus_one), rms_norm(k, p["k_norm"], eps, norm_plus_one)
    if layer.rope is not None:
        cos, sin = inputs.rope[layer.rope]
        q, k = rope_lib.apply(q, cos, sin), rope_lib.apply(k, cos, sin)
    if qk_l2_norm:
        eps = config.normalization_layer_epsilon
        q, k = rms_norm(q, jnp.ones((), jnp.float32), eps), rms_norm(k, jnp.ones((), jnp.float32), eps)
    if query_scales is not None:
        q = (q.astype(jnp.float32) * query_scales[:, :, None, None]).astype(q.dtype)
    if layer.attention not in ("full", "sliding", "chunked"):
        raise ValueError(f"the attention block has no {layer.attention!r} attention (layer {layer})")
    sliding_window, chunk = layer.sliding_window(), layer.chunk()
    q = shard(q, ("batch", "length", "heads", "head_dim"))
    sinks = p.get("sinks")  # [N], float32 in the softmax
    if inputs.cache is None:
        implementation = rt.attention_for(layer, config.head_dim)  # this layer kind's (models/runtime.py)
        out = attention_lib.attention(q, k, v, inputs.segment_ids, implementation=implementation, platform=rt.backend,
                                      sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                                      block_q=config.sa_block_q, block_kv=config.sa_block_kv, sinks=sinks,
                                      chunk=chunk, positions=inputs.positions,
                                      context_strategy=config.context_parallel_strategy,
                                      context_reorder=config.context_parallel_reorder_strategy,
                                      context_inner=config.ici_context_parallelism)
        aux = {}
        if config.qk_clip_threshold > 0:  # each head's largest logit, for QK-clip (models/qk_clip.py)
            aux[MAX_ATTENTION_LOGIT] = max_logits.max_logits(
                q, k, inputs.segment_ids, inputs.positions, scale=q.shape[-1] ** -0.5 if scale is None else scale,
                sliding_window=sliding_window, chunk=chunk)
    else:
        # Decoding: write this step's k, v at `index` and attend to the filled cache slots.
        cache_k, cache_v, index, first = inputs.cache
        cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), index, axis=1)
        cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), index, axis=1)
        slots = jnp.arange(cache_k.shape[1])[None, None, :]
        t = (index + jnp.arange(q.shape[1]))[None, :, None]  # the queries' slots
        mask = slots <= t  # [B, T, S]: causal over the slots
        if first is not None:  # a left-padded row: its slots before `first` hold padding
            mask = mask & (slots >= first[:, None, None])
        if sliding_window > 0:
            mask = mask & (t - slots < sliding_window)
        if chunk > 0:  # the slots' positions: slot - first (forward_with_cache), as the queries' positions
            slot_positions = slots - (0 if first is None else first[:, None, None])
            mask = mask & (inputs.positions[:, :, None] // chunk == slot_positions // chunk)
        out = attention_lib.dot_product_attention(q, cache_k.astype(dt), cache_v.astype(dt), mask, scale=scale,
                                                  logits_soft_cap=logits_soft_cap, sinks=sinks)
        aux = {"cache": (cache_k, cache_v)}
    if "wg" in p:  # gated attention: "BTD,DNH->BTNH", each output feature times its sigmoid gate
        gate = ops.dense(x, p["wg"].astype(dt), backend=rt.backend, fp8=fp8)
        out = (out.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)
    out = ops.dense(out, p["wo"].astype(dt), 2, backend=rt.backend, fp8=fp8)  # "BTNH,NHD->BTD"
    if "bo" in p:
        out = out + p["bo"].astype(dt)
    return checkpoint_name(out, "out_proj"), aux


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def mlp(x, p, rt, activation: str = "silu"):
    """Gated MLP: down(act(gate(x)) * up(x)); silu gives SwiGLU (Llama), gelu_tanh GeGLU (Gemma)."""
    dt, fp8 = rt.dtype, "mlp" in rt.fp8
    gate = checkpoint_name(ops.dense(x, p["w_gate"].astype(dt), backend=rt.backend, fp8=fp8), "mlp_gate")  # "BTD,DF->BTF"
    up = checkpoint_name(ops.dense(x, p["w_up"].astype(dt), backend=rt.backend, fp8=fp8), "mlp_up")  # "BTD,DF->BTF"
    hidden = shard(ACTIVATIONS[activation](gate) * up, ("batch", "length", "mlp"))
    down = ops.dense(hidden, p["w_down"].astype(dt), backend=rt.backend, fp8=fp8)  # "BTF,FD->BTD"
    return checkpoint_name(down, "mlp_down")


def logits(params, x, config, rt, *, norm_plus_one: bool = False):
    """float32 logits [B, T, V]: final norm, output projection (or the tied embedding), soft-cap."""
    x = rms_norm(x, params["final_norm"], config.normalization_layer_epsilon, norm_plus_one)
    if config.logits_via_embedding:
        w = params["token_embedding"].astype(rt.dtype).T      # "BTD,VD->BTV"
    else:
        w = params["output"].astype(rt.dtype)                 # "BTD,DV->BTV"
    out = attention_lib.soft_cap(ops.dense(x, w, 1, jnp.float32, rt.backend, fp8="head" in rt.fp8),
                                 config.final_logits_soft_cap)
    return shard(out, ("batch", "length", "vocab"))


# --------------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------------


def attended_keys(length: int, sliding_window: int = 0, dense: bool = False) -> float:
    """Mean number of keys a query attends to in a causal sequence of `length` with a sliding window
    (0: full attention); layers.attended_keys has every attention kind."""
    window = sliding_window if sliding_window > 0 else 0
    return layers.attended_keys(length, LayerType(attention="sliding" if window else "full", window=window), dense)


def attention_flops(config, layer_types, dense: bool = False) -> float:
    """Forward FLOPs per token of the scores (q.k) and the weighted values (p.v), summed over the layers
    `layer_types` (each attends as its type says: full, a sliding window, chunks, or not at all)."""
    n, t = config.base_num_query_heads, config.max_target_length
    return sum(2 * 2 * n * (lt.head_dim or config.head_dim) * layers.attended_keys(t, lt, dense)
               for lt in layer_types)


def dense_layer_matmul_params(config) -> int:
    """Weights one token multiplies in a layer of attention + gated MLP: D*N*H (q) + 2*D*G*H (k, v)
    + N*H*D (out) + 3*D*F (gate, up, down)."""
    d, n, g, h, f = (config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads, config.head_dim,
                     config.base_mlp_dim)
    return d * n * h + 2 * d * g * h + n * h * d + 3 * d * f


def decoder_flops(config, layer_types, dense_attention: bool = False) -> float:
    """Training FLOPs per token of a dense decoder ("model FLOPs": remat recomputation not counted):

        forward  = 2 x (L x dense_layer_matmul_params + D*V)  +  attention_flops
        training = 3 x forward                                 (the backward costs twice the forward)

    Norms, softmax, activations, the embedding lookup and the optimizer are elementwise and left out
    (a few percent of XLA's count for tiny models, far less for large ones)."""
    matmul = config.base_num_decoder_layers * dense_layer_matmul_params(config) + config.base_emb_dim * config.vocab_size
    return 3.0 * (2 * matmul + attention_flops(config, layer_types, dense_attention))
