"""The gated delta rule (Yang, Kautz and Hatamizadeh 2025; Qwen3-Next's and Qwen3.5's linear attention).

Each head keeps a state S [Dk, Dv]. For each token t, with its key k_t, value v_t, query q_t (keys and
queries L2-normalised, queries scaled by Dk ** -0.5: the caller does both), a decay g_t = exp(a_t) in (0, 1]
(a_t = log g_t <= 0) and a write strength beta_t in (0, 1):

    S_t = g_t S_{t-1} + k_t u_t^T,    u_t = beta_t (v_t - g_t S_{t-1}^T k_t)     (correct the decayed state
    o_t = S_t^T q_t                                                                toward v_t at k_t)

`recurrent` runs this token by token (a scan): the reference, O(T) memory, slow on accelerators.

`chunked` computes the same in chunks of C tokens (the WY / UT form). Within a chunk starting from state
S0, with Gamma_t = g_1 ... g_t (cumulative within the chunk), the deltas U [C, Dv] solve one unit-lower-
triangular system and everything else is a matmul:

    (I + L) U = beta V - (beta Gamma K) S0          L[t, j] = beta_t (Gamma_t / Gamma_j) k_t.k_j,  j < t
    O   = (Gamma Q) S0 + (Q K^T * D) U              D[t, j] = Gamma_t / Gamma_j,  j <= t
    S_C = Gamma_C S0 + (K * Gamma_C / Gamma)^T U

The per-chunk parts that do not need S0 (the solve, T V and T K: `unit_lower_solve`, matmuls only) run for
all chunks at once; a scan over the chunks carries the state. Memory is O(T C) per head: no [T, T] array.

Packed documents. `segment_ids` [B, T] (one contiguous run of ids per document, as packing makes them)
restart the state at every document boundary, exactly: pairs (t, j) of different documents are masked out of L and D, and S0 reaches only the tokens whose document began
before the chunk. A padding id (0) is a document of its own; its outputs are garbage that the loss masks.

Precision: the decays are cumulated and compared in log space (Gamma_t / Gamma_j = exp(a-sums), masked
before the exp, so no ratio overflows); everything is computed in float32 (float64 inputs in float64, for
a reference) and the output cast back to the values' dtype.

Einsum letters: B batch, T length, N heads, K key dim (Dk), V value dim (Dv), C chunk, M chunks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _same_segment(segment_ids, length):
    return jnp.ones(length[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)


def recurrent(q, k, v, log_decay, beta, segment_ids=None, initial_state=None):
    """(o [B, T, N, V], final state [B, N, K, V]) of the gated delta rule, one token at a time.

    q, k [B, T, N, K]; v [B, T, N, V]; log_decay (a_t = log g_t <= 0) and beta [B, T, N]; segment_ids
    [B, T] (the state restarts where the id changes); initial_state [B, N, K, V] or None (zeros)."""
    dtype, wide = v.dtype, jnp.promote_types(v.dtype, jnp.float32)  # float32, or float64 for a reference
    q, k, v, log_decay, beta = (x.astype(wide) for x in (q, k, v, log_decay, beta))
    b, t, n, dk = k.shape
    seg = _same_segment(segment_ids, k.shape)
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)  # [B, T]
    state = jnp.zeros((b, n, dk, v.shape[-1]), wide) if initial_state is None else initial_state.astype(wide)
    if initial_state is not None:  # the initial state continues the first token's document
        starts = starts.at[:, 0].set(False)

    def step(s, xs):
        q_t, k_t, v_t, a_t, b_t, start = xs                       # [B, N, K], ..., [B, N], [B]
        g = jnp.where(start[:, None], 0.0, jnp.exp(a_t))[..., None, None]
        s = g * s
        u = b_t[..., None] * (v_t - jnp.einsum("bnkv,bnk->bnv", s, k_t))
        s = s + k_t[..., :, None] * u[..., None, :]
        return s, jnp.einsum("bnkv,bnk->bnv", s, q_t)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, log_decay, beta, starts))
    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1).astype(dtype), state


def chunked(q, k, v, log_decay, beta, segment_ids=None, chunk_size: int = 64, initial_state=None):
    """The same as `recurrent`, computed in chunks of chunk_size tokens (the sequence is padded to a multiple)."""
    dtype, wide = v.dtype, jnp.promote_types(v.dtype, jnp.float32)  # float32, or float64 for a reference
    q, k, v, log_decay, beta = (x.astype(wide) for x in (q, k, v, log_decay, beta))
    b, t, n, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    seg = _same_segment(segment_ids, k.shape)
    first_seg = seg[:, :1]
    if pad:  # padding continues the last document with no decay (a = 0) and no write (k = 0): the state holds
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        q, k, v = jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths)
        log_decay, beta = jnp.pad(log_decay, widths[:3]), jnp.pad(beta, widths[:3])
        seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")
    m = (t + pad) // c

    def chunks(x):  # [B, T, N, ...] -> [B, M, N, C, ...]
        return jnp.moveaxis(x.reshape((b, m, c) + x.shape[2:]), 3, 2)

    q, k, v, a, beta = chunks(q), chunks(k), chunks(v), chunks(log_decay), chunks(beta)   # a, beta [B, M, N, C]
    seg = seg.reshape(b, m, c)
    cum = jnp.cumsum(a, axis=-1)                                          # log Gamma_t within the chunk
    same = (seg[..., :, None] == seg[..., None, :])[:, :, None]            # [B, M, 1, C, C]
    lower = jnp.tril(jnp.ones((c, c), bool))
    # The document of the state entering each chunk: the previous chunk's last token's (the first chunk:
    # the sequence's first document, continued by an initial state when one is given).
    prev_last = jnp.concatenate([first_seg if initial_state is not None else jnp.full_like(first_seg, -2),
                                 seg[:, :-1, -1]], axis=1)                 # [B, M]
    from_state = (seg == prev_last[..., None])[:, :, None]                # [B, M, 1, C]: S0 reaches token t

    ratio = jnp.where(lower & same, cum[..., :, None] - cum[..., None, :], -jnp.inf)
    decay = jnp.exp(ratio)                                                # D [B, M, N, C, C], 0 off the mask
    gamma = jnp.where(from_state, jnp.exp(cum), 0.0)                      # Gamma_t where S0 reaches t
    kk = jnp.einsum("bmntk,bmnsk->bmnts", k, k)
    strict = decay * (1.0 - jnp.eye(c, dtype=wide))
    lmat = beta[..., :, None] * strict * kk                               # L
    # T = (I + L)^-1 applied to [beta V, beta Gamma K], for all chunks at once
    rhs = jnp.concatenate([beta[..., None] * v, (beta * gamma)[..., None] * k], axis=-1)
    solved = unit_lower_solve(lmat, rhs)
    tv, tk = solved[..., :dv], solved[..., dv:]                           # U = tv - tk S0
    qk = jnp.einsum("bmntk,bmnsk->bmnts", q, k) * decay                   # (Q K^T) * D
    last = cum[..., -1:]                                                  # log Gamma_C [B, M, N, 1]
    to_end = jnp.where(same[..., -1, :], jnp.exp(last - cum), 0.0)        # Gamma_C / Gamma_j, same doc as the end
    end_gamma = jnp.where(from_state[..., -1], jnp.exp(last[..., 0]), 0.0)  # Gamma_C where S0 reaches the end

    def step(s, xs):                                                      # s [B, N, K, V]
        q_c, k_c, tv_c, tk_c, qk_c, g_c, to_end_c, end_c = xs
        u = tv_c - jnp.einsum("bntk,bnkv->bntv", tk_c, s)
        o = jnp.einsum("bntk,bnkv->bntv", g_c[..., None] * q_c, s) + jnp.einsum("bnts,bnsv->bntv", qk_c, u)
        s = end_c[..., None, None] * s + jnp.einsum("bntk,bntv->bnkv", to_end_c[..., None] * k_c, u)
        return s, o

    state = jnp.zeros((b, n, dk, dv), wide) if initial_state is None else initial_state.astype(wide)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, tv, tk, qk, gamma, to_end, end_gamma))
    state, o = jax.lax.scan(step, state, xs)                              # o [M, B, N, C, V]
    o = jnp.moveaxis(o, 0, 1)                                             # [B, M, N, C, V]
    o = jnp.moveaxis(o, 2, 3).reshape(b, m * c, n, dv)[:, :t]
    return o.astype(dtype), state


def unit_lower_solve(lmat, rhs):
    """(I + L)^-1 rhs for strictly lower-triangular L [..., C, C]: L is nilpotent (L^C = 0), so
    (I + L)^-1 = (I - L)(I + L^2)(I + L^4) ... up to the power 2^m >= C, exactly: log2(C) squarings of L and as
    many products with rhs, all matmuls. (jax.scipy's triangular solve is a LAPACK call on CPU whose batched form
    deadlocked XLA:CPU's two intra-op threads inside the layer scan at 8k tokens; accelerators prefer matmuls.)"""
    power, out, size = -lmat, rhs, 1
    while size < lmat.shape[-1]:
        out = out + jnp.einsum("...ts,...sv->...tv", power, out)
        size *= 2
        if size < lmat.shape[-1]:
            power = jnp.einsum("...ts,...su->...tu", power, power)
    return out


def flops_per_token(num_heads: int, key_dim: int, value_dim: int, chunk_size: int) -> float:
    """Forward matmul FLOPs per token of `chunked`, per layer (2 per multiply-add). Per head and token:
    the K K^T and Q K^T scores of its chunk (2 C K), the solve (unit_lower_solve: log2(C) products of L's powers
    with the V and K columns, C (V + K) each, and log2(C) - 1 squarings of L, C^2 each), (Q K^T D) U (C V), and
    the state's three products: T K S0, Q S0 and the update (3 K V)."""
    c = chunk_size
    steps = max(1, math.ceil(math.log2(c)))
    solve = steps * c * (value_dim + key_dim) + (steps - 1) * c * c
    per_head = 2 * c * key_dim + solve + c * value_dim + 3 * key_dim * value_dim
    return 2.0 * num_heads * per_head
