"""Flash attention in Pallas (Triton on NVIDIA GPUs, interpret mode on CPU): online-softmax
forward, recomputing backward, grouped-query heads, sliding windows and logit soft-capping.

Letters (as in maxtrain/models/attention/): B batch, T query length, S key length, N query heads,
G kv heads, H head dim, R = N // G query heads per kv head. Query head n reads kv head n // R.

Forward (one program per (b, n, query block of size block_q), loop over key blocks of block_k):
    s   = cap * tanh(q @ k^T * scale / cap)        [block_q, block_k], float32 (no cap: q @ k^T * scale)
    m'  = max(m, rowmax(s));  p = exp(s - m')       running max m, so exp never overflows
    l'  = l * exp(m - m') + rowsum(p)               running softmax denominator
    acc = acc * exp(m - m') + p @ v                 running, unnormalised output
    out = acc / l,  lse = m + log(l)                lse [B, N, T] is kept for the backward
Backward (P = exp(s - lse) is recomputed from the saved lse, never stored):
    dP = dO @ V^T,  delta = rowsum(dO * O),  dS = P * (dP - delta) * (1 - tanh^2)   (last factor: cap only)
    dQ = dS @ K * scale        one program per (b, n, query block), loop over key blocks
    dK = sum_r dS^T @ Q * scale, dV = sum_r P^T @ dO
                               one program per (b, g, key block), loop over the R query heads
                               of kv head g and over query blocks
K and V are never repeated for grouped-query attention: the BlockSpec index maps pick the kv head.
Attention sinks (a logit per query head in each softmax's denominator, gpt-oss) are applied to the
kernel's results, exactly, outside it:
    lse' = logaddexp(lse, sink),  out' = out * exp(lse - lse')
and the backward above, run with out' and lse', gives the gradients of q, k and v with sinks (the sink
column has no value row, so dS keeps its form); d sink = -sum_t exp(sink - lse') * delta.

Masking (same rule as maxtrain.models.attention.make_attention_mask): query t sees key s when their
segment ids are equal, if causal s <= t, and with a sliding window W > 0 t - s < W. Programs only
visit the key (or query) blocks that hold some visible pair by position: causal attention does
about half the work, a window of W about W / S of it. Masked scores are set to _MASK_VALUE and the
running max starts at _MASK_VALUE / 2, which is above every masked score and below every real
one: masked entries get exp(...) == 0 exactly, even in a row with no visible key at all (its
output and gradients are 0; the plain reference instead averages all of V there, and such rows do
not occur in causal self-attention).

Lengths that are not multiples of the block sizes are padded inside `flash_attention`: padded
keys are masked out by index (s >= S), padded queries are sliced off (so their cotangent is 0).

Tiles and launch parameters (`Tuning`) come from `flash_tiles.default_tuning`: the requested blocks,
shrunk until the kernel's shared memory (estimated by `flash_tiles.shared_memory_bytes`, a model
fitted to what Triton asks for on sm_90) fits the target's per-block limit. The kernels keep to what the Pallas
Triton lowering supports: 2-D loads of power-of-two blocks, dots with float32 accumulation,
fori_loops with scalar bounds, no dynamic shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from maxtrain.kernels import flash_tiles
from maxtrain.kernels.flash_tiles import DEFAULT_SHARED_MEMORY, MIN_BLOCK, Tuning, default_tuning

# Same finite "minus infinity" as the reference (maxtrain/models/attention/).
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Static (hashable) parameters shared by the three kernels."""
    causal: bool
    sliding_window: int  # 0: no window
    soft_cap: float  # 0: no capping
    scale: float
    kv_len: int  # keys at index >= kv_len are padding added by the wrapper...
    kv_padded: bool  # ...and there are some, so they must be masked
    interpret: bool
    fwd: Tuning
    dq: Tuning
    dkv: Tuning
    # True: the causal and window masks compare the tokens' positions given as operands (q_pos [B, T], kv_pos
    # [B, S], after the segment ids) instead of their indices (ring attention's block pairs of a load-balanced
    # layout: models/attention/ring_flash.py); every key block is visited, and a tile the positions' bounds hide
    # runs no matmul (flash_tiles.block_seen). False: the indices, as always.
    positions: bool = False

    def call_name(self, kernel: str) -> str:
        """The Pallas call's name: `flash_attention_fwd` etc., with `_every_block` where the programs visit every
        block (not causal, or masking by positions), which is how compile/hlo_kernels.py tells the work of a
        compiled call: a causal one skips the blocks above the diagonal, half of them."""
        return f"flash_attention_{kernel}" + ("" if self.causal and not self.positions else "_every_block")


