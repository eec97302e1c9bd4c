"""DeepSeek-V4's decoder layer and whole forward (no cache) over transformers-named weights: the reference form the
parts' tests and the model-level parity test check. Layer l reads params with keys 'model.layers.{l}.…'.

    X = embed(ids) copied into hc_mult streams          [B, T, N, D]
    per layer: (post, comb, h) = attn_hc(X); X = merge(post, comb, attention(input_layernorm(h)), X)
               (post, comb, h) = ffn_hc(X);  X = merge(post, comb, moe(post_attention_layernorm(h), ids), X)
    logits = lm_head(norm(hyper_head(X)))"""

from __future__ import annotations

import jax.numpy as jnp

from . import cache
from .cache import sub
from .compressed import attention, rms
from .hyper import hc_merge, hc_weights, hyper_head
from .routing import moe


def _layer(p, streams, ids, mlp_kind, d, attend, moe_fn=None):
    """attend(attention weights, normed h) -> (out, extra); moe_fn(h, ids, is_hash) -> [B, T, D], when given, runs
    the MoE instead of routing.moe's dense reference form (the family's layer passes the shared MoE block:
    families/deepseek_v4/__init__.py). Returns (streams, extra)."""
    hc = dict(iters=d.hc_iters, hc_eps=d.hc_eps, rms_eps=d.rms_eps)
    post, comb, h = hc_weights(p['attn_hc.fn'], p['attn_hc.base'], p['attn_hc.scale'], streams, **hc)
    a, extra = attend(sub(p, 'self_attn.'), rms(h, p['input_layernorm.weight'], d.rms_eps).astype(h.dtype))
    streams = hc_merge(post, comb, a, streams)
    post, comb, h = hc_weights(p['ffn_hc.fn'], p['ffn_hc.base'], p['ffn_hc.scale'], streams, **hc)
    normed = rms(h, p['post_attention_layernorm.weight'], d.rms_eps).astype(h.dtype)
    if moe_fn is not None:
        m = moe_fn(normed, ids, mlp_kind == 'hash_moe')
    else:
        m = moe(sub(p, 'mlp.'), normed, ids, is_hash=mlp_kind == 'hash_moe', top_k=d.top_k, scaling=d.routed_scaling,
                limit=d.swiglu_limit)
    return hc_merge(post, comb, m, streams), extra


def decoder_layer(p, streams, ids, pos, kind, mlp_kind, d, segment_ids=None, moe_fn=None, attend=attention):
    """One layer over a whole sequence (no cache); moe_fn as `_layer`'s; attend: compressed.attention or a form of
    it with its arguments (compressed_context.attention: the sequence split over the context group)."""
    return _layer(p, streams, ids, mlp_kind, d, lambda ap, h: (attend(ap, h, pos, kind, d, segment_ids), None),
                  moe_fn)[0]


def decoder_layer_cached(p, streams, ids, pos, index, kind, mlp_kind, d, buffers, first=None, moe_fn=None):
    """The layer over tokens at cache slots [index, index + T) (cache.attention; first: left-padded rows' first
    slots): -> (streams, new buffers); moe_fn as `_layer`'s."""
    return _layer(p, streams, ids, mlp_kind, d,
                  lambda ap, h: cache.attention(ap, h, pos, index, kind, buffers, d, first), moe_fn)


def forward(p, ids, d, positions=None, segment_ids=None):
    """p: {transformers' name: array}; ids [B, T] -> logits [B, T, V] (float32). Packed documents: segment_ids
    [B, T] (0: padding) and positions [B, T] restarting at 0 in each (compressed.attention); None: one document."""
    b, t = ids.shape
    x = p['model.embed_tokens.weight'][ids]
    streams = jnp.broadcast_to(x[:, :, None, :], (b, t, d.hc_mult, x.shape[-1]))
    pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t)) if positions is None else positions
    for l, (kind, mlp_kind) in enumerate(zip(d.layer_types, d.mlp_layer_types)):
        streams = decoder_layer(sub(p, f'model.layers.{l}.'), streams, ids, pos, kind, mlp_kind, d, segment_ids)
    h = hyper_head(p['model.hc_head.hc_fn'], p['model.hc_head.hc_base'], p['model.hc_head.hc_scale'], streams,
                   hc_eps=d.hc_eps, rms_eps=d.rms_eps)
    h = rms(h, p['model.norm.weight'], d.rms_eps)
    return (h @ p['lm_head.weight'].T).astype(jnp.float32)
