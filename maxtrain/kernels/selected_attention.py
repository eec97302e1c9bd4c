"""Attention over each query's chosen keys (DeepSeek-V3.2's sparse attention, MLA in absorbed form) in Pallas:
Triton on NVIDIA GPUs, interpret mode on CPU; forward and backward under jax.custom_vjp.

What: per query t and head n, over the K key indices idx[t, :] the indexer chose (kept[t, j] false for the slots of
a query that sees fewer than K keys),

    s[n, j] = (q_c[t, n] . c[idx[t, j]] + q_r[t, n] . k_r[idx[t, j]]) * scale      (masked where not kept)
    o_c[t, n] = sum_j softmax_j(s[n, :]) c[idx[t, j]]

the same numbers as models/families/deepseek/selected.py's plain-jnp form (its reference), which gathers the chosen
latent rows [Bq, K, C + R] per block of queries into memory; here the gather happens tile by tile inside the kernel.
The selection (indexer scores, top_k, the causal and document masks) stays in jnp: the kernel reads only what idx
names, so a key of another document is never read unless the selection chose it (it never does: its score is -inf).

Why ours: no library kernel (tokamax, cuDNN, splash, FlashMLA's training path) takes per-query key indices over
MLA's shared latent keys for training, forward and backward.

Tiling. All N heads of a query read the same K keys, which is the reuse: one program per (batch, query, block of
`block_heads` heads) gathers its query's chosen latent rows `block_k` at a time ([block_k, C] and [block_k, R],
one gathered load each) and runs them against the whole head block, [block_heads, C] x [C, block_k], with an
online softmax (running max m, denominator l, output accumulator [block_heads, C] in float32). It writes o_c, the
log-sum-exp per (query, head) for the backward, and the running max (the head's largest kept logit, QK-clip's).

Backward (P recomputed from the saved log-sum-exp; delta = rowsum(dO * O)), two kernels and a scatter-add:
    dq kernel,   grid (B, T, N / block_heads), loop over key blocks:  dS = P (dO c_k^T - delta)
                 dq_c = scale dS c_k,  dq_r = scale dS r_k
    rows kernel, grid (B, Tq, K / block_k), loop over head blocks: for the (query, chosen key) pairs of its block
                 dc_rows = scale dS^T q_c + P^T dO [block_k, C], dk_r rows = scale dS^T q_r [block_k, R]
and a jnp scatter-add of the rows into dc [B, S, C] and dk_r [B, S, R] (float32), per chunk of `bwd_query_chunk`
queries (a scan over chunks of the sequence, each a rows-kernel call and a scatter-add), B x chunk x K x (C + R)
float32 at a time: 128 queries x 2048 keys x 576 x 4 bytes = 604 MB per sequence in the batch at DeepSeek-V3.2's
shapes. Slots that are not kept have P = dS = 0, so their rows are zero and add nothing.

On an H200 (2026-12-01, docs/gpu.md "Sparse attention on a GPU") forward and backward at 16k tokens, 16 heads,
K 2048 ran 173 ms, 15.8 TFLOP/s, 10.7x dense cuDNN's time: the backward gathers every chosen key twice and writes
and reads every row once more (77 GB each way at 16k). `atomic=True` is the alternative, one kernel tiled like the
forward, grid (B, T, N / block_heads), looping over its query's key blocks:
    dq_c, dq_r as the dq kernel's (accumulated in registers), and
    dc[idx] += scale dS^T q_c + P^T dO [bwd_block_k, C],   dk_r[idx] += scale dS^T q_r [bwd_block_k, R]
by atomic adds into float32 dc and dk_r (Triton's; in interpret mode a scatter-add, which sums duplicate indices as
the adds do; slot j's zeros where it is not kept go to a spare row S + j, so that no row takes every short query's
empty slots). It gathers each chosen key once for the whole backward and writes no rows. The order of the adds
differs from run to run, so dc and dk_r can differ in their last bits between runs (as XLA's scatter-add on GPUs
does too). It compiles for an H100 and equals the reference in interpret mode; it has not run on a GPU yet
(scripts/gpu_selected_check.py times both), so it is not the default.

Padding (inside `selected_attention`): heads up to a multiple of block_heads, C and R up to powers of two (Triton's
loads are power-of-two blocks; on GPUs heads, C and R at least 16: Triton's dots) with zeros, which change no logit;
K up to a multiple of block_k with slots marked not kept (idx = -1 inside the kernels, read as row 0 and masked).
Shared memory (an H100's 232,448 B per block; bfloat16, C 512, R 64, 2 stages, measured by compiling for sm_90a,
tests/kernels/test_kernel_lowering.py): heads x keys tiles 16 x 64 (the default), 32 x 64, 16 x 128 and 64 x 32 fit;
64 x 64 asks 286,976 B, 32 x 128 233,728 B, 128 x 32 352,384 B. Triton's dots need every tile side >= 16.

The TPU (Mosaic) form is kernels/selected_attention_tpu.py: Mosaic has no vector-indexed row gather from a ref, so
it copies each chosen key's row from HBM into VMEM by a DMA of its own, double-buffered per key block.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
# ref_addupdate (ref[idx] += x) lowers to Triton's atomic add and, in interpret mode, to a scatter-add that adds every
# duplicate index: Pallas' public atomic_add has no interpret rule for a gathered row index with a slice
from jax._src.state import primitives as state_primitives

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # as flash_attention's: exp(masked - running max) == 0


@dataclasses.dataclass(frozen=True)
class Config:
    """Static parameters of the three kernels."""
    scale: float
    block_heads: int
    block_k: int
    bwd_query_chunk: int
    interpret: bool
    num_warps: int = 4
    num_stages: int = 2
    atomic: bool = False  # the backward: one kernel adding the key rows' gradients atomically (else rows + scatter)
    bwd_block_k: int = 32  # the atomic backward's key block (its [block_k, C] float32 rows live in shared memory)


def _dot(a, b, contract_a=1, contract_b=0):
    """2-D matmul with float32 accumulation; contract_a=0 uses a^T, contract_b=1 uses b^T."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


