"""Attention over each query's chosen keys (DeepSeek-V3.2's sparse attention, MLA in absorbed form) in Pallas Mosaic
for TPUs, forward and backward under jax.custom_vjp; Pallas' interpreters run it on CPU (tests).

What: the same numbers as kernels/selected_attention.py (the Triton kernel; its docstring has the formulas) and as
models/families/deepseek/selected.py's plain-jnp form, its reference: per query t and head n over the K keys
idx[t, :] (kept[t, j] false for the slots of a query that sees fewer than K), softmax of
(q_c . c[idx] + q_r . k_r[idx]) * scale, times c[idx]; o_c, and each head's largest kept logit (QK-clip's).

Why a kernel of its own: Mosaic has no vector-indexed row gather from a ref (Triton's c_ref[idx, :]), so each chosen
key's row is copied from HBM into VMEM by a DMA of its own, addressed by a scalar read of idx from SMEM.

Rows. The latent and the RoPE key of a token are one row, wide = [c, k_r] (C + R = 576 at DeepSeek-V3.2), padded to
2H lanes (H a multiple of 128: 2H = 768) and split into halves lo = wide[:H], hi = wide[H:], so one DMA fetches a
key (1,536 B in bfloat16 for its 1,152 B). In
bfloat16 the row is stored as uint32 [H], each word lo's bits | hi's bits << 16: Mosaic copies 16-bit rows only in
pairs (a one-row DMA into a bfloat16 buffer is refused: "not aligned to the unit subtile (2)"), 32-bit rows singly;
the kernel gets the halves back with a shift and a mask (a bfloat16 is the top half of a float32). Other dtypes are
stored as float32 [2H] (exact for float16). The queries are widened alike, q_wide = [q_c, q_r, 0] = [q_lo, q_hi]:
    s = (q_lo . lo + q_hi . hi) * scale,   o_wide = softmax(s) [lo, hi],   o_c = o_wide[:C]
and so the backward (dO widened with zeros: its R + pad columns add nothing to dO . wide):
    dq_wide = scale dS wide,   d wide rows = scale dS^T q_wide + P^T dO_wide   -> dq_c, dq_r, dc, dk_r by columns.

Tiling. Grid (B, T / block_queries, N / block_heads), every axis parallel: a program takes a block of queries and
heads, and steps through (query, key block) pairs, `block_k` keys a step. Its gather is double-buffered: while it
computes step i over VMEM slot i % 2 (s [bn, bk], an online softmax with running max m, denominator l and the
[bn, 2H] float32 accumulator in VMEM scratch) the DMAs of step i + 1 (the next key block, or the next query's first)
fill the other slot; a slot's copies signal its semaphore and are waited one by one. idx reaches the kernel twice:
as SMEM blocks [block_queries x K] (the DMAs' addresses; the whole of idx, B x T x K int32, does not fit SMEM's
1 MiB, so it is not a scalar-prefetch operand) and as VMEM [block_queries, 1, K] (the kept mask, a vector). Slots not
kept start no copy: their rows hold an earlier step's (finite: the buffers are zeroed when a program starts) and get
P = 0. Outputs o_wide [bq, bn, 2H], log-sum-exp and max [bq, bn, 1], written when a query's last block is done.

Backward (P recomputed from the saved log-sum-exp; delta = rowsum(dO * O) in jnp), as the Triton rows form:
    dq kernel,   tiled as the forward:                           dq_wide [bq, bn, 2H]
    rows kernel, grid (B, Tc / rows_queries, K / block_k), all heads a program, a step a query (double-buffered):
                 the float32 gradient rows [bk, 2H] of the query's chosen keys, summed over the heads
and a jnp scatter-add of the rows into [B, S, 2H] float32 per chunk of `bwd_query_chunk` queries (a scan); slots
not kept have zero rows, added to row 0.

Padding (in `selected_attention`): heads to a multiple of 8 (float32) or 16 (16-bit: the sublane tile) and of
block_heads; K to a multiple of block_k (slots not kept; compiled, block_k is a multiple of 128 lanes, and K below
it is padded to 128).

Compiled (tests/kernels/test_kernel_lowering.py; jax 0.12's libtpu, 2026-12-02) for v5p and v6e, forward and
backward, at DeepSeek-V3.2's head shapes: 128 heads, C 512, R 64, K 2048, 256 queries over 2,048 keys, bfloat16, the
default tiles (8 queries x 128 heads a program, 128 keys a step, rows kernel 4 queries): ~30 s a compile; the forward
asks 8.9 MiB of scoped VMEM (refused under an 8 MiB limit), all three kernels compile under a 12 MiB one (the calls
set 48 MiB: v5p has 64 a core, v5e and v6e 128). The rows of one chunk of 128 queries are 805 MB of float32 (1.0 GB
of temporaries in that test). It has not run on a TPU yet: no speed is known.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from maxtrain.kernels.selected_attention import pad_axis, power_of_two_divisor

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # exp(masked - running max) == 0
LANES = 128


@dataclasses.dataclass(frozen=True)
class Config:
    """Static parameters of the three kernels."""
    scale: float
    half: int                # H: lanes of each half of a wide row
    packed: bool             # 16-bit rows stored as uint32 pairs (lo | hi << 16)
    block_queries: int
    block_heads: int
    block_k: int
    rows_queries: int
    bwd_query_chunk: int
    interpret: object        # False, True (Pallas' interpreter), "tpu" or pltpu.InterpretParams (its TPU interpreter)
    vmem_limit: int = 48 * 2**20


def _interpret(cfg):
    if isinstance(cfg.interpret, pltpu.InterpretParams):
        return cfg.interpret
    return pltpu.InterpretParams() if cfg.interpret == "tpu" else bool(cfg.interpret)


def _params(cfg):
    return pltpu.CompilerParams(dimension_semantics=("parallel",) * 3, vmem_limit_bytes=cfg.vmem_limit)


def _dot(a, b, contract_a=1, contract_b=0):
    """2-D matmul with float32 accumulation; contract_a=0 uses a^T, contract_b=1 uses b^T."""
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())), preferred_element_type=jnp.float32)


class _Gather:
    """The double-buffered row copies of one program: step (q, j) = query q of the block, its key block j."""

    def __init__(self, cfg, idx_smem, table_ref, buf_ref, sem_ref, slots: int):
        self.cfg, self.idx, self.table, self.buf, self.sem = cfg, idx_smem, table_ref, buf_ref, sem_ref
        self.batch, self.slots = pl.program_id(0), slots

    def _each(self, q, j, fn):
        bk = self.cfg.block_k
        base = q * self.slots + j * bk

        def one(i, carry):
            row = self.idx[base + i]

            @pl.when(row >= 0)
            def _():
                fn(i, row)
            return carry
        lax.fori_loop(0, bk, one, 0)

    def _copy(self, slot, i, row):
        return pltpu.make_async_copy(self.table.at[self.batch, pl.ds(row, 1)], self.buf.at[slot, pl.ds(i, 1)],
                                     self.sem.at[slot])

    def start(self, q, j, slot):
        self._each(q, j, lambda i, row: self._copy(slot, i, row).start())

    def wait(self, q, j, slot):
        self._each(q, j, lambda i, row: self._copy(slot, 0, 0).wait())  # one row's bytes each

    def halves(self, slot, dtype):
        """(lo, hi) [bk, H] of the rows in `slot`, in `dtype`."""
        x, h = self.buf[slot], self.cfg.half
        if self.cfg.packed:
            lo = lax.bitcast_convert_type(x << 16, jnp.float32)
            hi = lax.bitcast_convert_type(x & jnp.uint32(0xFFFF0000), jnp.float32)
        else:
            lo, hi = x[:, :h], x[:, h:]
        return lo.astype(dtype), hi.astype(dtype)


def _steps(gather, queries, key_blocks, body, key_block=None):
    """Runs body(q, j, slot) over every (query, key block) pair in order, the next pair's rows copied meanwhile;
    key_block: the one key block of every query (key_blocks 1)."""
    steps = queries * key_blocks
    at = (lambda j: j) if key_block is None else (lambda j: key_block)  # noqa: E731
    gather.buf[...] = jnp.zeros(gather.buf.shape, gather.buf.dtype)  # rows never copied: finite (P = 0 there)
    gather.start(0, at(0), 0)

    def step(s, carry):
        q, j, slot = s // key_blocks, s % key_blocks, s % 2

        @pl.when(s + 1 < steps)
        def _():
            gather.start((s + 1) // key_blocks, at((s + 1) % key_blocks), 1 - slot)
        gather.wait(q, at(j), slot)
        body(q, at(j), slot)
        return carry
    lax.fori_loop(0, steps, step, 0)


def _logits(cfg, q_wide, lo, hi, keep):
    """Scaled logits [bn, bk] of heads q_wide [bn, 2H] against a key block's halves, _MASK_VALUE where not kept."""
    h = cfg.half
    s = (_dot(q_wide[:, :h], lo, 1, 1) + _dot(q_wide[:, h:], hi, 1, 1)) * cfg.scale
    return jnp.where(keep, s, _MASK_VALUE)


