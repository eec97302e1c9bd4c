"""DeepSeek-V4's attention: shared-KV MQA over a sliding window plus compressed entries, without a cache.

RoPE is interleaved (pairs (2i, 2i+1)) on the trailing rope_dim channels of each head, theta = rope_theta on
sliding-only layers and compress_rope_theta on CSA/HCA layers (and on their compressors and the indexer). The
compressed layers' frequencies may be YaRN-scaled (the released DeepSeek-V4: factor 16 over a 65,536-token
pre-training context; models/rope.py's YaRN over the rope_dim channels), with cos and sin unscaled: the reference's
attention factor is 1 (`frequencies`).

Compressors (per layer, x [B, T, D], windows of m tokens, W = T // m entries; a partial last window is dropped):

    HCA   C = x W_kv^T, Z = x W_z^T + B (B [m, Dh] by slot)
          entry w = kv_norm(sum_j softmax_j(Z[w, j]) * C[w, j])            (softmax per channel over the m slots)
    CSA   C, Z have 2 Dh channels: Ca = [:Dh], Cb = [Dh:]; entry w mixes window w-1's Ca slots with window w's Cb
          slots over 2m slots (window 0's first half has weight 0), then kv_norm.
    both  RoPE (compress theta) at position w m.

Entry w is causal for query t when w < (t + 1) // m. HCA layers see every causal entry. CSA layers see only the
index_topk entries the indexer picks: its own CSA-style compressor at index_head_dim (keys K^I), queries
q^I = q_residual W_qI^T with RoPE at t, and score(t, s) = sum_h (x W_w^T)[h] / sqrt(H_I) * relu(q^I_h . K^I_s) /
sqrt(E); non-causal entries get -inf before top_k, and picks left pointing at them are dropped.

Attention (K = V = kv_norm(x W_kv^T) with RoPE; q = unweighted_rms(q_b(q_a_norm(q_a x))) with RoPE):
    logits over [sliding keys (t - W_sw < s <= t) | visible compressed entries] * Dh^-1/2, a per-head sink
    logit joins the softmax and is dropped; the output's rope slice is rotated back by -t (K = V carried RoPE);
    grouped output projection: heads split into o_groups groups, each [H Dh / g] -> o_lora_rank by its own
    block of o_a_proj, then o_b_proj mixes the g o_lora_rank vector to D.

Packed documents (segment_ids given): each document's compressors pool only its own windows, counted from its start,
its queries read only its own keys and closed entries, and the indexer ranks only those (packed.py); without
segment_ids the row is one document, computed as above."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.models import rope as rope_lib

from . import packed
from .hyper import unweighted_rms


def rms(x, w, eps):
    return unweighted_rms(x, eps) * w.astype(jnp.float32)


def inv_freq(theta, rope_dim):
    return 1.0 / (theta ** (jnp.arange(0, rope_dim, 2, dtype=jnp.float32) / rope_dim))


def frequencies(d, kind):
    """The inverse frequencies [rope_dim / 2] of a layer of `kind`: plain RoPE at rope_theta on sliding-only layers;
    compress_rope_theta on CSA/HCA layers, YaRN-scaled when d.compress_rope_type is 'yarn'."""
    if kind == 'sliding_attention':
        return inv_freq(d.rope_theta, d.rope_dim)
    if d.compress_rope_type == 'default':
        return inv_freq(d.compress_rope_theta, d.rope_dim)
    rope = rope_lib.Rope(theta=d.compress_rope_theta, type=d.compress_rope_type, factor=d.compress_rope_factor,
                         original_max_position_embeddings=d.compress_rope_original_max,
                         beta_fast=d.compress_rope_beta_fast, beta_slow=d.compress_rope_beta_slow, attention_factor=1.0)
    freq, _ = rope_lib.inv_freq(rope, d.rope_dim)
    return jnp.asarray(freq)


def rope(x, pos, freq, sign=1.0):
    """Interleaved RoPE on x's trailing 2 len(freq) channels. x [B, T, .., E]; pos [B, T] (or [1, T])."""
    rd = 2 * freq.shape[0]
    ang = pos.astype(jnp.float32)[..., None] * freq                     # [B, T, R/2]
    while ang.ndim < x.ndim:
        ang = ang[..., None, :]
    cos, sin = jnp.cos(ang), sign * jnp.sin(ang)
    nope, r = x[..., :-rd], x[..., -rd:].astype(jnp.float32)
    r1, r2 = r[..., 0::2], r[..., 1::2]
    out = jnp.stack([r1 * cos - r2 * sin, r2 * cos + r1 * sin], axis=-1).reshape(r.shape)
    return jnp.concatenate([nope, out.astype(x.dtype)], axis=-1)


