"""The largest attention logit of each query head, over every (query, key) pair it attends to: what QK-clip
(Kimi K2's MuonClip, models/qk_clip.py) reads after each step.

    S_max[n] = max over b, t and the keys s that query t of row b attends to of  scale * q[b, t, n] . k[b, s, g(n)]

with g(n) = n // R the kv head of query head n (R = N // G). "Attends to" is the model's mask, read from the
tokens' documents and positions rather than their places in the row, so that it holds for rows in any order
(context parallelism's load-balanced layouts): the same document (segment id) and p_s <= p_t; with a sliding
window of W, p_t - p_s < W; with chunks of C, p_t // C == p_s // C. Padding queries (segment 0) count for
nothing. `kept` [B, T, S] (a sparse-attention mask, DeepSeek-V3.2's indexer) replaces that mask when given.

The attention kernels (flash, splash, cuDNN) never hold the logits, so this is its own pass: one more q.k^T per
attention layer, in blocks of `block` queries by `block` keys, so that memory stays at [B, N, block, block]
whatever the length; it runs under stop_gradient and only when qk_clip_threshold > 0. Blocks above the causal
diagonal are computed too (their logits masked), which makes the pass cost what a non-causal q.k^T does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _divisor_block(n: int, target: int) -> int:
    """The largest divisor of n that is at most target."""
    b = min(n, target)
    while n % b:
        b -= 1
    return b


def visible(q_segment_ids, q_positions, k_segment_ids, k_positions, *, sliding_window: int = 0, chunk: int = 0):
    """[B, T, S] bool: query t attends to key s (the module docstring's rule, by documents and positions)."""
    same = (q_segment_ids[:, :, None] == k_segment_ids[:, None, :]) & (q_segment_ids[:, :, None] > 0)
    qp, kp = q_positions[:, :, None], k_positions[:, None, :]
    mask = same & (kp <= qp)
    if sliding_window > 0:
        mask = mask & (qp - kp < sliding_window)
    if chunk > 0:
        mask = mask & (qp // chunk == kp // chunk)
    return mask


def max_logits(q, k, segment_ids, positions, *, scale: float, sliding_window: int = 0, chunk: int = 0,
               kept=None, block: int = 512):
    """[N] float32: each query head's largest attended logit (the module docstring); -inf for a head that
    attends to nothing (a batch of padding). q [B, T, N, H], k [B, S, G, H], segment_ids and positions [B, T]
    (self-attention: the keys are the same tokens)."""
    q, k = jax.lax.stop_gradient(q), jax.lax.stop_gradient(k)
    b, t, n, h = q.shape
    g = k.shape[2]
    q = q.reshape(b, t, g, n // g, h)
    if kept is not None:
        logits = jnp.einsum("btgrh,bsgh->bgrts", q, k, preferred_element_type=jnp.float32) * scale
        kept = kept & (segment_ids > 0)[:, :, None]
        logits = jnp.where(kept[:, None, None], logits, -jnp.inf)
        return jnp.max(logits, axis=(0, 3, 4)).reshape(n)
    bq = _divisor_block(t, block)
    qs = q.reshape(b, t // bq, bq, g, n // g, h).swapaxes(0, 1)               # [T/bq, B, bq, G, R, H]
    ks = k.reshape(b, t // bq, bq, g, h).swapaxes(0, 1)                      # [S/bq, B, bq, G, H]
    seg = segment_ids.reshape(b, t // bq, bq).swapaxes(0, 1)
    pos = positions.reshape(b, t // bq, bq).swapaxes(0, 1)

    def query_block(args):
        q_block, q_seg, q_pos = args

        def key_block(running, key_args):
            k_block, k_seg, k_pos = key_args
            logits = jnp.einsum("btgrh,bsgh->bgrts", q_block, k_block, preferred_element_type=jnp.float32) * scale
            mask = visible(q_seg, q_pos, k_seg, k_pos, sliding_window=sliding_window, chunk=chunk)
            logits = jnp.where(mask[:, None, None], logits, -jnp.inf)
            return jnp.maximum(running, jnp.max(logits, axis=(0, 3, 4))), None

        start = jnp.full((g, n // g), -jnp.inf, jnp.float32)
        return jax.lax.scan(key_block, start, (ks, seg, pos))[0]

    return jnp.max(jax.lax.map(query_block, (qs, seg, pos)), axis=0).reshape(n)