def _keep(cfg, idx_vmem, q, j):
    """[1, bk] bool: which slots of query q's key block j are kept."""
    return idx_vmem[q, :, pl.ds(pl.multiple_of(j * cfg.block_k, cfg.block_k), cfg.block_k)] >= 0


def _fwd_kernel(idx_smem, q_ref, idx_vmem, table_ref, o_ref, lse_ref, max_ref, buf, sem, m_sc, l_sc, acc_sc, *,
                cfg: Config):
    """q [bq, bn, 2H], idx [bq, 1, K] -> o_wide [bq, bn, 2H], lse, max [bq, bn, 1]."""
    bq, slots, h = q_ref.shape[0], idx_vmem.shape[-1], cfg.half
    nk = slots // cfg.block_k
    gather = _Gather(cfg, idx_smem, table_ref, buf, sem, slots)

    def body(q, j, slot):
        @pl.when(j == 0)
        def _():
            m_sc[...] = jnp.full(m_sc.shape, 0.5 * _MASK_VALUE, jnp.float32)
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
            acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

        q_wide = q_ref[q]
        lo, hi = gather.halves(slot, q_wide.dtype)
        s = _logits(cfg, q_wide, lo, hi, _keep(cfg, idx_vmem, q, j))
        m = m_sc[...]
        m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m - m_new)
        m_sc[...] = m_new
        l_sc[...] = l_sc[...] * alpha + jnp.sum(p, axis=1, keepdims=True)
        p = p.astype(lo.dtype)
        acc_sc[:, :h] = acc_sc[:, :h] * alpha + _dot(p, lo)
        acc_sc[:, h:] = acc_sc[:, h:] * alpha + _dot(p, hi)

        @pl.when(j == nk - 1)
        def _():
            l = l_sc[...]
            l = jnp.where(l == 0.0, 1.0, l)  # a query with no kept key: acc == 0, output 0
            o_ref[q] = (acc_sc[...] / l).astype(o_ref.dtype)
            lse_ref[q] = m_sc[...] + jnp.log(l)
            max_ref[q] = m_sc[...]

    _steps(gather, bq, nk, body)