def _dot(a, b, contract_a=1, contract_b=0):
    """2-D matmul with float32 accumulation; contract_a=0 uses a^T, contract_b=1 uses b^T."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _visible(cfg, q_start, k_start, block_q, block_k, q_seg, kv_seg, q_tokens=None, kv_tokens=None):
    """Boolean [block_q, block_k] mask of visible (query, key) pairs, or None when all are. q_tokens [block_q] and
    kv_tokens [block_k] (cfg.positions): the positions the causal and window masks compare instead of indices."""
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, (block_q, block_k), 1)
    conditions = [k_pos < cfg.kv_len] if cfg.kv_padded else []  # padding: by index, whatever the positions
    if q_tokens is not None:
        q_pos = jnp.broadcast_to(q_tokens[:, None], q_pos.shape)
        k_pos = jnp.broadcast_to(kv_tokens[None, :], k_pos.shape)
    if cfg.causal:
        conditions.append(k_pos <= q_pos)
    if cfg.sliding_window:
        conditions.append(q_pos - k_pos < cfg.sliding_window)
    if q_seg is not None:
        conditions.append(q_seg[:, None] == kv_seg[None, :])
    return functools.reduce(lambda a, b: a & b, conditions) if conditions else None


def _scores(cfg, q, k, mask):
    """(scores, d scores / d raw) for q @ k^T: scaled, soft-capped, masked entries _MASK_VALUE.

    The second value is 1 - tanh^2 (the cap's derivative) with a cap, else None.
    """
    s = _dot(q, k, 1, 1) * cfg.scale
    slope = None
    if cfg.soft_cap:
        t = jnp.tanh(s / cfg.soft_cap)
        s, slope = cfg.soft_cap * t, 1.0 - t * t
    return (s if mask is None else jnp.where(mask, s, _MASK_VALUE)), slope


def _maybe(seen, fn, carry):
    """fn(carry) where the tile may hold a visible pair (`seen`: flash_tiles.block_seen's), else carry unchanged."""
    return fn(carry) if seen is None else lax.cond(seen, fn, lambda c: c, carry)


def _split_refs(refs, has_segments, num_inputs):
    """(inputs, q_seg_ref, kv_seg_ref, outputs) from the flat refs a kernel receives."""
    inputs, rest = refs[:num_inputs], refs[num_inputs:]
    if has_segments:
        return inputs, rest[0], rest[1], rest[2:]
    return inputs, None, None, rest


def _position_refs(cfg, outputs):
    """((q_pos_ref, kv_pos_ref) or (None, None), outputs): with cfg.positions the two refs after the segment ids."""
    return ((outputs[0], outputs[1]), outputs[2:]) if cfg.positions else ((None, None), outputs)


# ----------------------------------------------------------------------------------------------
# Kernels. Ref shapes are the per-program blocks; "S_pad"/"T_pad" are the padded lengths.


def _fwd_kernel(*refs, cfg: KernelConfig, has_segments: bool):
    """Grid (B, N, T_pad // block_q). q [block_q, H], k/v [S_pad, H] -> o [block_q, H], lse."""
    (q_ref, k_ref, v_ref), q_seg_ref, kv_seg_ref, outputs = _split_refs(refs, has_segments, 3)
    (q_pos_ref, kv_pos_ref), (o_ref, lse_ref) = _position_refs(cfg, outputs)
    block_q, block_k = cfg.fwd.block_q, cfg.fwd.block_k
    q_start = pl.program_id(2) * block_q
    q = q_ref[...]
    q_seg = q_seg_ref[...] if has_segments else None
    q_tokens = q_pos_ref[...] if cfg.positions else None

    def body(kv_block, carry):
        m, l, acc = carry
        k_start = pl.multiple_of(kv_block * block_k, block_k)
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        kv_seg = kv_seg_ref[pl.ds(k_start, block_k)] if has_segments else None
        kv_tokens = kv_pos_ref[pl.ds(k_start, block_k)] if cfg.positions else None

        def attend(carry):
            m, l, acc = carry
            s, _ = _scores(cfg, q, k, _visible(cfg, q_start, k_start, block_q, block_k, q_seg, kv_seg, q_tokens,
                                               kv_tokens))
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.exp(s - m_new[:, None])
            alpha = jnp.exp(m - m_new)
            l_new = l * alpha + jnp.sum(p, axis=1)
            return m_new, l_new, acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return _maybe(flash_tiles.block_seen(cfg, q_tokens, kv_tokens), attend, (m, l, acc))

    m = jnp.full((block_q,), 0.5 * _MASK_VALUE, jnp.float32)
    l = jnp.zeros((block_q,), jnp.float32)
    acc = jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32)
    lo, hi = flash_tiles.kv_block_range(cfg, q_start, block_q, block_k, k_ref.shape[0] // block_k)
    m, l, acc = lax.fori_loop(lo, hi, body, (m, l, acc))
    l = jnp.where(l == 0.0, 1.0, l)  # rows with no visible key: acc == 0, output 0
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _ds(cfg, q, k, v, do, lse, delta, mask):
    """(P, dS) of one tile: dS is d loss / d (q @ k^T), before the scale."""
    s, slope = _scores(cfg, q, k, mask)
    p = jnp.exp(s - lse[:, None])
    ds = p * (_dot(do, v, 1, 1) - delta[:, None])
    return p, (ds if slope is None else ds * slope)


def _dq_kernel(*refs, cfg: KernelConfig, has_segments: bool):
    """Grid (B, N, T_pad // block_q). Loops over key blocks; writes dq [block_q, H]."""
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), q_seg_ref, kv_seg_ref, outputs = (
        _split_refs(refs, has_segments, 6))
    (q_pos_ref, kv_pos_ref), (dq_ref,) = _position_refs(cfg, outputs)
    block_q, block_k = cfg.dq.block_q, cfg.dq.block_k
    q_start = pl.program_id(2) * block_q
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    q_seg = q_seg_ref[...] if has_segments else None
    q_tokens = q_pos_ref[...] if cfg.positions else None

    def body(kv_block, dq):
        k_start = pl.multiple_of(kv_block * block_k, block_k)
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        kv_seg = kv_seg_ref[pl.ds(k_start, block_k)] if has_segments else None
        kv_tokens = kv_pos_ref[pl.ds(k_start, block_k)] if cfg.positions else None

        def attend(dq):
            mask = _visible(cfg, q_start, k_start, block_q, block_k, q_seg, kv_seg, q_tokens, kv_tokens)
            _, ds = _ds(cfg, q, k, v, do, lse, delta, mask)
            return dq + _dot(ds.astype(k.dtype), k)
        return _maybe(flash_tiles.block_seen(cfg, q_tokens, kv_tokens), attend, dq)

    lo, hi = flash_tiles.kv_block_range(cfg, q_start, block_q, block_k, k_ref.shape[0] // block_k)
    dq = lax.fori_loop(lo, hi, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(*refs, cfg: KernelConfig, has_segments: bool):
    """Grid (B, G, S_pad // block_k). q/do [T_pad, R, H], lse/delta [R, T_pad], k/v [block_k, H].

    Accumulates dk, dv over the R query heads that share this kv head and over query blocks.
    """
    (q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref), q_seg_ref, kv_seg_ref, outputs = (
        _split_refs(refs, has_segments, 6))
    (q_pos_ref, kv_pos_ref), (dk_ref, dv_ref) = _position_refs(cfg, outputs)
    block_q, block_k = cfg.dkv.block_q, cfg.dkv.block_k
    k_start = pl.program_id(2) * block_k
    k, v = k_ref[...], v_ref[...]
    kv_seg = kv_seg_ref[...] if has_segments else None
    kv_tokens = kv_pos_ref[...] if cfg.positions else None
    heads_per_kv = q_ref.shape[1]

    def q_body(q_block, carry, r):
        dk, dv = carry
        q_start = pl.multiple_of(q_block * block_q, block_q)
        rows = pl.ds(q_start, block_q)
        q, do = q_ref[rows, r, :], do_ref[rows, r, :]
        lse, delta = lse_ref[r, rows], delta_ref[r, rows]
        q_seg = q_seg_ref[rows] if has_segments else None
        q_tokens = q_pos_ref[rows] if cfg.positions else None

        def attend(carry):
            dk, dv = carry
            mask = _visible(cfg, q_start, k_start, block_q, block_k, q_seg, kv_seg, q_tokens, kv_tokens)
            p, ds = _ds(cfg, q, k, v, do, lse, delta, mask)
            return dk + _dot(ds.astype(q.dtype), q, 0, 0), dv + _dot(p.astype(do.dtype), do, 0, 0)
        return _maybe(flash_tiles.block_seen(cfg, q_tokens, kv_tokens), attend, (dk, dv))

    def head_body(r, carry):
        lo, hi = flash_tiles.q_block_range(cfg, k_start, block_q, block_k, q_ref.shape[0] // block_q)
        return lax.fori_loop(lo, hi, functools.partial(q_body, r=r), carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, heads_per_kv, head_body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers on padded arrays: q [B, T_pad, N, H], k/v [B, S_pad, G, H].


def _params(tuning: Tuning):
    return plgpu.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)


def _segment_specs(has_segments, q_block, kv_block, q_len, kv_len):
    """BlockSpecs for the segment ids: blocks of q_block (kv_block) rows, or whole rows if None."""
    if not has_segments:
        return []
    q_spec = (pl.BlockSpec((None, q_block), lambda b, h, i: (b, i)) if q_block
              else pl.BlockSpec((None, q_len), lambda b, h, i: (b, 0)))
    kv_spec = (pl.BlockSpec((None, kv_block), lambda b, h, i: (b, i)) if kv_block
               else pl.BlockSpec((None, kv_len), lambda b, h, i: (b, 0)))
    return [q_spec, kv_spec]


def forward_call(q, k, v, q_seg, kv_seg, cfg, q_pos=None, kv_pos=None):
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    rep = num_heads // num_kv_heads
    has_segments = q_seg is not None
    block_q = cfg.fwd.block_q
    q_spec = pl.BlockSpec((None, block_q, None, head_dim), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, kv_len, None, head_dim), lambda b, n, i: (b, 0, n // rep, 0))
    segs = [q_seg, kv_seg] if has_segments else []
    segs += [q_pos, kv_pos] if cfg.positions else []
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, has_segments=has_segments),
        grid=(batch, num_heads, q_len // block_q),
        in_specs=[q_spec, kv_spec, kv_spec, *_segment_specs(has_segments, block_q, None, q_len, kv_len),
                  *_segment_specs(cfg.positions, block_q, None, q_len, kv_len)],
        out_specs=[q_spec, pl.BlockSpec((None, None, block_q), lambda b, n, i: (b, n, i))],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, num_heads, q_len), jnp.float32)],
        compiler_params=_params(cfg.fwd),
        interpret=cfg.interpret,
        name=cfg.call_name("fwd"),
    )(q, k, v, *segs)


def dq_call(q, k, v, do, lse, delta, q_seg, kv_seg, cfg, q_pos=None, kv_pos=None):
    """dq [B, T_pad, N, H]: tiled like the forward, one program per (b, n, query block)."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, rep = k.shape[1], num_heads // k.shape[2]
    has_segments = q_seg is not None
    block_q = cfg.dq.block_q
    q_spec = pl.BlockSpec((None, block_q, None, head_dim), lambda b, n, i: (b, i, n, 0))
    kv_spec = pl.BlockSpec((None, kv_len, None, head_dim), lambda b, n, i: (b, 0, n // rep, 0))
    row_spec = pl.BlockSpec((None, None, block_q), lambda b, n, i: (b, n, i))
    return pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, has_segments=has_segments),
        grid=(batch, num_heads, q_len // block_q),
        in_specs=[q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec,
                  *_segment_specs(has_segments, block_q, None, q_len, kv_len),
                  *_segment_specs(cfg.positions, block_q, None, q_len, kv_len)],
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=_params(cfg.dq),
        interpret=cfg.interpret,
        name=cfg.call_name("dq"),
    )(q, k, v, do, lse, delta, *([q_seg, kv_seg] if has_segments else []), *([q_pos, kv_pos] if cfg.positions else []))


def dkv_call(q, k, v, do, lse, delta, q_seg, kv_seg, cfg, q_pos=None, kv_pos=None):
    """(dk, dv) [B, S_pad, G, H]: one program per kv block of one kv head, over its R query heads."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv_heads = k.shape[1], k.shape[2]
    rep = num_heads // num_kv_heads
    has_segments = q_seg is not None
    block_k = cfg.dkv.block_k
    heads_spec = pl.BlockSpec((None, q_len, rep, head_dim), lambda b, g, j: (b, 0, g, 0))
    kv_block_spec = pl.BlockSpec((None, block_k, None, head_dim), lambda b, g, j: (b, j, g, 0))
    rows_spec = pl.BlockSpec((None, rep, q_len), lambda b, g, j: (b, g, 0))
    return pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, has_segments=has_segments),
        grid=(batch, num_kv_heads, kv_len // block_k),
        in_specs=[heads_spec, kv_block_spec, kv_block_spec, heads_spec, rows_spec, rows_spec,
                  *_segment_specs(has_segments, None, block_k, q_len, kv_len),
                  *_segment_specs(cfg.positions, None, block_k, q_len, kv_len)],
        out_specs=[kv_block_spec, kv_block_spec],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(cfg.dkv),
        interpret=cfg.interpret,
        name=cfg.call_name("dkv"),
    )(q, k, v, do, lse, delta, *([q_seg, kv_seg] if has_segments else []), *([q_pos, kv_pos] if cfg.positions else []))


