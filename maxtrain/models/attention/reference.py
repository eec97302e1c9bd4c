"""Attention's masks and the plain-jnp reference every kernel is checked against, with the reference's CPU forms
(query chunks, checkpointed sub-chunks past 8k tokens). Shapes and the masking rule: the package's docstring
(models/attention/__init__.py), which re-exports everything here."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


# Finite "minus infinity": keeps exp() at exactly 0 without producing NaN in fully masked rows.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def make_attention_mask(q_segment_ids, kv_segment_ids, *, causal: bool = True, q_offset=0, sliding_window: int = 0,
                        chunk: int = 0, q_positions=None, kv_positions=None, q_blocks=None, kv_blocks=None):
    """Boolean mask [B, T, S]: True where query t may attend to key s.

    q_offset shifts query indices (a query block that starts at q_offset in the key sequence).
    sliding_window > 0 also hides keys that are sliding_window or more positions back: t - s < W
    (as Hugging Face's sliding-window masks), so each query sees at most W keys, itself included.
    chunk > 0 also hides keys of another block of `chunk` positions (q_positions [B, T] and
    kv_positions [B, S]; the indices when not given): the direct form of chunked attention.
    q_blocks [B, T] and kv_blocks [B, S] (causal only): a query also sees the later keys of its own block (ids >= 0;
    -1: none), as an image's tokens attend to each other both ways (Gemma 4's use_bidirectional_attention "vision",
    transformers' blockwise overlay); the window and the segments still apply.
    """
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    t = jnp.arange(q_segment_ids.shape[1])[:, None] + q_offset
    s = jnp.arange(kv_segment_ids.shape[1])[None, :]
    if causal:
        allowed = (s <= t)[None]
        if q_blocks is not None:
            allowed = allowed | ((q_blocks[:, :, None] == kv_blocks[:, None, :]) & (q_blocks[:, :, None] >= 0))
        mask = mask & allowed
    if sliding_window > 0:
        mask = mask & (t - s < sliding_window)[None]
    if chunk > 0:
        qp = t[None, :, 0] if q_positions is None else q_positions
        kp = s[None, 0, :] if kv_positions is None else kv_positions
        mask = mask & (qp[:, :, None] // chunk == kp[:, None, :] // chunk)
    return mask


def chunk_segment_ids(segment_ids, positions, chunk: int):
    """Segment ids [B, T] refined so that each block of `chunk` positions of a segment is a segment of its
    own: a new id starts where the segment changes or a position is a multiple of `chunk`. Masking by
    them (same id, causal) is chunked attention (the module docstring); ids stay non-decreasing along T."""
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], dtype=bool),
                              segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    starts = starts | (positions % chunk == 0)
    return jnp.cumsum(starts.astype(jnp.int32), axis=1)


def chunk_ids_elementwise(segment_ids, positions, chunk: int):
    """chunk_segment_ids token by token, for tokens in any order (context parallelism's layout): segment s,
    position p -> s (max p // chunk + 1) + p // chunk. Positions restart in each document, so two tokens of a row
    share an id exactly when they share a segment and a block of `chunk` positions (padding sees only padding)."""
    blocks = positions // chunk
    return segment_ids * (jnp.max(blocks) + 1) + blocks


def soft_cap(x, cap: float):
    """cap * tanh(x / cap): squashes x smoothly into (-cap, cap); cap <= 0 leaves x unchanged (Gemma 2)."""
    return cap * jnp.tanh(x / cap) if cap > 0 else x


def dot_product_attention(q, k, v, mask, *, scale: float | None = None, logits_soft_cap: float = 0.0,
                          compact_scores: bool = False, heads_major: bool = False, sinks=None):
    """Reference attention in plain jnp; softmax in float32, output in q.dtype.

    mask: boolean, broadcastable to [B, T, S]. scores = soft_cap(q.k * scale, logits_soft_cap) with
    scale defaulting to H ** -0.5 (Gemma's query_pre_attn_scalar changes it).

    sinks [N] (gpt-oss): a learned logit per query head, one more column of each softmax that no
    value row follows, p_s = exp(x_s) / (exp(sink) + sum_s' exp(x_s')): a query may give part of its
    attention to nothing. Computed with float32 scores (compact_scores is not used with sinks).

    Memory: the [B, G, R, T, S] scores and probabilities are the largest arrays of a training step
    at long sequences. compact_scores=True with bfloat16 or float16 inputs: the q.k matmul
    (accumulating in float32) writes its scores in that dtype and the probabilities are kept in
    it, as MaxText's dot-product attention does, while the softmax and its gradient are computed
    in float32 from them (`_probabilities`). XLA's TPU compiler then stores no float32 T x S array
    (Llama 3 8B at 8192 on v5p-128: 4 GiB less per chip); its GPU compiler writes the float32
    softmax out and needs more (8 x H100: 50.8 against 42.8 GiB), so attention() asks for compact
    scores on TPUs only (docs/scale.md). Otherwise scores and softmax are float32.

    heads_major=True computes in the layout [B, G, R*T, H] (the R query heads of a kv head stacked
    along T) instead of [B, T, G, R, H]: one plain batched matmul per (sequence, kv head) with the
    transposes on q, k, v and the output rather than on the T x S arrays. Same values; attention()
    uses it on CPU, where XLA ran one layer's attention of the reference model (docs/performance.md),
    forward and backward, in about a quarter less time in it.
    """
    b, t, n, h = q.shape
    g = k.shape[2]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({g})")
    r = n // g  # R = N // G query heads per kv head
    dtype = q.dtype
    scale = h**-0.5 if scale is None else scale
    mask = mask.reshape((1,) * (3 - mask.ndim) + mask.shape)  # [B or 1, T, S]
    if heads_major:  # [B, G, R*T, H]: the R query heads of a kv head stacked along T (see the docstring)
        q = q.reshape(b, t, g, r, h).transpose(0, 2, 3, 1, 4).reshape(b, g, r * t, h)
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
        mask = jnp.broadcast_to(mask[:, None, None], (mask.shape[0], 1, r) + mask.shape[1:])
        mask = mask.reshape(mask.shape[0], 1, r * t, mask.shape[-1])
        scores_eq, out_eq = "BGTH,BGSH->BGTS", "BGTS,BGSH->BGTH"
    else:
        q, mask = q.reshape(b, t, g, r, h), mask[:, None, None, :, :]
        scores_eq, out_eq = "BTGRH,BSGH->BGRTS", "BGRTS,BSGH->BTGRH"
    compact = compact_scores and dtype in (jnp.bfloat16, jnp.float16) and sinks is None
    if compact:
        scores = jnp.einsum(scores_eq, q, k, preferred_element_type=dtype)
        probs = _probabilities(scores, mask, scale, logits_soft_cap)
    else:
        scores = jnp.einsum(scores_eq, q, k, preferred_element_type=jnp.float32)
        scores = soft_cap(scores * scale, logits_soft_cap)
        if sinks is None:
            probs = jax.nn.softmax(jnp.where(mask, scores, _MASK_VALUE), axis=-1)
        else:  # the sink of query head n = g * R + r, as a column beside each row of scores
            sink = sinks.astype(jnp.float32).reshape(g, r)
            sink = jnp.repeat(sink, t, axis=1)[None, :, :, None] if heads_major else sink[None, :, :, None, None]
            probs = softmax_with_sink(jnp.where(mask, scores, _MASK_VALUE), sink)
    # With compact scores the product is written in the 16-bit dtype (it accumulates in float32 and is
    # rounded once, as the .astype below would): its gradient with respect to the probabilities is
    # then a 16-bit T x S array too, not a float32 one.
    out = jnp.einsum(out_eq, probs.astype(v.dtype), v, preferred_element_type=dtype if compact else jnp.float32)
    hv = v.shape[-1]  # the value head dim may differ from the query/key one (MLA)
    if heads_major:
        out = out.reshape(b, g, r, t, hv).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, n, hv).astype(dtype)


def softmax_with_sink(logits, sink):
    """softmax over the last axis of logits with one more logit `sink` (broadcast to logits[..., :1])
    in the denominator only: exp(x_s) / (exp(sink) + sum_s' exp(x_s'))."""
    peak = jax.lax.stop_gradient(jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink))
    e = jnp.exp(logits - peak)
    return e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - peak))


def causal_chunks(q, k, v, segment_ids, *, sliding_window: int = 0, scale: float | None = None,
                  logits_soft_cap: float = 0.0, max_chunks: int = 8, min_chunk: int = 128, long_from: int = 8192,
                  long_chunk: int = 512, sinks=None):
    """Causal self-attention in query chunks, each against only the keys its queries can see.

    The T queries are cut into n = min(max_chunks, T // min_chunk) chunks (at least one) of near-equal
    size; the chunk of queries [start, end) attends to keys [0, end), or with a sliding window W to
    [start - W + 1, end). Its q.k and probs.v matmuls skip the keys every query of the chunk masks:
    (n + 1) / 2n of the whole T x S work (3/4 with 2 chunks, 9/16 with 8), and the scores and
    probabilities shrink alike. Same values as one dot_product_attention over the whole mask (no key a
    query can see is left out of its chunk); each chunk is computed heads-major (see
    dot_product_attention). attention() uses it on CPU. At 256 tokens the step of docs/performance.md's
    reference model was within the noise of heads-major alone (-4% and +1% in two comparisons); at
    8,192 tokens the two together took the default model's step from 48 to 11.5 s and its compiled
    memory from 4.5 to 2.2 GiB.

    Past long_from tokens each chunk is a lax.scan of checkpointed sub-chunks of long_chunk queries, so the
    backward recomputes one sub-chunk's scores at a time instead of keeping all (31 GB at 32k tokens for the
    default model): memory O(long_chunk x T) a head, for one more q.k and softmax; exact.
    """
    t = q.shape[1]
    if t > long_from:
        return _long_causal_chunks(q, k, v, segment_ids, sliding_window=sliding_window, scale=scale,
                                   logits_soft_cap=logits_soft_cap, chunks=max_chunks, sub=long_chunk, sinks=sinks)
    n = max(1, min(max_chunks, t // min_chunk))
    bounds = [round(i * t / n) for i in range(n + 1)]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        first = max(0, start - sliding_window + 1) if sliding_window > 0 else 0
        mask = make_attention_mask(segment_ids[:, start:end], segment_ids[:, first:end], q_offset=start - first,
                                   sliding_window=sliding_window)
        outs.append(dot_product_attention(q[:, start:end], k[:, first:end], v[:, first:end], mask, scale=scale,
                                          logits_soft_cap=logits_soft_cap, heads_major=True, sinks=sinks))
    return outs[0] if n == 1 else jnp.concatenate(outs, axis=1)


def _long_causal_chunks(q, k, v, segment_ids, *, sliding_window, scale, logits_soft_cap, chunks: int, sub: int,
                        sinks):
    """causal_chunks past long_from: chunk bounds at multiples of `sub` (the queries padded to one; padded rows
    see nothing and are dropped), each chunk a scan of checkpointed sub-chunks against the keys it can see."""
    b, t = q.shape[:2]
    m = -(-t // sub)  # sub-chunks in all
    pad = m * sub - t
    q_pad = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    seg_pad = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)  # padded queries see nothing
    bounds = [round(i * m / chunks) * sub for i in range(chunks + 1)]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end == start:
            continue
        first = max(0, start - sliding_window + 1) if sliding_window > 0 else 0
        k_end = min(end, t)
        k_c, v_c, kv_seg = k[:, first:k_end], v[:, first:k_end], segment_ids[:, first:k_end]
        n_sub = (end - start) // sub
        q_subs = q_pad[:, start:end].reshape(b, n_sub, sub, *q.shape[2:]).swapaxes(0, 1)
        seg_subs = seg_pad[:, start:end].reshape(b, n_sub, sub).swapaxes(0, 1)
        offsets = start - first + sub * jnp.arange(n_sub)

        @jax.checkpoint  # traced here, in this iteration: the closure's k_c, v_c and kv_seg are this chunk's
        def body(carry, xs):
            q_sub, seg_sub, offset = xs
            mask = make_attention_mask(seg_sub, kv_seg, q_offset=offset, sliding_window=sliding_window)
            return carry, dot_product_attention(q_sub, k_c, v_c, mask, scale=scale,
                                                logits_soft_cap=logits_soft_cap, heads_major=True, sinks=sinks)

        _, out = jax.lax.scan(body, None, (q_subs, seg_subs, offsets))  # [n_sub, B, sub, N, Hv]
        outs.append(out.swapaxes(0, 1).reshape(b, end - start, *out.shape[3:]))
    return jnp.concatenate(outs, axis=1)[:, :t]


def query_blocks(q, k, v, segment_ids, *, causal: bool = False, block: int = 512, sliding_window: int = 0,
                 scale: float | None = None, logits_soft_cap: float = 0.0, sinks=None, compact_scores: bool = False,
                 heads_major: bool = False):
    """Self-attention in blocks of `block` queries, each against every key, one checkpointed step of a lax.scan at a
    time: the scores and probabilities live for one block [B, N, block, S] in the forward and again in the backward
    (recomputed from the block's queries), memory O(block x S) a head instead of O(T x S); the same values as one
    dot_product_attention over the whole mask. attention() uses it for bidirectional (causal=False) attention with
    dot_product (the image towers' frames: models/vision/frame_attention.py). T <= block: that one call."""
    b, t = q.shape[:2]
    options = dict(scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks, compact_scores=compact_scores,
                   heads_major=heads_major)
    if t <= block:
        mask = make_attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=sliding_window)
        return dot_product_attention(q, k, v, mask, **options)
    n = -(-t // block)
    pad = n * block - t
    q_blocks = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, n, block, *q.shape[2:]).swapaxes(0, 1)
    seg_blocks = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)  # padded queries see nothing
    seg_blocks = seg_blocks.reshape(b, n, block).swapaxes(0, 1)

    @jax.checkpoint  # the backward recomputes one block's scores at a time
    def body(carry, xs):
        q_block, seg_block, offset = xs
        mask = make_attention_mask(seg_block, segment_ids, causal=causal, q_offset=offset,
                                   sliding_window=sliding_window)
        return carry, dot_product_attention(q_block, k, v, mask, **options)

    _, out = jax.lax.scan(body, None, (q_blocks, seg_blocks, block * jnp.arange(n)))  # [n, B, block, N, Hv]
    return out.swapaxes(0, 1).reshape(b, n * block, *out.shape[3:])[:, :t]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _probabilities(scores, mask, scale: float, cap: float):
    """softmax(where(mask, soft_cap(scores * scale, cap), -big)) computed in float32 from 16-bit
    scores, returned in their dtype; its gradient is computed in float32 from the saved 16-bit
    probabilities (and scores, when soft-capped)."""
    return _probabilities_fwd(scores, mask, scale, cap)[0]


def _probabilities_fwd(scores, mask, scale, cap):
    # softmax as exp(x - logsumexp(x)), not exp(x - max) / sum: the float32 x is recomputed from the
    # 16-bit scores inside each of the three passes (max, sum, output), and no float32 T x S array
    # has two readers, so the compiler has nothing to keep in float32 (exp(x - max) / sum would
    # hold exp(x - max) for both the sum and the division).
    logits = jnp.where(mask, soft_cap(scores.astype(jnp.float32) * scale, cap), _MASK_VALUE)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    lse = peak + jnp.log(jnp.sum(jnp.exp(logits - peak), axis=-1, keepdims=True))
    probs = jnp.exp(logits - lse).astype(scores.dtype)
    return probs, (probs, scores if cap > 0 else None)


def _probabilities_bwd(scale, cap, residuals, g):
    probs, scores = residuals
    p, g = probs.astype(jnp.float32), g.astype(jnp.float32)
    d_logits = p * (g - jnp.sum(g * p, axis=-1, keepdims=True))  # softmax's vector-Jacobian product
    if cap > 0:  # d/dx cap * tanh(x / cap) = 1 - tanh(x / cap)^2
        d_logits = d_logits * (1.0 - jnp.square(jnp.tanh(scores.astype(jnp.float32) * scale / cap)))
    return (d_logits * scale).astype(probs.dtype), None


_probabilities.defvjp(_probabilities_fwd, _probabilities_bwd)
