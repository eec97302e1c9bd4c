"""Multi-head latent attention (MLA; DeepSeek-V2, V3): keys and values from a low-rank latent that the KV
cache holds instead of them, and a RoPE key shared by every head.

    queries    q = W_qb rmsnorm(W_qa x)   [B, T, N, Hn + Hr]   (q_lora_rank > 0; else q = W_q x)
    latent     c, k_r = W_kva x           c [B, T, C] (kv_lora_rank), k_r [B, T, Hr] (qk_rope_head_dim)
               c = rmsnorm(c)
    keys       k = [W_kvb^k c (per head, Hn = qk_nope_head_dim) ; RoPE(k_r) (the same for all heads)]
    values     v = W_kvb^v c              [B, T, N, Hv]         (v_head_dim, not Hn + Hr)
    queries    q = [q_n ; RoPE(q_r)]
    output     W_o attention(q, k, v)     scale (Hn + Hr) ** -0.5, times mscale^2 under YaRN
               (mscale = 0.1 rope_mscale_all_dim ln(rope_factor) + 1, DeepSeek's long-context factor)

Decoding caches c and RoPE(k_r), C + Hr numbers per token and layer (576 for DeepSeek-V3, against
2 x 128 x 192 for its full keys and values), as the decoder's (k, v) cache slots [B, S, 1, C] and
[B, S, 1, Hr] (`cache_heads`), and expands the keys and values from the cached latent at each step:
the same matmuls as the full forward on the same numbers, so greedy decoding equals it.

RoPE on the Hr features: the "rotate half" pairing (x_i, x_{i + Hr/2}), or with rope_interleave the
pairs (x_0, x_1), (x_2, x_3), ... as DeepSeek's checkpoints store them: the features are
de-interleaved (evens, then odds) and rotated by halves, the same on queries and keys, so q.k is
that of the interleaved rotation.

Einsum letters: as blocks.py, and C the latent rank, Q the query rank.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import attention as attention_lib
from maxtrain.models.attention import max_logits
from maxtrain.models.aux_names import MAX_ATTENTION_LOGIT
from maxtrain.models import ops
from maxtrain.models import rope as rope_lib
from maxtrain.models.blocks import LayerInputs, attended_keys, rms_norm
from maxtrain.models.params import ParamSpec, dense
from maxtrain.parallel.sharding import shard


def qk_head_dim(config) -> int:
    return config.qk_nope_head_dim + config.qk_rope_head_dim


def specs(config) -> dict[str, ParamSpec]:
    """One layer's MLA weights. The latent ranks are the up-projections' input axes and shard as `embed`
    does (FSDP): named nothing, wq_b and wkv_b would stay whole on every device under FSDP."""
    d, n, c = config.base_emb_dim, config.base_num_query_heads, config.kv_lora_rank
    hn, hr, hv, q = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.q_lora_rank
    out = {}
    if q > 0:
        out.update(wq_a=dense((d, q), ("embed", None), d), q_a_norm=ParamSpec((q,), (None,), "ones"),
                   wq_b=dense((q, n, hn + hr), ("embed", "heads", "head_dim"), q))
    else:
        out["wq"] = dense((d, n, hn + hr), ("embed", "heads", "head_dim"), d)
    out.update(wkv_a=dense((d, c + hr), ("embed", None), d), kv_a_norm=ParamSpec((c,), (None,), "ones"),
               wkv_b=dense((c, n, hn + hv), ("embed", "heads", "head_dim"), c),
               wo=dense((n, hv, d), ("heads", "head_dim", "embed"), n * hv))
    return out


def cache_heads(config) -> tuple[tuple[int, int], tuple[int, int]]:
    """(heads, width) of the decoder's two cache slots per token: the latent c and the RoPE key."""
    return (1, config.kv_lora_rank), (1, config.qk_rope_head_dim)


def softmax_scale(config) -> float:
    """(Hn + Hr) ** -0.5, times mscale^2 when YaRN extends the context with rope_mscale_all_dim > 0."""
    scale = qk_head_dim(config) ** -0.5
    if config.rope_type != "default" and config.rope_mscale_all_dim > 0 and config.rope_factor > 1:
        scale *= (0.1 * config.rope_mscale_all_dim * math.log(config.rope_factor) + 1.0) ** 2
    return scale