def _backward(q, k, v, q_seg, kv_seg, out, lse, do, cfg, q_pos=None, kv_pos=None):
    # delta[b, n, t] = sum_h dO * O: a cheap, memory-bound reduction that XLA fuses well.
    delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), out.astype(jnp.float32))
    dq = dq_call(q, k, v, do, lse, delta, q_seg, kv_seg, cfg, q_pos, kv_pos)
    dk, dv = dkv_call(q, k, v, do, lse, delta, q_seg, kv_seg, cfg, q_pos, kv_pos)
    return dq, dk, dv


def backward(q, k, v, q_seg, kv_seg, out, lse, do, cfg, q_pos=None, kv_pos=None):
    """(dq, dk, dv) of one call from the out and lse it is to be differentiated at: the call's own (the custom VJP
    below), or a whole softmax's of which the call is one part (ring attention: models/attention/ring_flash.py)."""
    return _backward(q, k, v, q_seg, kv_seg, out, lse, do, cfg, q_pos, kv_pos)


def _with_sinks(out, lse, sinks):
    """(out, lse) of softmaxes that also have the sink logit of their head [N] in the denominator."""
    if sinks is None:
        return out, lse
    lse_sinks = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])  # [B, N, T]
    scale = jnp.exp(lse - lse_sinks).transpose(0, 2, 1)[..., None]  # [B, T, N, 1], at most 1
    return (out.astype(jnp.float32) * scale).astype(out.dtype), lse_sinks


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _flash(q, k, v, q_seg, kv_seg, sinks, q_pos, kv_pos, cfg):
    return _with_sinks(*forward_call(q, k, v, q_seg, kv_seg, cfg, q_pos, kv_pos), sinks)[0]