def _windows(p, x, rate, lay=None):
    kv, gate = x @ p['kv_proj.weight'].T, x @ p['gate_proj.weight'].T
    return windows_of(p, kv, gate, rate) if lay is None else packed.windows(p, kv, gate, lay)


def windows_of(p, kv, gate, rate):
    """Projections [B, T, C] -> [B, T // rate, rate, C] windows, the gate with its slot bias."""
    b, t, _ = kv.shape
    w = t // rate
    return (kv[:, :w * rate].reshape(b, w, rate, -1),
            gate[:, :w * rate].reshape(b, w, rate, -1) + p['position_bias'])


def _finish(p, pooled, rate, freq, eps, entry_pos=None):
    out = rms(pooled, p['kv_norm.weight'], eps)
    pos = jnp.arange(out.shape[1])[None] * rate if entry_pos is None else entry_pos     # [1 or B, W]
    return rope(out, pos, freq)


def hca_compress(p, x, *, rate, freq, eps, lay=None):
    """x [B, T, D] -> [B, T // rate, Dh]. lay: a packed row's packed.Layout (None: one document from 0)."""
    return hca_pool(p, *_windows(p, x, rate, lay), rate=rate, freq=freq, eps=eps,
                    entry_pos=None if lay is None else packed.entry_positions(lay, rate))


def hca_pool(p, kv, gate, *, rate, freq, eps, entry_pos=None):
    return _finish(p, jnp.sum(kv * jax.nn.softmax(gate.astype(jnp.float32), axis=2), axis=2), rate, freq, eps,
                   entry_pos)


def csa_compress(p, x, *, rate, freq, eps, lay=None):
    """x [B, T, D] -> [B, T // rate, E] (E = kv_proj rows / 2), overlapping windows of 2 rate slots. lay: a packed
    row's packed.Layout (None: one document from 0)."""
    if lay is None:
        return csa_pool(p, *_windows(p, x, rate), rate=rate, freq=freq, eps=eps)
    return csa_pool(p, *_windows(p, x, rate, lay), rate=rate, freq=freq, eps=eps,
                    entry_pos=packed.entry_positions(lay, rate), first=packed.first_entries(lay))