def _rope(x, cos, sin, interleave: bool):
    return rope_lib.apply_interleaved(x, cos, sin) if interleave else rope_lib.apply(x, cos, sin)


def query_latent(x, p, config, rt):
    """MLA's normed low-rank query rmsnorm(W_qa x) [B, T, Q] (q_lora_rank > 0), which the indexer reads too."""
    latent = ops.dense(x, p["wq_a"].astype(rt.dtype), backend=rt.backend, fp8="attention" in rt.fp8)  # "BTD,DQ->BTQ"
    return rms_norm(latent, p["q_a_norm"], config.normalization_layer_epsilon)


def attention(x, p, inputs: LayerInputs, config, rt, *, rope: str = "global", keys_kept=None,
              attention_target=None, selected_keys=None):
    """MLA of x [B, T, D] (already normed) -> ([B, T, D], aux); aux carries the updated cache (c, k_r)
    when decoding, as blocks.attention does. keys_kept (DeepSeek-V3.2's indexer, deepseek/indexer.py):
    (x, q_latent [B, T, Q], (cos, sin), visible) -> the keys each query attends to, [B, T, S] bool, of those
    `visible` lets it see (decoding: the cache slots' mask; None: the causal mask and the documents, as the
    indexer's training passes it); with it, attention is the plain form under that mask. attention_target
    (training the indexer): the visible keys [B, T, S] bool (the causal mask and the documents, by the tokens'
    original indices under context parallelism); aux["attention_target"] is then the attention's distribution over
    them (over keys_kept's where given) summed over heads and normalised, [B, T, S] float32 with no gradient
    (`head_averaged_probabilities`). selected_keys
    (DeepSeek-V3.2 beyond index_topk tokens, training and scoring): (q_nope, q_rope, c [B, S, C], k_r [B, S, Hr],
    q_latent, (cos, sin)) -> (o_c [B, T, N, C], each head's largest logit [N] or None, entries for aux), the
    attention over each query's chosen keys alone in the absorbed form (selected.py); the values are then
    o_c W_kvb^v (the entries: the indexer's KL and the choice handed on, when the sparse stage trains it there)."""
    dt, eps, backend = rt.dtype, config.normalization_layer_epsilon, rt.backend
    fp8 = "attention" in rt.fp8  # quantization: the five projections take float8 operands (models/fp8.py)
    hn, c_rank = config.qk_nope_head_dim, config.kv_lora_rank
    q_latent = None
    if "wq_a" in p:
        q_latent = query_latent(x, p, config, rt)
        q = ops.dense(q_latent, p["wq_b"].astype(dt), backend=backend, fp8=fp8)                           # "BTQ,QNH->BTNH"
    else:
        q = ops.dense(x, p["wq"].astype(dt), backend=backend, fp8=fp8)                                    # "BTD,DNH->BTNH"
    q = checkpoint_name(q, "query_proj")
    latent = ops.dense(x, p["wkv_a"].astype(dt), backend=backend, fp8=fp8)                                # "BTD,DC->BTC"
    c, k_rope = rms_norm(latent[..., :c_rank], p["kv_a_norm"], eps), latent[..., None, c_rank:]
    cos, sin = inputs.rope[rope]
    q = jnp.concatenate([q[..., :hn], _rope(q[..., hn:], cos, sin, config.rope_interleave)], axis=-1)
    k_rope = _rope(k_rope, cos, sin, config.rope_interleave)                                     # [B, T, 1, Hr]
    q = shard(q, ("batch", "length", "heads", "head_dim"))
    aux = {}
    if inputs.cache is not None:  # decoding: write this step's latent and RoPE key, read all slots
        cache_c, cache_r, index, first = inputs.cache
        cache_c = jax.lax.dynamic_update_slice_in_dim(cache_c, c[:, :, None].astype(cache_c.dtype), index, axis=1)
        cache_r = jax.lax.dynamic_update_slice_in_dim(cache_r, k_rope.astype(cache_r.dtype), index, axis=1)
        aux = {"cache": (cache_c, cache_r)}
        c, k_rope = cache_c[:, :, 0].astype(dt), cache_r.astype(dt)
    if selected_keys is not None and inputs.cache is None:
        o_c, head_max, more = selected_keys(q[..., :hn], q[..., hn:], c, k_rope[:, :, 0], q_latent, (cos, sin))
        aux.update(more)
        if config.qk_clip_threshold > 0:  # each head's largest logit (models/qk_clip.py)
            aux[MAX_ATTENTION_LOGIT] = head_max
        out = jnp.einsum("BTNC,CNV->BTNV", o_c, p["wkv_b"][..., hn:].astype(dt))
        out = ops.dense(out, p["wo"].astype(dt), 2, backend=backend, fp8=fp8)                             # "BTNH,NHD->BTD"
        return checkpoint_name(out, "out_proj"), aux
    kv = ops.dense(c, p["wkv_b"].astype(dt), backend=backend, fp8=fp8)                                    # "BSC,CNH->BSNH"
    k_nope, v = kv[..., :hn], kv[..., hn:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:-1] + k_rope.shape[-1:])], axis=-1)
    k, v = checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")
    scale = softmax_scale(config)
    kept = keys_kept(x, q_latent, (cos, sin), None) if inputs.cache is None and keys_kept is not None else None
    if inputs.cache is None and config.qk_clip_threshold > 0:  # each head's largest logit (models/qk_clip.py)
        aux[MAX_ATTENTION_LOGIT] = max_logits.max_logits(q, k, inputs.segment_ids, inputs.positions, scale=scale,
                                                         kept=kept)
    if inputs.cache is None and attention_target is not None:
        mask = kept if kept is not None else attention_target
        aux["attention_target"] = head_averaged_probabilities(q, k, mask, scale)
    if kept is not None:
        out = attention_lib.dot_product_attention(q, k, v, kept, scale=scale)
    elif inputs.cache is None:
        out = attention_lib.attention(q, k, v, inputs.segment_ids, implementation=rt.attention, platform=backend,
                                      scale=scale, block_q=config.sa_block_q, block_kv=config.sa_block_kv,
                                      context_strategy=config.context_parallel_strategy,
                                      context_reorder=config.context_parallel_reorder_strategy,
                                      context_inner=config.ici_context_parallelism)
    else:
        mask = decoding_mask(index, first, q.shape[1], k.shape[1])
        if keys_kept is not None:
            mask = keys_kept(x, q_latent, (cos, sin), mask)
        out = attention_lib.dot_product_attention(q, k, v, mask, scale=scale)
    out = ops.dense(out, p["wo"].astype(dt), 2, backend=backend, fp8=fp8)                                 # "BTNH,NHD->BTD"
    return checkpoint_name(out, "out_proj"), aux