def _ds(cfg, q_wide, do, lse, delta, lo, hi, keep):
    """(P, dS) [bn, bk] of a head block against a key block; dS = d loss / d logits (after the scale)."""
    h = cfg.half
    p = jnp.exp(_logits(cfg, q_wide, lo, hi, keep) - lse)
    dp = _dot(do[:, :h], lo, 1, 1) + _dot(do[:, h:], hi, 1, 1)
    return p, p * (dp - delta)


def _dq_kernel(idx_smem, q_ref, do_ref, lse_ref, delta_ref, idx_vmem, table_ref, dq_ref, buf, sem, dq_sc, *,
               cfg: Config):
    """Tiled as the forward: dq_wide [bq, bn, 2H]."""
    bq, slots, h = q_ref.shape[0], idx_vmem.shape[-1], cfg.half
    nk = slots // cfg.block_k
    gather = _Gather(cfg, idx_smem, table_ref, buf, sem, slots)

    def body(q, j, slot):
        @pl.when(j == 0)
        def _():
            dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

        q_wide = q_ref[q]
        lo, hi = gather.halves(slot, q_wide.dtype)
        _, ds = _ds(cfg, q_wide, do_ref[q], lse_ref[q], delta_ref[q], lo, hi, _keep(cfg, idx_vmem, q, j))
        ds = ds.astype(lo.dtype)
        dq_sc[:, :h] += _dot(ds, lo)
        dq_sc[:, h:] += _dot(ds, hi)

        @pl.when(j == nk - 1)
        def _():
            dq_ref[q] = (dq_sc[...] * cfg.scale).astype(dq_ref.dtype)

    _steps(gather, bq, nk, body)


