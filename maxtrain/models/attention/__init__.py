"""Attention: masks, the plain-jnp reference, and the choice of implementation.

Shapes (letters as in model.py): q [B, T, N, H], k and v [B, S, G, H] with N a multiple of G.
Each kv head serves R = N // G query heads; K and V are never repeated in memory.

Masking rule, shared by every implementation: query t may attend to key s when both tokens belong
to the same segment (`segment_ids` equal; packed rows hold several documents) and, when causal,
s <= t. Padding has segment id 0, so a padding query attends to padding keys only and no row of
the softmax is ever empty. Padding is kept out of the loss by the loss weights, not here.

Chunked attention (Llama 4): with `chunk` = C > 0 a query sees only the keys of its own block of C positions
(p // C; positions restart in each document), computed by splitting each segment into its chunks
(`chunk_segment_ids`), so the kernels, which mask by segment ids, need nothing more. Under context parallelism the
tokens arrive in the load-balanced order and the ids are made token by token (`chunk_ids_elementwise`). kernel_choice.py says what each implementation
supports and which is fastest; kernel_check.py checks them against the reference.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtrain.models.attention import kernel_choice, kernels
from maxtrain.models.attention.kernels import (PLATFORMS, canonical_platform, local_kernel,  # noqa: F401  (API)
                                              pad_head_dims)
from maxtrain.parallel import sharding

IMPLEMENTATIONS = ("autoselected", "dot_product", "flash", "cudnn", "tokamax")

# Finite "minus infinity": keeps exp() at exactly 0 without producing NaN in fully masked rows.
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def make_attention_mask(q_segment_ids, kv_segment_ids, *, causal: bool = True, q_offset=0, sliding_window: int = 0,
                        chunk: int = 0, q_positions=None, kv_positions=None):
    """Boolean mask [B, T, S]: True where query t may attend to key s.

    q_offset shifts query indices (a query block that starts at q_offset in the key sequence).
    sliding_window > 0 also hides keys that are sliding_window or more positions back: t - s < W
    (as Hugging Face's sliding-window masks), so each query sees at most W keys, itself included.
    chunk > 0 also hides keys of another block of `chunk` positions (q_positions [B, T] and
    kv_positions [B, S]; the indices when not given): the direct form of chunked attention.
    """
    mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
    t = jnp.arange(q_segment_ids.shape[1])[:, None] + q_offset
    s = jnp.arange(kv_segment_ids.shape[1])[None, :]
    if causal:
        mask = mask & (s <= t)[None]
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


KERNEL_LIMITS = kernel_choice.KERNEL_LIMITS  # owned there, beside the measured speeds


def _unsupported(name: str, features: dict) -> list[str]:
    return [f"{key}={features[key]}" for key in KERNEL_LIMITS.get(name, ()) if features.get(key)]


def resolve_implementation(name: str, platform: str, *, dtype=None, head_dim: int | None = None,
                           sliding_window: int = 0, logits_soft_cap: float = 0.0, sinks: bool = False,
                           context_parallel: int = 1, v_head_dim: int | None = None, length: int = 0,
                           gqa: int = 1, packed: bool = True, capability: str | None = None,
                           gpu_present: bool = True, with_reason: bool = False, layers: str = "",
                           context_strategy: str = "all_gather", context_reorder: str = "dual_chunk_swap",
                           context_inner: int = 0):
    """Turns `attention` from the config into a concrete implementation for the target platform (with
    with_reason=True, a kernel_choice.Choice: the implementation and why).

    `platform` is where the step will run (the Runtime's backend, or the target of an ahead-of-time
    compile), never guessed from the machine doing the compiling. What may run where (an invalid
    choice is a ValueError that says what to use):

        platform  autoselected          dot_product  flash                          cudnn, tokamax
        cpu       dot_product           yes          yes, Pallas interpret mode     no
        gpu       the fastest measured  yes          Pallas Triton kernel           bfloat16/float16, head_dim
                  that supports it                                                  limits (kernel_choice)
        tpu       flash                 yes          Pallas splash kernel (Mosaic)  no

    On a GPU autoselected takes, among cudnn, tokamax (the optional [gpu] extra) and flash, the one that
    config/attention_speeds.MEASURED found fastest at the nearest measured shape, among those that support the
    model (soft-caps: not cudnn; sinks: neither cudnn nor tokamax), and dot_product only where none does.

    With context parallelism (context_parallel > 1 ways) attention is context_parallel.attention, whose
    strategy runs the kernels of kernel_choice.CONTEXT_KERNELS: under ulysses every kernel (autoselected chooses
    as without context parallelism); under ring flash (ring_flash.py: the Triton kernel per block pair of the
    ring; on TPUs the splash kernel, ring_splash.py, dual_chunk_swap without windows), which autoselected takes on
    GPUs and TPUs; under usp flash per block pair of its ring across slices (GPUs; autoselected takes it there); under
    all_gather the plain-jnp form for autoselected, and flash on the gathered keys when set (GPUs; on TPUs splash on
    each query chunk's window of them, all_gather_splash.py: dual_chunk_swap; cuDNN and tokamax refused).

    The arguments describe one attention kind (models/runtime.py resolves each once); `layers` names it
    in the refusal of an explicit choice it cannot run.

    On CPU the XLA einsum (dot_product) is the fastest; `flash` runs there only in Pallas' interpret mode
    (orders of magnitude slower: for testing the kernel, never for speed).
    """
    platform = canonical_platform(platform)
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention={name!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    shape = kernel_choice.Shape(
        dtype=jnp.dtype(dtype).name if dtype is not None else "bfloat16", head_dim=head_dim, v_head_dim=v_head_dim,
        length=length, gqa=gqa, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, sinks=sinks,
        packed=packed, capability=capability, gpu_present=gpu_present)
    kernels = kernel_choice.CONTEXT_KERNELS[context_strategy] if context_parallel > 1 else ()
    if context_parallel > 1 and context_strategy == "all_gather" and name in ("flash", "autoselected"):
        if name == "autoselected":  # the default path stays the plain form (context_parallel.py)
            choice = kernel_choice.Choice(
                "dot_product", f"dot_product: context_parallel_strategy=all_gather ({context_parallel} ways) runs the "
                "plain-jnp form unless attention=flash (the kernel on the gathered keys, GPUs); the kernels run "
                "per block under ring, ulysses and usp")
            return choice if with_reason else choice.implementation
        if platform == "tpu":
            # deferred: the splash kernel's import, only where it runs (as in attention() below)
            from maxtrain.models.attention import all_gather_splash  # pylint: disable=import-outside-toplevel

            why = all_gather_splash.unsupported(context_reorder, True, sliding_window, length, context_parallel)
            if why:
                raise ValueError(f"attention=flash with context_parallel_strategy=all_gather {why}")
            return kernel_choice.Choice("flash", "flash: set in the config; splash on each query chunk's window of "
                                        "the gathered keys (all_gather_splash.py)") if with_reason else "flash"
        return kernel_choice.Choice("flash", "flash: set in the config; the kernel on the gathered keys "
                                    "(context_parallel.all_gather_flash)") if with_reason else "flash"
    if context_parallel > 1 and context_strategy in ("ring", "usp") and name in ("flash", "autoselected"):
        if context_strategy == "ring":  # ring_flash.py
            why = _ring_flash_unsupported(platform, context_reorder, sliding_window, length, context_parallel)
            where, how = "the ring", ("the kernel per block pair of the ring (ring_flash.py), causal blocks skipped, "
                                      "T / C keys per device")
        else:  # usp.py
            why = _usp_flash_unsupported(platform, length, context_parallel // max(context_inner, 1))
            where, how = "usp's ring", ("the kernel per block pair of usp's ring across slices (usp.py), masked by "
                                        "the tokens' positions")
        if why and name == "flash":
            raise ValueError(f"attention=flash with context_parallel_strategy={context_strategy} {why}")
        if name == "autoselected" and platform != "cpu":
            choice = (kernel_choice.Choice("dot_product", f"dot_product: flash inside {where} {why}") if why else
                      kernel_choice.Choice("flash", f"flash: {how}"))
            return choice if with_reason else choice.implementation
    if context_parallel > 1 and context_strategy in ("ring", "usp") and name in ("cudnn", "tokamax"):
        where = "ring" if context_strategy == "ring" else "usp's ring"
        raise ValueError(f"attention={name} does not run inside context_parallel_strategy={where}: its backward cannot "
                         "take the ring's global softmax statistics; use attention=flash (the Triton kernel runs per "
                         "block pair of the ring) or dot_product")
    if context_parallel > 1 and name not in ("autoselected", "dot_product", *kernels):
        runs = [s for s, ks in kernel_choice.CONTEXT_KERNELS.items() if name in ks]
        raise ValueError(f"attention={name} does not run with context_parallel_strategy={context_strategy} "
                         f"({context_parallel} ways): its attention is the plain-jnp form. Use attention=dot_product "
                         f"(or autoselected)" + (f", or context_parallel_strategy={' or '.join(runs)}" if runs else "")
                         + ".")
    if name == "autoselected":
        choice = kernel_choice.choose(platform, shape, context_parallel, context_strategy)
    else:
        why = kernel_choice.unsupported(name, platform, shape)
        if why is not None:
            others = [n for n in ("flash", "dot_product") if n != name and not _unsupported(n, shape.features())]
            where = f"cannot run the model's {layers}: {name} " if layers else ""
            raise ValueError(f"attention={name} {where}{why}. Use attention={', '.join(others)} or autoselected"
                             + (" (which chooses per layer kind)." if layers else "."))
        choice = kernel_choice.Choice(name, f"{name}: set in the config")
    return choice if with_reason else choice.implementation


def _ring_flash_unsupported(platform: str, reorder: str = "dual_chunk_swap", sliding_window: int = 0,
                            length: int = 0, ways: int = 1) -> str:
    """Why attention=flash cannot run inside the ring here (ring_flash.py; ring_splash.py on TPUs), as the end of a
    sentence; "" if it can."""
    if platform != "tpu":
        return ""
    if reorder != "dual_chunk_swap" or sliding_window > 0:
        return (f"on TPUs (the splash kernel) runs dual_chunk_swap without a sliding window only (here {reorder}, "
                f"sliding_window={sliding_window}); use attention=dot_product with the ring")
    if length % (2 * ways * 128):
        return (f"on TPUs (the splash kernel) needs each device's two chunks to be a multiple of 128 tokens: "
                f"max_target_length={length} must be a multiple of {2 * ways * 128}")
    return ""


_NO_POSITIONS_ON_TPU = ("on TPUs: its masks need the tokens' original positions, which the splash kernel does not "
                        "take; use attention=dot_product")


def _usp_flash_unsupported(platform: str, length: int = 0, outer: int = 1) -> str:
    """Why attention=flash cannot run inside usp's ring across slices here, as the end of a sentence; "" if it can."""
    if platform == "tpu":
        return (f"{_NO_POSITIONS_ON_TPU}, or context_parallel_strategy=ring")
    if length % (16 * outer):
        return (f"needs each slice's {length // outer if outer else length} tokens to be a multiple of 16 (the "
                f"kernel's smallest block): max_target_length={length} must be a multiple of {16 * outer}")
    return ""


def describe(implementation: str, platform: str) -> str:
    """The implementation's name as the start-up summary prints it."""
    if implementation == "tokamax":
        return "tokamax (Mosaic GPU)"
    if implementation != "flash":
        return implementation
    return {"cpu": "flash (Pallas interpret mode: slow, for testing the kernel)",
            "gpu": "flash (Pallas Triton)", "tpu": "flash (Pallas splash)"}[canonical_platform(platform)]


def attention(q, k, v, segment_ids, *, implementation: str = "dot_product", platform: str | None = None,
              causal: bool = True, sliding_window: int = 0, logits_soft_cap: float = 0.0,
              scale: float | None = None, block_q: int = 128, block_kv: int = 128, interpret: bool | None = None,
              sinks=None, chunk: int = 0, positions=None, context_strategy: str = "all_gather",
              context_reorder: str = "dual_chunk_swap", context_inner: int = 0):
    """Self-attention over one (possibly packed) sequence; dispatches on `implementation`.

    `implementation` must already be resolved (see resolve_implementation). The kernels (flash,
    cudnn, tokamax) need `platform`, the target the step is compiled for (cpu, gpu or tpu): flash is the
    splash kernel on tpu and the Triton kernel on gpu and cpu; on cpu it is interpreted.
    `interpret=True` interprets the target's kernel on this CPU instead (tests; for tokamax, whose Mosaic
    GPU kernel has no CPU mode, it runs tokamax's XLA reference through the same wrapper). Under
    sharding.activation_sharding every kernel runs inside shard_map over the batch and head mesh
    axes. scale defaults to H ** -0.5; block_q and block_kv are the kernels' largest tiles. sinks [N]:
    attention sinks (dot_product_attention; the flash and splash kernels implement them too). chunk > 0:
    chunked attention over blocks of `chunk` of the tokens' `positions` [B, T] (the module docstring).
    With the sequence split over the context mesh axes, context_strategy (all_gather, ring, ulysses or usp) says
    how the queries meet the other devices' keys, context_reorder names the layout the tokens arrive in
    (parallel/context.py), and context_inner is usp's devices of the group per slice (ici_context_parallelism).
    """
    if chunk > 0:
        if not causal:
            raise ValueError("chunked attention is causal; pass causal=True")
        if sharding.ways("length") > 1:  # tokens in the layout's order: chunk ids elementwise, no scan along T
            segment_ids = chunk_ids_elementwise(segment_ids, positions, chunk)
        else:
            segment_ids = chunk_segment_ids(segment_ids, positions, chunk)
    features = {"sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap, "sinks": sinks is not None}
    if _unsupported(implementation, features):
        raise ValueError(f"attention={implementation} does not implement {' and '.join(_unsupported(implementation, features))}; "
                         "use attention=dot_product")
    if sharding.ways("length") > 1 and implementation == "flash" and context_strategy == "ring":
        why = _ring_flash_unsupported(canonical_platform(platform or "cpu"), context_reorder, sliding_window,
                                      q.shape[1], sharding.ways("length"))
        if platform is None or why:
            raise ValueError(f"attention=flash with context_parallel_strategy=ring {why or 'needs platform='}")
        if canonical_platform(platform) == "tpu":
            # deferred: the splash kernel's import (as below), only where it runs
            from maxtrain.models.attention import ring_splash  # pylint: disable=import-outside-toplevel

            return ring_splash.ring_splash_attention(q, k, v, segment_ids, causal=causal,
                                                     logits_soft_cap=logits_soft_cap, scale=scale, sinks=sinks,
                                                     interpret=bool(interpret), block_q=block_q, block_kv=block_kv)
        # deferred: the flash kernel's import (as below), only where it runs
        from maxtrain.models.attention import ring_flash  # pylint: disable=import-outside-toplevel

        return ring_flash.attention(q, k, v, segment_ids, platform=canonical_platform(platform),
                                    reorder=context_reorder, causal=causal, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap, scale=scale, block_q=block_q, block_kv=block_kv,
                                    interpret=interpret, sinks=sinks)
    if sharding.ways("length") > 1 and implementation == "flash" and context_strategy == "all_gather":
        # deferred, as below: context_parallel.py reads this module's reference attention
        from maxtrain.models.attention import context_parallel, ring_flash  # pylint: disable=import-outside-toplevel

        platform = canonical_platform(platform or "cpu")
        if platform == "tpu":
            # deferred: the splash kernel's import, only where it runs
            from maxtrain.models.attention import all_gather_splash  # pylint: disable=import-outside-toplevel

            return all_gather_splash.all_gather_splash(
                q, k, v, segment_ids, reorder=context_reorder, causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                scale=scale, sinks=sinks, block=max(block_q, block_kv), interpret=bool(interpret))
        return context_parallel.all_gather_flash(
            q, k, v, segment_ids, reorder=context_reorder, causal=causal, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, scale=scale, sinks=sinks,
            flash=ring_flash.kernel_settings(platform, block_q, block_kv, interpret))
    if sharding.ways("length") > 1 and implementation == "flash" and context_strategy == "usp":
        # deferred, as below: usp.py reads this module's reference attention
        from maxtrain.models.attention import ring_flash, usp  # pylint: disable=import-outside-toplevel

        platform = canonical_platform(platform or "cpu")
        if platform == "tpu":
            raise ValueError(f"attention=flash with context_parallel_strategy=usp {_usp_flash_unsupported(platform)}")
        return usp.usp_attention(q, k, v, segment_ids, inner=context_inner, reorder=context_reorder, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                                 sinks=sinks, flash=ring_flash.kernel_settings(platform, block_q, block_kv, interpret))
    kernel = None
    if implementation != "dot_product":
        kernel = kernels.local_kernel(implementation, platform, causal=causal, sliding_window=sliding_window,
                              logits_soft_cap=logits_soft_cap, scale=scale, block_q=block_q, block_kv=block_kv,
                              interpret=interpret)
    if sharding.ways("length") > 1:  # the sequence is split over devices: parallel/context.py
        # deferred: context_parallel.py reads this module's reference attention
        from maxtrain.models.attention import context_parallel  # pylint: disable=import-outside-toplevel

        return context_parallel.attention(q, k, v, segment_ids, strategy=context_strategy, reorder=context_reorder,
                                          causal=causal, sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap, scale=scale, sinks=sinks, kernel=kernel,
                                          inner=context_inner)
    if kernel is None:
        on_cpu = platform is not None and canonical_platform(platform) == "cpu"
        if on_cpu and causal:
            return causal_chunks(q, k, v, segment_ids, sliding_window=sliding_window, scale=scale,
                                 logits_soft_cap=logits_soft_cap, sinks=sinks)
        mask = make_attention_mask(segment_ids, segment_ids, causal=causal, sliding_window=sliding_window)
        return dot_product_attention(q, k, v, mask, scale=scale, logits_soft_cap=logits_soft_cap,
                                     compact_scores=platform == "tpu", heads_major=on_cpu, sinks=sinks)
    return kernels.per_shard(kernel, q, k, v, segment_ids, sinks)