def decoding_mask(index, first, queries: int, slots: int) -> jax.Array:
    """[B, T, S] bool: the cache slots each of the T new queries (the first at slot `index`) sees: causal over the
    slots, and none before first[b] where first is given (a left-padded row, GRPO's rollouts: padding there)."""
    at = jnp.arange(slots)[None, None, :]
    mask = at <= (index + jnp.arange(queries))[None, :, None]
    return mask if first is None else mask & (at >= first[:, None, None])


def head_averaged_probabilities(q, k, mask, scale: float):
    """[B, T, S] float32, no gradient: each query's attention probabilities over the keys `mask` [B, T, S] lets it
    see, averaged over the heads (the heads' sum, normalised to 1 over the keys: DeepSeek-V3.2's target for its
    indexer). Holds [B, N, T, S] float32 while it runs."""
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.where(mask[:, None], logits, -jnp.inf), axis=-1)
    return jnp.mean(jnp.where(mask[:, None], probs, 0.0), axis=1)


def matmul_params(config) -> int:
    """Weights one token multiplies in MLA (the FLOPs' matmul term)."""
    d, n, c = config.base_emb_dim, config.base_num_query_heads, config.kv_lora_rank
    hn, hr, hv, q = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim, config.q_lora_rank
    queries = d * q + q * n * (hn + hr) if q > 0 else d * n * (hn + hr)
    return queries + d * (c + hr) + c * n * (hn + hv) + n * hv * d


def attention_flops(config, num_layers: int, dense: bool = False) -> float:
    """Forward FLOPs per token of q.k (width Hn + Hr) and p.v (width Hv) over `num_layers` causal layers."""
    keys = attended_keys(config.max_target_length, 0, dense)
    return num_layers * 2 * config.base_num_query_heads * (qk_head_dim(config) + config.v_head_dim) * keys