def _rows_kernel(idx_smem, q_ref, do_ref, lse_ref, delta_ref, idx_vmem, table_ref, rows_ref, buf, sem, *,
                 cfg: Config):
    """Grid (B, Tc / bq, K / bk), all heads: rows [bq, bk, 2H] float32, the gradient rows of key block
    program_id(2) of each of the bq queries, summed over the heads."""
    bq, slots, h, j = q_ref.shape[0], idx_vmem.shape[-1], cfg.half, pl.program_id(2)
    gather = _Gather(cfg, idx_smem, table_ref, buf, sem, slots)

    def body(q, j, slot):
        q_wide, do = q_ref[q], do_ref[q]
        lo, hi = gather.halves(slot, q_wide.dtype)
        p, ds = _ds(cfg, q_wide, do, lse_ref[q], delta_ref[q], lo, hi, _keep(cfg, idx_vmem, q, j))
        ds = (ds * cfg.scale).astype(q_wide.dtype)
        p = p.astype(do.dtype)
        rows_ref[q, :, :h] = _dot(ds, q_wide[:, :h], 0, 0) + _dot(p, do[:, :h], 0, 0)
        rows_ref[q, :, h:] = _dot(ds, q_wide[:, h:], 0, 0) + _dot(p, do[:, h:], 0, 0)

    _steps(gather, bq, 1, body, key_block=j)  # a step is a query, at this program's key block


def _scratch(cfg, table):
    width = table.shape[-1]
    return [pltpu.VMEM((2, cfg.block_k, width), table.dtype), pltpu.SemaphoreType.DMA((2,))]


