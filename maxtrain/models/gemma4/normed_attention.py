"""Attention with q, k and v RMS-normed per head, and layers of several head shapes (Gemma 4).

    q = rope(rmsnorm(x W_q) * s_q)        k = rope(rmsnorm(x W_k) * s_k)        v = rmsnorm(x W_v)
    out = softmax(q . k) v W_o            (scores not scaled: the norms fix the queries' and keys' size)

The values are normed without a scale. With `keys_are_values` (Gemma 4's attention_k_eq_v, in its
full-attention layers) the layer has no W_v: the values are the key projection x W_k, normed as values
(no scale, no RoPE). A layer's head dim and kv heads are its parameters' (a family gives its full and
sliding layers stacks of their own shapes, models/layers.LayerType.head_dim); RoPE is the layer type's
table (a "proportional" table leaves the pairs past its fraction unrotated, models/rope.py).

With bidirectional_image_attention the sliding layers' image tokens also see their own image's later tokens
(`_block_attention`): in the banded form (models/attention/image_band.py: blocks of 512 queries, each against
the W - 1 keys behind it and the image_attention_span - 1 ahead) wherever that band is narrower than the sequence,
else in the plain form over the whole [T, T] mask (the reference; the same values).

Decoding: the KV cache holds one head shape for every layer (decoder.init_cache), the largest kv heads and
head dim of any layer (`cache_heads`); a layer writes and reads its own [:G, :H] corner of its slots. A
shared-KV layer writes nothing: it attends to the slots its producer filled, handed on in the layer state.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain.models import attention as attention_lib
from maxtrain.models.attention import image_band
from maxtrain.models import ops
from maxtrain.models import rope as rope_lib
import jax

from maxtrain.models.layers import LayerType
from maxtrain.models.params import ParamSpec, dense
from maxtrain.parallel import sharding
from maxtrain.parallel.sharding import shard

IMAGE_BAND_BLOCK = 512  # queries per step of the banded image attention (models/attention/image_band.py)


def specs(config, head_dim: int, kv_heads: int, values: bool = True, keys: bool = True) -> dict[str, ParamSpec]:
    """One layer's weights: q/k/v/o projections of `head_dim` wide heads (kv_heads of them for k and v; no
    wv when values=False: the keys are the values; no wk, wv, k_norm when keys=False: a shared-KV layer)
    and the q and k norm scales (RMSNorm scale form)."""
    d, n, h = config.base_emb_dim, config.base_num_query_heads, head_dim
    out = {"wq": dense((d, n, h), ("embed", "heads", "head_dim"), d),
           "wo": dense((n, h, d), ("heads", "head_dim", "embed"), n * h),
           "q_norm": ParamSpec((h,), ("head_dim",), "ones")}
    if keys:
        out.update(wk=dense((d, kv_heads, h), ("embed", "kv_heads", "head_dim"), d),
                   k_norm=ParamSpec((h,), ("head_dim",), "ones"))
    if keys and values:
        out["wv"] = dense((d, kv_heads, h), ("embed", "kv_heads", "head_dim"), d)
    return out


def rms(x, eps: float, scale=None):
    """x / rms(x) over the last axis (times `scale` when given), in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jnp.power(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps, -0.5)
    if scale is not None:
        x32 = x32 * scale.astype(jnp.float32)
    return x32.astype(x.dtype)


def attention(x, p, inputs, config, rt, layer: LayerType, shared_kv=None):
    """Self-attention of x [B, T, D] (already normed) -> ([B, T, D], (k, v)), as the module docstring says:
    k and v as attended (normed, k rotated), for a later layer to share. A layer without W_k (a shared-KV
    layer) attends to `shared_kv`, another layer's (k, v)."""
    dt, fp8, eps = rt.dtype, "attention" in rt.fp8, config.normalization_layer_epsilon
    q = ops.dense(x, p["wq"].astype(dt), backend=rt.backend, fp8=fp8)  # "BTD,DNH->BTNH"
    q = rms(checkpoint_name(q, "query_proj"), eps, p["q_norm"])
    cos, sin = inputs.rope[layer.rope] if layer.rope is not None else (None, None)
    if layer.rope is not None:
        q = rope_lib.apply(q, cos, sin)
    if "wk" in p:
        k = ops.dense(x, p["wk"].astype(dt), backend=rt.backend, fp8=fp8)  # "BTD,DGH->BTGH"
        v = ops.dense(x, p["wv"].astype(dt), backend=rt.backend, fp8=fp8) if "wv" in p else k
        k, v = checkpoint_name(k, "key_proj"), checkpoint_name(v, "value_proj")
        k, v = rms(k, eps, p["k_norm"]), rms(v, eps)
        if layer.rope is not None:
            k = rope_lib.apply(k, cos, sin)
    else:
        k, v = shared_kv
    if layer.attention not in ("full", "sliding"):
        raise ValueError(f"the normed attention block has no {layer.attention!r} attention (layer {layer})")
    q = shard(q, ("batch", "length", "heads", "head_dim"))
    if inputs.cache is not None:
        return _decode(q, k, v, p, inputs, rt, layer, fresh=shared_kv is None)
    implementation = rt.attention_for(layer, config.head_dim)  # this layer kind's: Gemma 4's heads differ per kind
    if inputs.blocks is not None and layer.attention == "sliding":
        out = _block_attention(q, k, v, inputs, config, layer, implementation, rt.backend)
    else:
        out = attention_lib.attention(q, k, v, inputs.segment_ids, implementation=implementation,
                                      platform=rt.backend, sliding_window=layer.sliding_window(), scale=1.0,
                                      block_q=config.sa_block_q, block_kv=config.sa_block_kv,
                                      context_strategy=config.context_parallel_strategy,
                                      context_reorder=config.context_parallel_reorder_strategy,
                                      context_inner=config.ici_context_parallelism)
    out = ops.dense(out, p["wo"].astype(dt), 2, backend=rt.backend, fp8=fp8)  # "BTNH,NHD->BTD"
    return checkpoint_name(out, "out_proj"), (k, v)