def _flash_fwd(q, k, v, q_seg, kv_seg, sinks, q_pos, kv_pos, cfg):
    out, lse = _with_sinks(*forward_call(q, k, v, q_seg, kv_seg, cfg, q_pos, kv_pos), sinks)
    return out, (q, k, v, q_seg, kv_seg, sinks, q_pos, kv_pos, out, lse)


def _flash_bwd(cfg, residuals, do):
    q, k, v, q_seg, kv_seg, sinks, q_pos, kv_pos, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, q_seg, kv_seg, out, lse, do, cfg, q_pos, kv_pos)
    dsinks = None
    if sinks is not None:  # the sink's probability exp(sink - lse) times -delta, summed over rows
        delta = jnp.einsum("BTNH,BTNH->BNT", do.astype(jnp.float32), out.astype(jnp.float32))
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    return dq, dk, dv, None, None, dsinks, None, None  # segment ids and positions are integers: no cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)


# ----------------------------------------------------------------------------------------------
# Public entry point.


def _check_block(block, name):
    if block < MIN_BLOCK or block & (block - 1):
        raise ValueError(f"{name}={block} must be a power of two >= {MIN_BLOCK}")


def _clamp(tuning: Tuning, q_len: int, kv_len: int) -> Tuning:
    """Blocks no longer than the (power-of-two rounded) sequences: short inputs need no big tiles."""
    fit = lambda block, length: min(block, max(MIN_BLOCK, pl.next_power_of_2(length)))  # noqa: E731
    return dataclasses.replace(tuning, block_q=fit(tuning.block_q, q_len), block_k=fit(tuning.block_k, kv_len))