def _call(kernel, cfg, grid, idx, blocked, outs, out_specs, table, scratch, name):
    """pallas_call with idx as SMEM blocks (first) and VMEM blocks and the table in HBM (last two inputs)."""
    b, t, slots = idx.shape
    bq = blocked[0][1].block_shape[1]
    blocks = t // bq  # SMEM blocks of a 1-D idx (a 2-D one's rows, B, would be a tiled dimension)
    smem = pl.BlockSpec((bq * slots,), lambda b, i, h: (b * blocks + i,), memory_space=pltpu.SMEM)
    vmem = pl.BlockSpec((None, bq, 1, slots), lambda b, i, h: (b, i, 0, 0))
    return pl.pallas_call(
        functools.partial(kernel, cfg=cfg), grid=grid,
        in_specs=[smem, *(spec for _, spec in blocked), vmem, pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=out_specs, out_shape=outs, scratch_shapes=_scratch(cfg, table) + scratch,
        compiler_params=_params(cfg), interpret=_interpret(cfg), name=name,
    )(idx.reshape(b * t * slots), *(x for x, _ in blocked), idx.reshape(b, t, 1, slots), table)


def _head_specs(width, bq, bn):
    return pl.BlockSpec((None, bq, bn, width), lambda b, i, h: (b, i, h, 0))


def forward_call(q_wide, table, idx, cfg):
    """(o_wide [B, T, N, 2H] in q's dtype, lse [B, T, N, 1], max logit [B, T, N, 1]) on padded operands."""
    b, t, n, width = q_wide.shape
    bq, bn = cfg.block_queries, cfg.block_heads
    spec, stat = _head_specs(width, bq, bn), _head_specs(1, bq, bn)
    stats = jax.ShapeDtypeStruct((b, t, n, 1), jnp.float32)
    return _call(_fwd_kernel, cfg, (b, t // bq, n // bn), idx, [(q_wide, spec)],
                 [jax.ShapeDtypeStruct(q_wide.shape, q_wide.dtype), stats, stats], [spec, stat, stat], table,
                 [pltpu.VMEM((bn, 1), jnp.float32)] * 2 + [pltpu.VMEM((bn, width), jnp.float32)],
                 "selected_attention_tpu_fwd")


def dq_call(q_wide, do_wide, lse, delta, table, idx, cfg):
    b, t, n, width = q_wide.shape
    bq, bn = cfg.block_queries, cfg.block_heads
    spec, stat = _head_specs(width, bq, bn), _head_specs(1, bq, bn)
    return _call(_dq_kernel, cfg, (b, t // bq, n // bn), idx, [(q_wide, spec), (do_wide, spec), (lse, stat),
                                                                (delta, stat)],
                 jax.ShapeDtypeStruct(q_wide.shape, q_wide.dtype), spec, table,
                 [pltpu.VMEM((bn, width), jnp.float32)], "selected_attention_tpu_dq")


def rows_call(q_wide, do_wide, lse, delta, table, idx, cfg):
    """Gradient rows [B, Tc, K, 2H] float32 of a chunk of Tc queries' chosen keys."""
    b, t, n, width = q_wide.shape
    bq, bk, slots = cfg.rows_queries, cfg.block_k, idx.shape[-1]
    spec, stat = _head_specs(width, bq, n), _head_specs(1, bq, n)
    spec, stat = (pl.BlockSpec(s.block_shape, lambda b, i, j: (b, i, 0, 0)) for s in (spec, stat))
    out = pl.BlockSpec((None, bq, bk, width), lambda b, i, j: (b, i, j, 0))
    return _call(_rows_kernel, cfg, (b, t // bq, slots // bk), idx, [(q_wide, spec), (do_wide, spec), (lse, stat),
                                                                     (delta, stat)],
                 jax.ShapeDtypeStruct((b, t, slots, width), jnp.float32), out, table, [],
                 "selected_attention_tpu_rows")


def _widen(x, width):
    """[..., a] and [..., b] -> [..., a + b] padded with zeros to `width`."""
    return x if x.shape[-1] == width else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])


def _table(c, k_r, cfg):
    """The keys' wide rows [B, S, H] uint32 (bfloat16 pairs) or [B, S, 2H] float32."""
    wide = _widen(jnp.concatenate([c, k_r.astype(c.dtype)], axis=-1), 2 * cfg.half)
    if not cfg.packed:
        return wide.astype(jnp.float32)
    bits = lax.bitcast_convert_type(wide, jnp.uint16).astype(jnp.uint32)
    return bits[..., :cfg.half] | (bits[..., cfg.half:] << 16)