def _block_attention(q, k, v, inputs, config, layer: LayerType, implementation: str, platform: str):
    """A sliding layer's attention with the image tokens of one block attending to each other both ways (Gemma 4's
    use_bidirectional_attention "vision", as transformers' create_masks_for_vision_model): query t sees key s of
    its segment when (s <= t or both in one block) and t - s < W. Run in the banded form (models/attention/
    image_band.py: blocks of IMAGE_BAND_BLOCK queries, each against its W - 1 keys behind and the
    image_attention_span - 1 ahead, in a checkpointed scan) whenever that band is narrower than the sequence, else
    in the plain-jnp form over the whole [T, T] mask (the reference; the same values). The host refuses an image run
    longer than image_attention_span (families/gemma4: check_image_runs)."""
    if implementation != "dot_product" or sharding.ways("length") > 1:
        raise ValueError(f"bidirectional_image_attention runs with attention=dot_product on one device's whole "
                         f"sequence, not {implementation} (context parallelism: {sharding.ways('length')} ways); set "
                         "attention=dot_product (autoselected picks it for the sliding layers) and "
                         "ici_context_parallelism=1")
    segments, blocks, window = inputs.segment_ids, inputs.blocks, layer.sliding_window()
    on_cpu = attention_lib.canonical_platform(platform or "cpu") == "cpu"
    span = config.image_attention_span
    if image_band.use_band(q.shape[1], window, span, IMAGE_BAND_BLOCK):
        return image_band.image_band_attention(q, k, v, segments, blocks, sliding_window=window, span=span,
                                               block=IMAGE_BAND_BLOCK, scale=1.0, compact_scores=platform == "tpu",
                                               heads_major=on_cpu)
    mask = attention_lib.make_attention_mask(segments, segments, sliding_window=window, q_blocks=blocks,
                                             kv_blocks=blocks)
    return attention_lib.dot_product_attention(q, k, v, mask, scale=1.0, compact_scores=platform == "tpu",
                                               heads_major=on_cpu)


def _decode(q, k, v, p, inputs, rt, layer: LayerType, fresh: bool):
    """Decoding: `fresh` k, v [B, T, G, H] are written into the layer's corner of its cache slots at `index`
    and the filled slots attended to; otherwise k, v are another layer's whole slots [B, S, G, H].
    Returns (out, (k, v) slots attended) with aux-style cache in the second element's place for the stack."""
    cache_k, cache_v, index, first = inputs.cache
    if fresh:
        g, h = k.shape[2:]
        corner_k = jax.lax.dynamic_update_slice_in_dim(cache_k[..., :g, :h], k.astype(cache_k.dtype), index, axis=1)
        corner_v = jax.lax.dynamic_update_slice_in_dim(cache_v[..., :g, :h], v.astype(cache_v.dtype), index, axis=1)
        cache_k, cache_v = cache_k.at[..., :g, :h].set(corner_k), cache_v.at[..., :g, :h].set(corner_v)
        k, v = corner_k, corner_v
    slots = jnp.arange(k.shape[1])[None, None, :]
    t = (index + jnp.arange(q.shape[1]))[None, :, None]
    mask = slots <= t
    if inputs.blocks is not None and layer.attention == "sliding":  # the prompt's image tokens, both ways
        own = jax.lax.dynamic_update_slice_in_dim(jnp.full(k.shape[:2], -1, jnp.int32), inputs.blocks.astype(jnp.int32),
                                                  index, axis=1)  # each slot's block: the prefill's tokens, -1 else
        mask = mask | ((inputs.blocks[:, :, None] == own[:, None, :]) & (inputs.blocks[:, :, None] >= 0))
    if first is not None:
        mask = mask & (slots >= first[:, None, None])
    if layer.sliding_window() > 0:
        mask = mask & (t - slots < layer.sliding_window())
    out = attention_lib.dot_product_attention(q, k.astype(q.dtype), v.astype(q.dtype), mask, scale=1.0)
    out = ops.dense(out, p["wo"].astype(rt.dtype), 2, backend=rt.backend)  # "BTNH,NHD->BTD"
    return out, ((k, v), (cache_k, cache_v))
