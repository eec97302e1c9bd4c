"""DeepSeek-V4 decoding alone, one token a step (the reference form the family's path through maxtrain's shared
decoder is checked beside): the cache and its attention are cache.py's, the layer model.decoder_layer_cached, as
the family's `layer` runs them. init_cache's max_length is rounded up to whole windows (cache.slots)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import compressed as C
from .cache import init_cache, sub
from .hyper import hyper_head
from .model import decoder_layer_cached


def step(p, cache, ids_t, t, d):
    """ids_t [B] the tokens at position t -> (logits [B, V] float32, new cache)."""
    ids = ids_t[:, None]
    x = p['model.embed_tokens.weight'][ids]
    streams = jnp.broadcast_to(x[:, :, None, :], (*ids.shape, d.hc_mult, x.shape[-1]))
    pos = jnp.full(ids.shape, t)
    new = []
    for l, (kind, mlp_kind) in enumerate(zip(d.layer_types, d.mlp_layer_types)):
        streams, c = decoder_layer_cached(sub(p, f'model.layers.{l}.'), streams, ids, pos, t, kind, mlp_kind, d,
                                          cache[l])
        new.append(c)
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