def _backward(cfg, q_wide, table, idx, o_wide, lse, do_wide):
    delta = jnp.sum(do_wide.astype(jnp.float32) * o_wide.astype(jnp.float32), axis=-1, keepdims=True)
    do_wide = do_wide.astype(q_wide.dtype)
    dq = dq_call(q_wide, do_wide, lse, delta, table, idx, cfg)
    b, t = q_wide.shape[:2]
    chunk = cfg.bwd_query_chunk

    def blocks(x):  # [B, T, ...] -> [T / chunk, B, chunk, ...]
        return jnp.moveaxis(x.reshape(b, t // chunk, chunk, *x.shape[2:]), 1, 0)

    def step(acc, xs):
        q_i, do_i, lse_i, delta_i, idx_i = xs
        rows = rows_call(q_i, do_i, lse_i, delta_i, table, idx_i, cfg)
        at = jnp.maximum(idx_i, 0).reshape(b, -1)  # slots not kept have zero rows: row 0 gets + 0
        return jax.vmap(lambda acc, at, rows: acc.at[at].add(rows.reshape(at.shape[0], -1)))(acc, at, rows), None

    init = jnp.zeros((b, table.shape[1], 2 * cfg.half), jnp.float32)
    d_wide, _ = lax.scan(step, init, tuple(map(blocks, (q_wide, do_wide, lse, delta, idx))))
    return dq, d_wide


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _selected(q_c, q_r, c, k_r, idx, cfg):
    return _selected_fwd(q_c, q_r, c, k_r, idx, cfg)[0]


def _selected_fwd(q_c, q_r, c, k_r, idx, cfg):
    q_wide = _widen(jnp.concatenate([q_c, q_r.astype(q_c.dtype)], axis=-1), 2 * cfg.half)
    table = _table(c, k_r, cfg)
    o_wide, lse, m = forward_call(q_wide, table, idx, cfg)
    o = o_wide[..., :c.shape[-1]].astype(c.dtype)
    return (o, m[..., 0]), (q_wide, table, idx, o_wide, lse, q_r, k_r)


def _selected_bwd(cfg, residuals, cotangents):
    q_wide, table, idx, o_wide, lse, q_r, k_r = residuals
    do, _ = cotangents  # the max logit is a statistic: no gradient
    cw, rw = do.shape[-1], q_r.shape[-1]
    dq, d_wide = _backward(cfg, q_wide, table, idx, o_wide, lse, _widen(do.astype(q_wide.dtype), q_wide.shape[-1]))
    c_dtype = do.dtype
    return (dq[..., :cw], dq[..., cw:cw + rw].astype(q_r.dtype), d_wide[..., :cw].astype(c_dtype),
            d_wide[..., cw:cw + rw].astype(k_r.dtype), None)


_selected.defvjp(_selected_fwd, _selected_bwd)


def selected_attention(q_c, q_r, c, k_r, idx, kept, *, scale: float, block_queries: int = 8, block_heads: int = 128,
                       block_k: int = 128, rows_queries: int = 4, bwd_query_chunk: int = 128,
                       interpret=None, with_max_logits: bool = False):
    """o_c [B, T, N, C] (c's dtype) of each query's heads over its chosen keys; with with_max_logits also each head's
    largest kept logit [N] float32 (no gradient; -inf for a head no query kept a key for). As
    kernels/selected_attention.selected_attention: q_c [B, T, N, C], q_r [B, T, N, R], c [B, S, C], k_r [B, S, R],
    idx [B, T, K] int32, kept [B, T, K] bool.

    block_queries (forward and dq) and rows_queries (the rows kernel): queries a program, at most (the largest power
    of two that divides T); block_heads: heads a program; block_k: keys a step (compiled: a multiple of 128; K is padded to one).
    interpret: None runs Pallas' interpreter off TPUs; "tpu" (or a pltpu.InterpretParams) its TPU interpreter, which
    simulates the DMAs and semaphores."""
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    b, t, n, cw = q_c.shape
    rw, k = q_r.shape[-1], idx.shape[-1]
    if not interpret and block_k % LANES:
        raise ValueError(f"block_k={block_k} must be a multiple of {LANES} (the TPU's lanes)")
    bk = min(block_k, -(-k // (8 if interpret else LANES)) * (8 if interpret else LANES))
    packed = c.dtype == jnp.bfloat16
    tile = 8 if jnp.dtype(q_c.dtype).itemsize == 4 else 16  # the sublane tile of q's blocks
    bn = min(block_heads, -(-n // tile) * tile)
    chunk = power_of_two_divisor(t, bwd_query_chunk)
    cfg = Config(scale=float(scale), half=-(-(cw + rw) // (2 * LANES)) * LANES, packed=packed,
                 block_queries=power_of_two_divisor(t, block_queries), block_heads=bn, block_k=bk,
                 rows_queries=power_of_two_divisor(chunk, rows_queries), bwd_query_chunk=chunk, interpret=interpret)
    n_pad, k_pad = -(-n // bn) * bn, -(-k // bk) * bk
    at = pad_axis(jnp.where(kept, idx, -1).astype(jnp.int32), 2, k_pad, value=-1)
    o, m = _selected(pad_axis(q_c, 2, n_pad), pad_axis(q_r, 2, n_pad), c, k_r, at, cfg)
    o = o[:, :, :n]
    if not with_max_logits:
        return o
    m = jnp.where(m[:, :, :n] > 0.25 * _MASK_VALUE, m[:, :, :n], -jnp.inf)
    return o, jnp.max(lax.stop_gradient(m), axis=(0, 1))