def _pad_axis(x, axis, size):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def flash_attention(q, k, v, q_segment_ids=None, kv_segment_ids=None, *, causal=True, sliding_window=0,
                    logits_soft_cap=0.0, sm_scale=None, block_q=128, block_k=128,
                    shared_memory=DEFAULT_SHARED_MEMORY, tuning=None, interpret=False, sinks=None,
                    q_positions=None, kv_positions=None):
    """Flash attention with grouped-query heads, packed segments, a causal mask and a sliding window.

    q: [B, T, N, H]; k, v: [B, S, G, H] with N % G == 0. q_segment_ids [B, T] and
    kv_segment_ids [B, S] (int32, give both or neither): query t sees key s only when their ids
    are equal, if causal s <= t, and if sliding_window > 0 t - s < sliding_window.
    Scores are q.k * sm_scale (default H ** -0.5), then logits_soft_cap * tanh(. / logits_soft_cap)
    when logits_soft_cap > 0. block_q and block_k (powers of two >= 16) are the largest tiles to
    use: `default_tuning` shrinks them to fit `shared_memory` bytes per thread block (the target
    GPU's opt-in limit) and they are clamped for short sequences; `tuning` ({"fwd", "dq", "dkv"}
    -> Tuning) overrides the choice. sinks [N] (or None): a logit per query head in the denominator of
    its softmaxes (module docstring). Returns [B, T, N, H] in q.dtype; differentiable in q, k, v and
    sinks. interpret=True runs the Pallas kernels on CPU. v may have its own head dim Hv (MLA):
    [B, S, G, Hv] gives [B, T, N, Hv]; q, k and v are zero-padded to one power-of-two head dim as always.
    q_positions [B, T] and kv_positions [B, S] (int32, with segment ids; give both or neither): the causal and window
    masks compare these instead of the tokens' indices (context parallelism's load-balanced layouts:
    models/attention/context_parallel.py); tiles their bounds hide run no matmul.
    """
    batch, q_len, num_heads, head_dim = q.shape
    kv_batch, kv_len, num_kv_heads, kv_head_dim = k.shape
    v_head_dim = v.shape[3]
    if v.shape[:3] != k.shape[:3] or kv_batch != batch or kv_head_dim != head_dim:
        raise ValueError(f"incompatible shapes q {q.shape}, k {k.shape}, v {v.shape}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("give both q_segment_ids and kv_segment_ids, or neither")
    if sliding_window < 0 or logits_soft_cap < 0:
        raise ValueError(f"sliding_window ({sliding_window}) and logits_soft_cap ({logits_soft_cap}) "
                         "must be >= 0 (0 turns each off)")
    if (q_positions is None) != (kv_positions is None) or (q_positions is not None and q_segment_ids is None):
        raise ValueError("give both q_positions and kv_positions, with segment ids, or neither")
    _check_block(block_q, "block_q")
    _check_block(block_k, "block_k")
    # Triton loads need power-of-two tiles: zero-pad the head dim (q.k and the output unchanged).
    head_pad = max(MIN_BLOCK, pl.next_power_of_2(max(head_dim, v_head_dim)))
    if tuning is None:
        tuning = default_tuning(head_pad, q.dtype, block_q, block_k, shared_memory)
    tuning = {name: _clamp(t, q_len, kv_len) for name, t in tuning.items()}
    q_pad = pl.cdiv(q_len, max(t.block_q for t in tuning.values())) * max(t.block_q for t in tuning.values())
    kv_pad = pl.cdiv(kv_len, max(t.block_k for t in tuning.values())) * max(t.block_k for t in tuning.values())

    q = _pad_axis(_pad_axis(q, 1, q_pad), 3, head_pad)
    k = _pad_axis(_pad_axis(k, 1, kv_pad), 3, head_pad)
    v = _pad_axis(_pad_axis(v, 1, kv_pad), 3, head_pad)
    if q_segment_ids is not None:
        # Padded keys are masked by index (s >= kv_len), so the pad value does not matter.
        q_segment_ids = _pad_axis(q_segment_ids.astype(jnp.int32), 1, q_pad)
        kv_segment_ids = _pad_axis(kv_segment_ids.astype(jnp.int32), 1, kv_pad)
    if q_positions is not None:  # padded keys are masked by index, as above
        q_positions = _pad_axis(q_positions.astype(jnp.int32), 1, q_pad)
        kv_positions = _pad_axis(kv_positions.astype(jnp.int32), 1, kv_pad)
    cfg = KernelConfig(causal=bool(causal), sliding_window=int(sliding_window), soft_cap=float(logits_soft_cap),
                  scale=float(head_dim**-0.5 if sm_scale is None else sm_scale), kv_len=kv_len,
                  kv_padded=kv_pad != kv_len, interpret=bool(interpret), **tuning,
                  positions=q_positions is not None)
    if sinks is not None and sinks.shape != (num_heads,):
        raise ValueError(f"sinks {sinks.shape} must be one logit per query head, [{num_heads}]")
    out = _flash(q, k, v, q_segment_ids, kv_segment_ids, sinks, q_positions, kv_positions, cfg)
    return out[:, :q_len, :, :v_head_dim]
