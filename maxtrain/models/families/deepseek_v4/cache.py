"""DeepSeek-V4's decoding cache and its attention over it (the reference form; no paging, no Pallas), shared by the
standalone decoder (decode.py) and the family's layer through maxtrain's shared decoder (models/decoder.py).

Each layer keeps buffers of S slots (`slots`: the decode length rounded up to a multiple of the compress rates),
written at the tokens' positions:
    kv                  [B, S, Dh]      the shared key/value (kv_norm, RoPE) the sliding window reads
    hca_kv, hca_gate    [B, S, Dh]      an HCA layer's compressor's raw projections
    csa_kv, csa_gate    [B, S, 2 Dh]    a CSA layer's (two overlapping halves)
    idx_kv, idx_gate    [B, S, 2 E]     a CSA layer's indexer's
A call writes T tokens (a prompt's prefill, or one token a step) at slots [index, index + T), then its queries
pool every window of the buffers (compressed.hca_pool / csa_pool) and read only the entries closed before them
((pos + 1) // m): an entry the prompt closed is pooled from the prompt's slots, one closed later from the tokens
written since, and slots not yet written never reach a query. The sliding window reads the keys
pos - window < s <= pos. The names differ by kind (shapes differ), so the decoder stacks each over the layers
that have it."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from . import compressed as C
from .hyper import unweighted_rms

NAMES = {'sliding_attention': ('kv',),
         'heavily_compressed_attention': ('kv', 'hca_kv', 'hca_gate'),
         'compressed_sparse_attention': ('kv', 'csa_kv', 'csa_gate', 'idx_kv', 'idx_gate')}


def sub(p, prefix):
    """The entries of p under `prefix`, the prefix dropped."""
    return {k[len(prefix):]: v for k, v in p.items() if k.startswith(prefix)}


def slots(d, max_length: int) -> int:
    """S: max_length rounded up to a multiple of every compress rate the layers use (whole windows to pool)."""
    rates = {'compressed_sparse_attention': d.csa_rate, 'heavily_compressed_attention': d.hca_rate}
    m = math.lcm(1, *(r for kind, r in rates.items() if kind in d.layer_types))
    return -(-max(max_length, 1) // m) * m


def layer_shapes(d, kind: str, batch: int, max_length: int) -> dict:
    """{name: shape} of one layer's buffers, in the order `attention` reads them."""
    s = slots(d, max_length)
    widths = {'kv': d.head_dim, 'hca_kv': d.head_dim, 'hca_gate': d.head_dim, 'csa_kv': 2 * d.head_dim,
              'csa_gate': 2 * d.head_dim, 'idx_kv': 2 * d.index_head_dim, 'idx_gate': 2 * d.index_head_dim}
    return {name: (batch, s, widths[name]) for name in NAMES[kind]}


def init_cache(d, batch, max_length, dtype=jnp.float32):
    """[per layer {name: zeros}]: the standalone decoder's cache (the shared decoder stacks them itself)."""
    return [{name: jnp.zeros(shape, dtype) for name, shape in layer_shapes(d, kind, batch, max_length).items()}
            for kind in d.layer_types]


def _put(buf, index, rows):
    return jax.lax.dynamic_update_slice_in_dim(buf, rows.astype(buf.dtype), index, axis=1)


def _from_first(buf, first):
    """buf [B, S, C] by slot -> by position: row b's slots from first[b] on, zeros past the end (None: as is)."""
    if first is None:
        return buf
    at = jnp.arange(buf.shape[1])[None] + first[:, None]                  # [B, S]
    rows = jnp.take_along_axis(buf, jnp.minimum(at, buf.shape[1] - 1)[..., None], axis=1)
    return jnp.where((at < buf.shape[1])[..., None], rows, jnp.zeros_like(rows))


