"""DeepSeek-V4 decoding with a cache, one token a step (the reference form; no paging, no Pallas).

Each layer keeps buffers of max_length slots, written at the token's position:
    kv            [B, S, Dh]      the shared key/value (kv_norm, RoPE) the sliding window reads
    ckv, cgate    [B, S, C]       the compressor's raw projections (CSA: C = 2 Dh, HCA: Dh)
    ikv, igate    [B, S, 2 E]     the indexer's (CSA layers)
A step pools every window of the buffers (compressed.hca_pool / csa_pool) and reads only the entries closed
before the query ((t + 1) // m), so slots not yet written never reach a query; the sliding window reads the keys
t - window < s <= t. max_length must be a multiple of each compress rate (dims.check)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import compressed as C
from .hyper import hc_merge, hc_weights, hyper_head, unweighted_rms
from .model import sub
from .routing import moe


def init_cache(d, batch, max_length, dtype=jnp.float32):
    cache = []
    for kind in d.layer_types:
        c = {'kv': jnp.zeros((batch, max_length, d.head_dim), dtype)}
        if kind != 'sliding_attention':
            width = 2 * d.head_dim if kind == 'compressed_sparse_attention' else d.head_dim
            c['ckv'] = c['cgate'] = jnp.zeros((batch, max_length, width), dtype)
        if kind == 'compressed_sparse_attention':
            c['ikv'] = c['igate'] = jnp.zeros((batch, max_length, 2 * d.index_head_dim), dtype)
        cache.append(c)
    return cache


def _put(buf, t, row):
    return jax.lax.dynamic_update_slice_in_dim(buf, row[:, None].astype(buf.dtype), t, axis=1)


def attention_step(p, x, t, kind, c, d):
    """x [B, 1, D] the token at position t; c: the layer's buffers -> (out [B, 1, D], new buffers)."""
    b = x.shape[0]
    pos = jnp.full((b, 1), t)
    freq = C.frequencies(d, kind)
    q_res = C.rms(x @ p['q_a_proj.weight'].T, p['q_a_norm.weight'], d.rms_eps).astype(x.dtype)
    q = (q_res @ p['q_b_proj.weight'].T).reshape(b, 1, d.num_heads, d.head_dim)
    q = C.rope(unweighted_rms(q, d.rms_eps).astype(x.dtype), pos, freq)
    kv = C.rope(C.rms(x @ p['kv_proj.weight'].T, p['kv_norm.weight'], d.rms_eps).astype(x.dtype), pos, freq)
    c = dict(c, kv=_put(c['kv'], t, kv[:, 0]))
    keys = c['kv']
    s = jnp.arange(keys.shape[1])
    scale = d.head_dim ** -0.5
    logits = jnp.einsum('bthe,bse->bhts', q, keys).astype(jnp.float32) * scale
    see = (s <= t) & (t - s < d.sliding_window)
    logits = jnp.where(see[None, None, None], logits, -jnp.inf)
    if kind != 'sliding_attention':
        cp = sub(p, 'compressor.')
        c['ckv'] = _put(c['ckv'], t, (x @ cp['kv_proj.weight'].T)[:, 0])
        c['cgate'] = _put(c['cgate'], t, (x @ cp['gate_proj.weight'].T)[:, 0])
        rate = d.hca_rate if kind == 'heavily_compressed_attention' else d.csa_rate
        windows = C.windows_of(cp, c['ckv'], c['cgate'], rate)
        if kind == 'heavily_compressed_attention':
            comp = C.hca_pool(cp, *windows, rate=rate, freq=freq, eps=d.rms_eps).astype(x.dtype)
            vis = C.causal_entries(pos, comp.shape[1], rate)
        else:
            comp = C.csa_pool(cp, *windows, rate=rate, freq=freq, eps=d.rms_eps).astype(x.dtype)
            ip = sub(cp, 'indexer.')
            c['ikv'] = _put(c['ikv'], t, (x @ ip['kv_proj.weight'].T)[:, 0])
            c['igate'] = _put(c['igate'], t, (x @ ip['gate_proj.weight'].T)[:, 0])
            ikeys = C.csa_pool(ip, *C.windows_of(ip, c['ikv'], c['igate'], rate), rate=rate, freq=freq,
                               eps=d.rms_eps)
            vis = C.indexer_pick(ip, ikeys, x, q_res, pos, rate=rate, topk=d.index_topk, n_heads=d.index_n_heads,
                                 freq=freq)
        cl = jnp.einsum('bthe,bwe->bhtw', q, comp).astype(jnp.float32) * scale
        logits = jnp.concatenate([logits, jnp.where(vis[:, None], cl, -jnp.inf)], axis=-1)
        keys = jnp.concatenate([keys, comp], axis=1)
    sink = jnp.broadcast_to(p['sinks'].astype(jnp.float32)[None, :, None, None], (b, d.num_heads, 1, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    out = C.rope(jnp.einsum('bhts,bse->bthe', probs.astype(x.dtype), keys), pos, freq, sign=-1.0)
    return C.grouped_out(p['o_a_proj.weight'], p['o_b_proj.weight'], out, d.o_groups), c


def step(p, cache, ids_t, t, d):
    """ids_t [B] the tokens at position t -> (logits [B, V] float32, new cache)."""
    ids = ids_t[:, None]
    x = p['model.embed_tokens.weight'][ids]
    streams = jnp.broadcast_to(x[:, :, None, :], (*ids.shape, d.hc_mult, x.shape[-1]))
    hc = dict(iters=d.hc_iters, hc_eps=d.hc_eps, rms_eps=d.rms_eps)
    new = []
    for l, (kind, mlp_kind) in enumerate(zip(d.layer_types, d.mlp_layer_types)):
        lp = sub(p, f'model.layers.{l}.')
        post, comb, h = hc_weights(lp['attn_hc.fn'], lp['attn_hc.base'], lp['attn_hc.scale'], streams, **hc)
        a, c = attention_step(sub(lp, 'self_attn.'), C.rms(h, lp['input_layernorm.weight'], d.rms_eps).astype(h.dtype),
                              t, kind, cache[l], d)
        new.append(c)
        streams = hc_merge(post, comb, a, streams)
        post, comb, h = hc_weights(lp['ffn_hc.fn'], lp['ffn_hc.base'], lp['ffn_hc.scale'], streams, **hc)
        m = moe(sub(lp, 'mlp.'), C.rms(h, lp['post_attention_layernorm.weight'], d.rms_eps).astype(h.dtype), ids,
                is_hash=mlp_kind == 'hash_moe', top_k=d.top_k, scaling=d.routed_scaling, limit=d.swiglu_limit)
        streams = hc_merge(post, comb, m, streams)
    h = hyper_head(p['model.hc_head.hc_fn'], p['model.hc_head.hc_base'], p['model.hc_head.hc_scale'], streams,
                   hc_eps=d.hc_eps, rms_eps=d.rms_eps)
    h = C.rms(h, p['model.norm.weight'], d.rms_eps)
    return (h @ p['lm_head.weight'].T).astype(jnp.float32)[:, 0], new


def greedy(p, prompt, n_new, d, max_length):
    """prompt [B, P] -> [B, P + n_new]: the prompt fed one token a step, then n_new argmax tokens."""
    cache = init_cache(d, prompt.shape[0], max_length)
    run = jax.jit(step, static_argnums=(4,))
    tokens = [prompt[:, i] for i in range(prompt.shape[1])]
    for t in range(prompt.shape[1] + n_new - 1):
        logits, cache = run(p, cache, tokens[t], t, d)
        if t + 1 >= len(tokens):
            tokens.append(jnp.argmax(logits, axis=-1).astype(prompt.dtype))
    return jnp.stack(tokens, axis=1)