def _gather(idx_ref, c_ref, kr_ref, start, block_k):
    """(kept [bk], c rows [bk, C], k_r rows [bk, R]) of the chosen keys start..start + block_k."""
    at = idx_ref[pl.ds(start, block_k)]
    kept = at >= 0
    safe = jnp.where(kept, at, 0)
    return kept, c_ref[safe, :], kr_ref[safe, :]


def _logits(cfg, qc, qr, ck, kr, kept):
    """Scaled logits [bn, bk] of a head block against a gathered key block, _MASK_VALUE where not kept."""
    s = (_dot(qc, ck, 1, 1) + _dot(qr, kr, 1, 1)) * cfg.scale
    return jnp.where(kept[None, :], s, _MASK_VALUE)


def _fwd_kernel(qc_ref, qr_ref, c_ref, kr_ref, idx_ref, o_ref, lse_ref, max_ref, *, cfg: Config):
    """Grid (B, T, N / bn). q_c [bn, C], q_r [bn, R], c [S, C], k_r [S, R], idx [K] -> o [bn, C], lse, max [bn]."""
    qc, qr = qc_ref[...], qr_ref[...]
    bn, bk = qc.shape[0], cfg.block_k

    def body(j, carry):
        m, l, acc = carry
        kept, ck, kr = _gather(idx_ref, c_ref, kr_ref, pl.multiple_of(j * bk, bk), bk)
        s = _logits(cfg, qc, qr, ck, kr, kept)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_new[:, None])
        alpha = jnp.exp(m - m_new)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + _dot(p.astype(ck.dtype), ck)

    m = jnp.full((bn,), 0.5 * _MASK_VALUE, jnp.float32)
    l = jnp.zeros((bn,), jnp.float32)
    acc = jnp.zeros((bn, qc.shape[1]), jnp.float32)
    m, l, acc = lax.fori_loop(0, idx_ref.shape[0] // bk, body, (m, l, acc))
    l = jnp.where(l == 0.0, 1.0, l)  # a query with no kept key: acc == 0, output 0
    o_ref[...] = (acc / l[:, None]).astype(o_ref.dtype)
    lse_ref[...] = m + jnp.log(l)
    max_ref[...] = m


def _ds(cfg, qc, qr, ck, kr, kept, do, lse, delta):
    """(P, dS) of a head block against a key block; dS = d loss / d logits (after the scale)."""
    p = jnp.exp(_logits(cfg, qc, qr, ck, kr, kept) - lse[:, None])
    return p, p * (_dot(do, ck, 1, 1) - delta[:, None])


def _dq_kernel(qc_ref, qr_ref, c_ref, kr_ref, idx_ref, do_ref, lse_ref, delta_ref, dqc_ref, dqr_ref, *, cfg: Config):
    """Grid (B, T, N / bn), loop over key blocks: dq_c [bn, C], dq_r [bn, R]."""
    qc, qr, do, lse, delta = qc_ref[...], qr_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    bk = cfg.block_k

    def body(j, carry):
        dqc, dqr = carry
        kept, ck, kr = _gather(idx_ref, c_ref, kr_ref, pl.multiple_of(j * bk, bk), bk)
        _, ds = _ds(cfg, qc, qr, ck, kr, kept, do, lse, delta)
        return dqc + _dot(ds.astype(ck.dtype), ck), dqr + _dot(ds.astype(kr.dtype), kr)

    init = (jnp.zeros(qc.shape, jnp.float32), jnp.zeros(qr.shape, jnp.float32))
    dqc, dqr = lax.fori_loop(0, idx_ref.shape[0] // bk, body, init)
    dqc_ref[...] = (dqc * cfg.scale).astype(dqc_ref.dtype)
    dqr_ref[...] = (dqr * cfg.scale).astype(dqr_ref.dtype)


def _rows_kernel(qc_ref, qr_ref, c_ref, kr_ref, idx_ref, do_ref, lse_ref, delta_ref, dc_ref, dkr_ref, *, cfg: Config):
    """Grid (B, Tq, K / bk), loop over head blocks: the gradient rows of this query's chosen keys j*bk..+bk,
    dc rows [bk, C] and dk_r rows [bk, R] (float32), summed over all heads."""
    bn, bk = cfg.block_heads, cfg.block_k
    kept, ck, kr = _gather(idx_ref, c_ref, kr_ref, pl.multiple_of(pl.program_id(2) * bk, bk), bk)

    def body(h, carry):
        dc, dkr = carry
        heads = pl.ds(pl.multiple_of(h * bn, bn), bn)
        qc, qr, do = qc_ref[heads, :], qr_ref[heads, :], do_ref[heads, :]
        p, ds = _ds(cfg, qc, qr, ck, kr, kept, do, lse_ref[heads], delta_ref[heads])
        ds = (ds * cfg.scale).astype(qc.dtype)
        return dc + _dot(ds, qc, 0, 0) + _dot(p.astype(do.dtype), do, 0, 0), dkr + _dot(ds, qr, 0, 0)

    init = (jnp.zeros(ck.shape, jnp.float32), jnp.zeros(kr.shape, jnp.float32))
    dc, dkr = lax.fori_loop(0, qc_ref.shape[0] // bn, body, init)
    dc_ref[...] = dc
    dkr_ref[...] = dkr


def _bwd_kernel(qc_ref, qr_ref, c_ref, kr_ref, idx_ref, do_ref, lse_ref, delta_ref, dc_in_ref, dkr_in_ref,
                dqc_ref, dqr_ref, dc_ref, dkr_ref, *, cfg: Config):
    """Grid (B, T, N / bn), loop over key blocks, as the forward: dq_c [bn, C], dq_r [bn, R] of this head block, and
    its share of the chosen keys' gradient rows added into dc [S + K, C] and dk_r [S + K, R] (float32; row S + j
    takes slot j's zeros where it is not kept, so that no row is added to by every query's empty slots)."""
    del dc_in_ref, dkr_in_ref  # aliased to dc_ref and dkr_ref: zeros when the call starts
    qc, qr, do, lse, delta = qc_ref[...], qr_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    bk, s = cfg.bwd_block_k, c_ref.shape[0]

    def body(j, carry):
        dqc, dqr = carry
        start = pl.multiple_of(j * bk, bk)
        kept, ck, kr = _gather(idx_ref, c_ref, kr_ref, start, bk)
        p, ds = _ds(cfg, qc, qr, ck, kr, kept, do, lse, delta)
        rows = jnp.where(kept, idx_ref[pl.ds(start, bk)], s + start + lax.broadcasted_iota(jnp.int32, (bk,), 0))
        scaled = (ds * cfg.scale).astype(qc.dtype)  # as the rows kernel's
        ds = ds.astype(ck.dtype)  # as the dq kernel's
        state_primitives.ref_addupdate(dc_ref, (rows, slice(None)),
                                       _dot(scaled, qc, 0, 0) + _dot(p.astype(do.dtype), do, 0, 0))
        state_primitives.ref_addupdate(dkr_ref, (rows, slice(None)), _dot(scaled, qr, 0, 0))
        return dqc + _dot(ds, ck), dqr + _dot(ds, kr)

    init = (jnp.zeros(qc.shape, jnp.float32), jnp.zeros(qr.shape, jnp.float32))
    dqc, dqr = lax.fori_loop(0, idx_ref.shape[0] // bk, body, init)
    dqc_ref[...] = (dqc * cfg.scale).astype(dqc_ref.dtype)
    dqr_ref[...] = (dqr * cfg.scale).astype(dqr_ref.dtype)


def bwd_call(qc, qr, c, kr, idx, do, lse, delta, cfg):
    """(dq_c, dq_r, dc [B, S, C], dk_r [B, S, R]) of one fused kernel, tiled like the forward; dc and dk_r float32."""
    b, t, n, cw = qc.shape
    rw, s, k = qr.shape[-1], c.shape[1], idx.shape[-1]
    specs = _specs(cfg, qc, qr, c, kr, idx)
    row = pl.BlockSpec((None, None, cfg.block_heads), lambda b, t, h: (b, t, h))
    whole = lambda width: pl.BlockSpec((None, s + k, width), lambda b, t, h: (b, 0, 0))  # noqa: E731
    zeros = [jnp.zeros((b, s + k, width), jnp.float32) for width in (cw, rw)]
    dqc, dqr, dc, dkr = pl.pallas_call(
        functools.partial(_bwd_kernel, cfg=cfg), grid=(b, t, n // cfg.block_heads),
        in_specs=[*specs, specs[0], row, row, whole(cw), whole(rw)],
        out_specs=[*specs[:2], whole(cw), whole(rw)],
        out_shape=[jax.ShapeDtypeStruct(qc.shape, qc.dtype), jax.ShapeDtypeStruct(qr.shape, qr.dtype),
                   *(jax.ShapeDtypeStruct(z.shape, z.dtype) for z in zeros)],
        input_output_aliases={8: 2, 9: 3}, compiler_params=_params(cfg), interpret=cfg.interpret,
        name="selected_attention_bwd",
    )(qc, qr, c, kr, idx, do, lse, delta, *zeros)
    return dqc, dqr, dc[:, :s], dkr[:, :s]


def _params(cfg):
    return plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def _specs(cfg, qc, qr, c, kr, idx):
    """BlockSpecs over grid (b, t, h): a head block of one query; the batch's whole c, k_r; the query's idx."""
    bn, cw, rw, s, k = cfg.block_heads, qc.shape[-1], qr.shape[-1], c.shape[1], idx.shape[-1]
    return [pl.BlockSpec((None, None, bn, cw), lambda b, t, h: (b, t, h, 0)),
            pl.BlockSpec((None, None, bn, rw), lambda b, t, h: (b, t, h, 0)),
            pl.BlockSpec((None, s, cw), lambda b, t, h: (b, 0, 0)),
            pl.BlockSpec((None, s, rw), lambda b, t, h: (b, 0, 0)),
            pl.BlockSpec((None, None, k), lambda b, t, h: (b, t, 0))]


def forward_call(qc, qr, c, kr, idx, cfg):
    """(o_c [B, T, N, C] in c's dtype, lse [B, T, N], max logit [B, T, N]) on padded operands."""
    b, t, n, cw = qc.shape
    row = pl.BlockSpec((None, None, cfg.block_heads), lambda b, t, h: (b, t, h))
    return pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg), grid=(b, t, n // cfg.block_heads),
        in_specs=_specs(cfg, qc, qr, c, kr, idx),
        out_specs=[pl.BlockSpec((None, None, cfg.block_heads, cw), lambda b, t, h: (b, t, h, 0)), row, row],
        out_shape=[jax.ShapeDtypeStruct(qc.shape, c.dtype), jax.ShapeDtypeStruct((b, t, n), jnp.float32),
                   jax.ShapeDtypeStruct((b, t, n), jnp.float32)],
        compiler_params=_params(cfg), interpret=cfg.interpret, name="selected_attention_fwd",
    )(qc, qr, c, kr, idx)


def dq_call(qc, qr, c, kr, idx, do, lse, delta, cfg):
    """(dq_c, dq_r), tiled like the forward."""
    b, t, n, _ = qc.shape
    specs = _specs(cfg, qc, qr, c, kr, idx)
    row = pl.BlockSpec((None, None, cfg.block_heads), lambda b, t, h: (b, t, h))
    return pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg), grid=(b, t, n // cfg.block_heads),
        in_specs=[*specs, specs[0], row, row], out_specs=specs[:2],
        out_shape=[jax.ShapeDtypeStruct(qc.shape, qc.dtype), jax.ShapeDtypeStruct(qr.shape, qr.dtype)],
        compiler_params=_params(cfg), interpret=cfg.interpret, name="selected_attention_dq",
    )(qc, qr, c, kr, idx, do, lse, delta)


def rows_call(qc, qr, c, kr, idx, do, lse, delta, cfg):
    """(dc rows [B, Tq, K, C], dk_r rows [B, Tq, K, R]) float32: one program per (b, query, key block)."""
    b, t, n, cw = qc.shape
    rw, s, k, bk = qr.shape[-1], c.shape[1], idx.shape[-1], cfg.block_k
    heads = lambda width: pl.BlockSpec((None, None, n, width), lambda b, t, j: (b, t, 0, 0))  # noqa: E731
    whole = lambda width: pl.BlockSpec((None, s, width), lambda b, t, j: (b, 0, 0))  # noqa: E731
    row = pl.BlockSpec((None, None, n), lambda b, t, j: (b, t, 0))
    out = lambda width: pl.BlockSpec((None, None, bk, width), lambda b, t, j: (b, t, j, 0))  # noqa: E731
    return pl.pallas_call(
        functools.partial(_rows_kernel, cfg=cfg), grid=(b, t, k // bk),
        in_specs=[heads(cw), heads(rw), whole(cw), whole(rw), pl.BlockSpec((None, None, k), lambda b, t, j: (b, t, 0)),
                  heads(cw), row, row],
        out_specs=[out(cw), out(rw)],
        out_shape=[jax.ShapeDtypeStruct((b, t, k, cw), jnp.float32), jax.ShapeDtypeStruct((b, t, k, rw), jnp.float32)],
        compiler_params=_params(cfg), interpret=cfg.interpret, name="selected_attention_rows",
    )(qc, qr, c, kr, idx, do, lse, delta)


def _backward(cfg, qc, qr, c, kr, idx, o, lse, do):
    delta = jnp.einsum("BTNC,BTNC->BTN", do.astype(jnp.float32), o.astype(jnp.float32))
    do = do.astype(qc.dtype)
    if cfg.atomic:
        dqc, dqr, dc, dkr = bwd_call(qc, qr, c, kr, idx, do, lse, delta, cfg)
        return dqc, dqr, dc.astype(c.dtype), dkr.astype(kr.dtype)
    dqc, dqr = dq_call(qc, qr, c, kr, idx, do, lse, delta, cfg)
    b, t = qc.shape[:2]
    chunk = cfg.bwd_query_chunk

    def blocks(x):  # [B, T, ...] -> [T / chunk, B, chunk, ...]
        return jnp.moveaxis(x.reshape(b, t // chunk, chunk, *x.shape[2:]), 1, 0)

    def step(acc, xs):
        dc, dkr = acc
        qc_i, qr_i, idx_i, do_i, lse_i, delta_i = xs
        dc_rows, dkr_rows = rows_call(qc_i, qr_i, c, kr, idx_i, do_i, lse_i, delta_i, cfg)
        at = jnp.maximum(idx_i, 0).reshape(b, -1)  # slots not kept have zero rows: row 0 gets + 0
        add = jax.vmap(lambda acc, at, rows: acc.at[at].add(rows.reshape(at.shape[0], -1)))
        return (add(dc, at, dc_rows), add(dkr, at, dkr_rows)), None

    init = (jnp.zeros(c.shape, jnp.float32), jnp.zeros(kr.shape, jnp.float32))
    (dc, dkr), _ = lax.scan(step, init, tuple(map(blocks, (qc, qr, idx, do, lse, delta))))
    return dqc, dqr, dc.astype(c.dtype), dkr.astype(kr.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _selected(qc, qr, c, kr, idx, cfg):
    o, _, m = forward_call(qc, qr, c, kr, idx, cfg)
    return o, m


def _selected_fwd(qc, qr, c, kr, idx, cfg):
    o, lse, m = forward_call(qc, qr, c, kr, idx, cfg)
    return (o, m), (qc, qr, c, kr, idx, o, lse)


def _selected_bwd(cfg, residuals, cotangents):
    qc, qr, c, kr, idx, o, lse = residuals
    do, _ = cotangents  # the max logit is a statistic: no gradient
    return (*_backward(cfg, qc, qr, c, kr, idx, o, lse, do), None)


_selected.defvjp(_selected_fwd, _selected_bwd)


def pad_axis(x, axis, size, value=0):
    """x padded with `value` along `axis` up to `size` (x itself where it is that size already)."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def power_of_two_divisor(length, largest):
    """The largest power of two <= largest that divides length."""
    chunk = 1
    while chunk * 2 <= largest and length % (chunk * 2) == 0:
        chunk *= 2
    return chunk


def selected_attention(q_c, q_r, c, k_r, idx, kept, *, scale: float, block_heads: int = 16, block_k: int = 64,
                       bwd_block_k: int = 32, bwd_query_chunk: int = 128, interpret: bool | None = None,
                       with_max_logits: bool = False, num_warps: int = 4, num_stages: int = 2, atomic: bool = False):
    """o_c [B, T, N, C] (c's dtype) of each query's heads over its chosen keys; with with_max_logits also each head's
    largest kept logit [N] float32 (no gradient; -inf for a head no query kept a key for).

    q_c [B, T, N, C] (the absorbed queries), q_r [B, T, N, R], c [B, S, C], k_r [B, S, R], idx [B, T, K] int32 key
    indices into S, kept [B, T, K] bool (false: the slot is ignored). interpret: None runs interpret mode off GPUs.
    atomic: the backward as one kernel adding the key rows' gradients atomically, over key blocks of bwd_block_k (at
    most block_k; heads x keys 16 x 64 asks an H100 for 276,736 B of shared memory at C 512, 16 x 32 and 32 x 32
    fit, 64 x 32 does not); False (the default, the one measured on a GPU): the rows written per chunk of
    bwd_query_chunk queries and scatter-added."""
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, t, n, cw = q_c.shape
    rw, k = q_r.shape[-1], idx.shape[-1]
    least = 1 if interpret else 16  # Triton's dots: every tile side >= 16 (a small model's are padded up to it)
    bn = min(block_heads, max(least, pl.next_power_of_2(n)))
    bk = min(block_k, max(least, pl.next_power_of_2(k)))
    cfg = Config(scale=float(scale), block_heads=bn, block_k=bk, bwd_block_k=min(bk, max(least, bwd_block_k)),
                 bwd_query_chunk=power_of_two_divisor(t, bwd_query_chunk), interpret=interpret, num_warps=num_warps,
                 num_stages=num_stages, atomic=atomic)
    n_pad = -(-n // bn) * bn
    c_pad, r_pad = max(least, pl.next_power_of_2(cw)), max(least, pl.next_power_of_2(rw))
    k_pad = -(-k // bk) * bk
    qc = pad_axis(pad_axis(q_c, 2, n_pad), 3, c_pad)
    qr = pad_axis(pad_axis(q_r, 2, n_pad), 3, r_pad)
    at = pad_axis(jnp.where(kept, idx, -1).astype(jnp.int32), 2, k_pad, value=-1)
    o, m = _selected(qc, qr, pad_axis(c, 2, c_pad), pad_axis(k_r, 2, r_pad), at, cfg)
    o = o[:, :, :n, :cw]
    if not with_max_logits:
        return o
    m = jnp.where(m[:, :, :n] > 0.25 * _MASK_VALUE, m[:, :, :n], -jnp.inf)
    return o, jnp.max(lax.stop_gradient(m), axis=(0, 1))