def csa_pool(p, kv, gate, *, rate, freq, eps, entry_pos=None, first=None):
    """first [B, W] bool: the entries whose previous window is not their document's (None: entry 0 only)."""
    e = kv.shape[-1] // 2
    prev_kv = jnp.pad(kv[:, :-1, :, :e], ((0, 0), (1, 0), (0, 0), (0, 0)))
    prev_gate = jnp.pad(gate[:, :-1, :, :e], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
    if first is not None:
        prev_kv = jnp.where(first[:, :, None, None], jnp.zeros_like(prev_kv), prev_kv)
        prev_gate = jnp.where(first[:, :, None, None], -jnp.inf, prev_gate)
    kv2 = jnp.concatenate([prev_kv, kv[..., e:]], axis=2)
    gate2 = jnp.concatenate([prev_gate, gate[..., e:]], axis=2)
    return _finish(p, jnp.sum(kv2 * jax.nn.softmax(gate2.astype(jnp.float32), axis=2), axis=2), rate, freq, eps,
                   entry_pos)


def causal_entries(pos, n_entries, rate):
    """[B, T, W] bool: entry w is causal for the query at pos when w < (pos + 1) // rate."""
    return jnp.arange(n_entries) < ((pos + 1) // rate)[..., None]


def indexer_select(p, x, q_residual, pos, *, rate, topk, n_heads, freq, eps, lay=None, visible=None):
    """p: the indexer's weights by transformers' names. -> [B, T, W] bool, the entries each query reads. lay,
    visible: a packed row's packed.Layout and the entries each query may read (None: one document from 0)."""
    keys = csa_compress(p, x, rate=rate, freq=freq, eps=eps, lay=lay)   # [B, W, E]
    return indexer_pick(p, keys, x, q_residual, pos, rate=rate, topk=topk, n_heads=n_heads, freq=freq,
                        visible=visible)


def indexer_pick(p, keys, x, q_residual, pos, *, rate, topk, n_heads, freq, visible=None):
    """keys [B, W, E] the indexer's compressed keys; x [B, T, D]; pos [B, T] -> [B, T, W] bool. visible [B, T, W]:
    the entries each query may read (None: the causal ones); the others never enter the top-k."""
    b, t, _ = x.shape
    w_n = keys.shape[1]
    q = (q_residual @ p['q_b_proj.weight'].T).reshape(b, t, n_heads, -1)
    q = rope(q, pos, freq)
    e = q.shape[-1]
    s = jax.nn.relu(jnp.einsum('bthe,bwe->bthw', q.astype(jnp.float32), keys.astype(jnp.float32))) * e ** -0.5
    hw = (x @ p['scorer.weights_proj.weight'].T).astype(jnp.float32) * n_heads ** -0.5
    score = jnp.einsum('bthw,bth->btw', s, hw)
    causal = causal_entries(pos, w_n, rate) if visible is None else visible
    score = jnp.where(causal, score, -jnp.inf)
    k = min(topk, w_n)
    _, idx = jax.lax.top_k(score, k)
    picked = jnp.sum(jax.nn.one_hot(idx, w_n, dtype=jnp.int32), axis=-2) > 0
    return picked & causal


def grouped_out(o_a, o_b, out, groups):
    """out [B, T, H, Dh] -> [B, T, D]; o_a [g r, H Dh / g] holds each group's block in turn."""
    b, t = out.shape[:2]
    xg = out.reshape(b, t, groups, -1)
    wa = o_a.reshape(groups, -1, xg.shape[-1])
    y = jnp.einsum('btgi,gri->btgr', xg, wa).reshape(b, t, -1)
    return y @ o_b.T


def attention(p, x, pos, kind, d, segment_ids=None, keys_from=None):
    """One layer's attention. p: its weights by transformers' names under self_attn.; x [B, T, D]; pos [B, T];
    kind: 'sliding_attention' | 'compressed_sparse_attention' | 'heavily_compressed_attention'; d: Dims;
    segment_ids [B, T] (0: padding): packed documents, each attending and compressed as if alone (packed.py), pos
    restarting at 0 in each; None: one document. keys_from: (x, pos, segment_ids) of the whole sequence [B, S, ..]
    in its order, whose keys and compressed entries the queries of x read (compressed_context.py: a device's queries
    under context parallelism); None: x, pos and segment_ids themselves."""
    b, t, _ = x.shape
    x_k, pos_k, seg_k = (x, pos, segment_ids) if keys_from is None else keys_from
    freq = frequencies(d, kind)
    q_res = rms(x @ p['q_a_proj.weight'].T, p['q_a_norm.weight'], d.rms_eps).astype(x.dtype)
    q = (q_res @ p['q_b_proj.weight'].T).reshape(b, t, d.num_heads, d.head_dim)
    q = rope(unweighted_rms(q, d.rms_eps).astype(x.dtype), pos, freq)
    kv = rope(rms(x_k @ p['kv_proj.weight'].T, p['kv_norm.weight'], d.rms_eps).astype(x.dtype), pos_k, freq)
    scale = d.head_dim ** -0.5
    logits = jnp.einsum('bthe,bse->bhts', q, kv).astype(jnp.float32) * scale
    qi, ki = pos[:, :, None], pos_k[:, None, :]
    see = (ki <= qi) & (qi - ki < d.sliding_window)
    if segment_ids is not None:
        see = see & packed.same_document(segment_ids, seg_k)
    logits = jnp.where(see[:, None], logits, -jnp.inf)
    keys = kv
    if kind != 'sliding_attention':
        cp = {k[len('compressor.'):]: v for k, v in p.items() if k.startswith('compressor.')}
        rate = d.hca_rate if kind == 'heavily_compressed_attention' else d.csa_rate
        lay = None if segment_ids is None else packed.layout(seg_k, pos_k, rate)
        vis = None if lay is None else packed.visible(lay, segment_ids, pos, rate)
        if kind == 'heavily_compressed_attention':
            comp = hca_compress(cp, x_k, rate=rate, freq=freq, eps=d.rms_eps, lay=lay).astype(x.dtype)
            vis = causal_entries(pos, comp.shape[1], rate) if vis is None else vis
        else:
            comp = csa_compress(cp, x_k, rate=rate, freq=freq, eps=d.rms_eps, lay=lay).astype(x.dtype)
            ip = {k[len('indexer.'):]: v for k, v in cp.items() if k.startswith('indexer.')}
            index_keys = csa_compress(ip, x_k, rate=rate, freq=freq, eps=d.rms_eps, lay=lay)
            vis = indexer_pick(ip, index_keys, x, q_res, pos, rate=rate, topk=d.index_topk, n_heads=d.index_n_heads,
                               freq=freq, visible=vis)
        cl = jnp.einsum('bthe,bwe->bhtw', q, comp).astype(jnp.float32) * scale
        logits = jnp.concatenate([logits, jnp.where(vis[:, None], cl, -jnp.inf)], axis=-1)
        keys = jnp.concatenate([kv, comp], axis=1)
    sink = jnp.broadcast_to(p['sinks'].astype(jnp.float32)[None, :, None, None], (b, d.num_heads, t, 1))
    probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum('bhts,bse->bthe', probs.astype(x.dtype), keys)
    out = rope(out, pos, freq, sign=-1.0)
    return grouped_out(p['o_a_proj.weight'], p['o_b_proj.weight'], out, d.o_groups)