def attention(p, x, pos, index, kind, c, d, first=None):
    """One layer's attention over its cache. p: its weights under self_attn.; x [B, T, D] the tokens at slots
    [index, index + T) and positions pos [B, T]; c {name: buffer} -> (out [B, T, D], the buffers with the tokens
    written). first [B] (left-padded rows): row b's sequence starts at slot first[b], its positions slot - first[b];
    the slots before it are never read (its windows are pooled from first[b] on). None: every row from slot 0."""
    b, t, _ = x.shape
    freq = C.frequencies(d, kind)
    q_res = C.rms(x @ p['q_a_proj.weight'].T, p['q_a_norm.weight'], d.rms_eps).astype(x.dtype)
    q = (q_res @ p['q_b_proj.weight'].T).reshape(b, t, d.num_heads, d.head_dim)
    q = C.rope(unweighted_rms(q, d.rms_eps).astype(x.dtype), pos, freq)
    kv = C.rope(C.rms(x @ p['kv_proj.weight'].T, p['kv_norm.weight'], d.rms_eps).astype(x.dtype), pos, freq)
    c = dict(c, kv=_put(c['kv'], index, kv))
    keys = c['kv'].astype(x.dtype)
    s = jnp.arange(keys.shape[1])
    scale = d.head_dim ** -0.5
    logits = jnp.einsum('bthe,bse->bhts', q, keys).astype(jnp.float32) * scale
    qi = (index + jnp.arange(t))[None, :, None]                          # the queries' slots
    see = (s <= qi) & (qi - s < d.sliding_window)                       # [1 or B, T, S]
    if first is not None:
        see = see & (s >= first[:, None, None])
    logits = jnp.where(see[:, None], logits, -jnp.inf)
    if kind != 'sliding_attention':
        cp = sub(p, 'compressor.')
        pre = 'hca_' if kind == 'heavily_compressed_attention' else 'csa_'
        c[pre + 'kv'] = _put(c[pre + 'kv'], index, x @ cp['kv_proj.weight'].T)
        c[pre + 'gate'] = _put(c[pre + 'gate'], index, x @ cp['gate_proj.weight'].T)
        rate = d.hca_rate if kind == 'heavily_compressed_attention' else d.csa_rate
        windows = C.windows_of(cp, *(_from_first(c[pre + n], first).astype(x.dtype) for n in ('kv', 'gate')), rate)
        if kind == 'heavily_compressed_attention':
            comp = C.hca_pool(cp, *windows, rate=rate, freq=freq, eps=d.rms_eps).astype(x.dtype)
            vis = C.causal_entries(pos, comp.shape[1], rate)
        else:
            comp = C.csa_pool(cp, *windows, rate=rate, freq=freq, eps=d.rms_eps).astype(x.dtype)
            ip = sub(cp, 'indexer.')
            c['idx_kv'] = _put(c['idx_kv'], index, x @ ip['kv_proj.weight'].T)
            c['idx_gate'] = _put(c['idx_gate'], index, x @ ip['gate_proj.weight'].T)
            iwin = C.windows_of(ip, *(_from_first(c['idx_' + n], first).astype(x.dtype) for n in ('kv', 'gate')), rate)
            ikeys = C.csa_pool(ip, *iwin, rate=rate, freq=freq, eps=d.rms_eps)
            vis = C.indexer_pick(ip, ikeys, x, q_res, pos, rate=rate, topk=d.index_topk, n_heads=d.index_n_heads,
                                 freq=freq)
        cl = jnp.einsum('bthe,bwe->bhtw', q, comp).astype(jnp.float32) * scale
        logits = jnp.concatenate([logits, jnp.where(vis[:, None], cl, -jnp.inf)], axis=-1)
        keys = jnp.concatenate([keys, comp], axis=1)
    sink = jnp.broadcast_to(p['sinks'].astype(jnp.float32)[None, :, None, None], (b, d.num_heads, t, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    out = C.rope(jnp.einsum('bhts,bse->bthe', probs.astype(x.dtype), keys), pos, freq, sign=-1.0)
    return C.grouped_out(p['o_a_proj.weight'], p['o_b_proj.weight'], out, d.o_groups), c
