"""Grouped matmul (dropless MoE's experts) in Pallas Triton: only the rows routed to each group are computed.

    grouped_matmul(x [M, K], w [G, K, N], group_sizes [G]) -> [M, N]
        rows o_g .. o_g + s_g - 1 (o_g = s_0 + ... + s_{g-1}) multiply w[g]; rows past sum(s): 0

the same function as `jax.lax.ragged_dot(x, w, group_sizes)`, which XLA:GPU (without cuDNN >= 9.22) and
XLA:CPU lower as a dense masked matmul over every group: G times the work (docs/moe.md). Gradients
(a custom VJP, both grouped):

    dx = grouped_matmul(dy, w^T)                          (the forward kernel reading w transposed)
    dw[g] = x[rows of g]^T dy[rows of g]   [G, K, N]      (transposed grouped matmul; an empty group: 0)

Forward kernel: the rows are cut into tiles of block_m; a tile that holds rows of several groups runs
once for each of them, storing only that group's rows (masked stores), so the grid is at most
M / block_m + G tiles (+1 for the rows past sum(s), stored as zeros) by N / block_n columns, each
looping over K. Which (group, row block) each tile is comes from a small table computed beforehand
with jnp (`tile_table`). Weight-gradient kernel: one program per (group, K block, N block), looping
over the group's row blocks (a dynamic trip count) with rows outside the group zeroed.

Operands are padded to whole tiles (rows to block_m, K and N to multiples of 16 with power-of-two
blocks), so every load stays in bounds (interpret mode on CPU clamps out-of-bounds slices, a GPU
would read past the array). `interpret=True` runs the same kernels on CPU (tests); the GPU form is
chosen by models/expert_matmuls.resolve_grouped_matmul and compiled for an H100 ahead of time in
tests/kernels/test_kernel_lowering.py.
Imports nothing else of maxtrain.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Block sizes and launch parameters. forward: rows, K, N blocks of the forward (and input-gradient)
    kernel; the weight gradient's: rows looped, K and N blocks of its [K, N] output tile."""

    block_m: int = 64
    block_k: int = 64
    block_n: int = 128
    warps: int = 4
    stages: int = 3
    t_block_m: int = 64
    t_block_k: int = 128
    t_block_n: int = 128
    t_warps: int = 8
    t_stages: int = 2


DEFAULT_TILES = Tiles()
MIN_BLOCK = 16  # Triton's smallest dot operand


def _block(dim: int, target: int) -> int:
    """The largest power of two <= target dividing dim (dim a multiple of MIN_BLOCK)."""
    b = max(MIN_BLOCK, 1 << (min(dim, target).bit_length() - 1))
    while dim % b:
        b //= 2
    return b


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def grouped_matmul(x, w, group_sizes, *, implementation: str = "pallas", interpret: bool = False,
                   tiles: Tiles = DEFAULT_TILES):
    """x [M, K] @ w[g] for each group's rows -> [M, N] in x's dtype (float32 accumulation); see the module
    docstring. implementation "xla": jax.lax.ragged_dot, the reference."""
    if implementation == "xla":
        return lax.ragged_dot(x, w, group_sizes, preferred_element_type=x.dtype)
    # Inside shard_map the operands are first made to vary alike (the weights' gradient then sums over the token
    # axes in the transpose of that cast, outside the custom VJP, whose cotangents must vary as its inputs do).
    x, w, group_sizes = _same_varying(x, w.astype(x.dtype), group_sizes.astype(jnp.int32))
    return _gmm(x, w, group_sizes, tiles, bool(interpret))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x, w, group_sizes, tiles, interpret):
    return _forward(x, w, group_sizes, tiles, interpret)


def _gmm_fwd(x, w, group_sizes, tiles, interpret):
    return _forward(x, w, group_sizes, tiles, interpret), (x, w, group_sizes)


def _gmm_bwd(tiles, interpret, residuals, dy):
    x, w, group_sizes = residuals
    dx = _forward(dy.astype(x.dtype), w, group_sizes, tiles, interpret, transpose_w=True)
    dw = _weight_grad(x, dy.astype(x.dtype), group_sizes, w.shape[0], tiles, interpret)
    return dx, dw.astype(w.dtype), None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


# ----------------------------------------------------------------------------------------------
# Inside shard_map (check_vma): the operands are made to vary over the same manual mesh axes, and the output is
# declared to vary over them too (the tokens vary over the batch axes, the experts over the expert axes).


def _varying(a) -> frozenset:
    aval = jax.typeof(a)
    axis_type = getattr(aval, "manual_axis_type", None)
    return axis_type.varying if axis_type is not None else frozenset(getattr(aval, "vma", ()))


def _same_varying(*arrays):
    union = frozenset().union(*(_varying(a) for a in arrays))
    return [jax.lax.pcast(a, tuple(sorted(union - _varying(a))), to="varying") if union - _varying(a) else a
            for a in arrays]


def _out_struct(shape, dtype, like):
    """A ShapeDtypeStruct varying over the manual axes `like` varies over (jax 0.10: manual_axis_type; else vma)."""
    aval = jax.typeof(like)
    axis_type = getattr(aval, "manual_axis_type", None)
    if axis_type is not None:
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=axis_type)
    return jax.ShapeDtypeStruct(shape, dtype, vma=frozenset(getattr(aval, "vma", ())))


# ----------------------------------------------------------------------------------------------
# Forward: [M, K] x [G, K, N] -> [M, N]


def tile_table(group_sizes, num_rows: int, block_m: int):
    """For each of the grid's tiles: (group, row block, first row, end row) [num_tiles] int32 each. Group G
    is the rows past sum(group_sizes) (stored as zeros); unused tiles have an empty row range."""
    g = group_sizes.shape[0]
    sizes = jnp.concatenate([group_sizes, jnp.maximum(num_rows - jnp.sum(group_sizes), 0)[None]])
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first_block = starts // block_m
    blocks = jnp.where(sizes > 0, -(-ends // block_m) - first_block, 0)
    tiles_end = jnp.cumsum(blocks)
    num_tiles = num_rows // block_m + g + 1
    tile = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(tiles_end, tile, side="right"), g).astype(jnp.int32)
    used = tile < tiles_end[-1]
    row_block = jnp.where(used, first_block[group] + tile - (tiles_end[group] - blocks[group]), 0)
    lo = jnp.where(used, starts[group], 0)
    hi = jnp.where(used, ends[group], 0)
    return group, row_block.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32)


def _forward_kernel(group_ref, block_ref, lo_ref, hi_ref, x_ref, w_ref, o_ref, *, block_m, block_k, block_n,
                    num_groups, transpose_w):
    tile, col = pl.program_id(0), pl.program_id(1)
    group, lo, hi = group_ref[tile], lo_ref[tile], hi_ref[tile]
    row0 = pl.multiple_of(block_ref[tile] * block_m, block_m)
    col0 = pl.multiple_of(col * block_n, block_n)
    w_group = jnp.minimum(group, num_groups - 1)  # group G (rows past the groups) stores zeros

    def body(kb, acc):
        k0 = pl.multiple_of(kb * block_k, block_k)
        a = x_ref[pl.ds(row0, block_m), pl.ds(k0, block_k)]
        if transpose_w:  # w [G, N, K]: a @ w[g]^T, read as stored (no transposed copy of the weights)
            b = w_ref[w_group, pl.ds(col0, block_n), pl.ds(k0, block_k)]
            return acc + lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        b = w_ref[w_group, pl.ds(k0, block_k), pl.ds(col0, block_n)]
        return acc + lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, x_ref.shape[1] // block_k, body, jnp.zeros((block_m, block_n), jnp.float32))
    acc = jnp.where(group < num_groups, acc, 0.0)
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m, block_n), 0)
    plgpu.store(o_ref.at[pl.ds(row0, block_m), pl.ds(col0, block_n)], acc.astype(o_ref.dtype),
                mask=(rows >= lo) & (rows < hi))


def _forward(x, w, group_sizes, tiles: Tiles, interpret: bool, transpose_w: bool = False):
    """x [M, K] with w [G, K, N] (or, transpose_w, w [G, N, K] used as its transpose) -> [M, N]."""
    m, k = x.shape
    g, n = w.shape[0], w.shape[1 if transpose_w else 2]
    bm = tiles.block_m
    mp, kp, np_ = _round_up(m, bm), _round_up(k, MIN_BLOCK), _round_up(n, MIN_BLOCK)
    bk, bn = _block(kp, tiles.block_k), _block(np_, tiles.block_n)
    x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    w = jnp.pad(w, ((0, 0), (0, np_ - n), (0, kp - k)) if transpose_w else ((0, 0), (0, kp - k), (0, np_ - n)))
    *table, x, w = _same_varying(*tile_table(group_sizes, mp, bm), x, w)
    out = pl.pallas_call(
        functools.partial(_forward_kernel, block_m=bm, block_k=bk, block_n=bn, num_groups=g, transpose_w=transpose_w),
        grid=(table[0].shape[0], np_ // bn),
        out_shape=_out_struct((mp, np_), x.dtype, x),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret,
        name="grouped_matmul",
    )(*table, x, w)
    return out[:m, :n]


# ----------------------------------------------------------------------------------------------
# Weight gradient: [M, K] x [M, N] -> [G, K, N]


def _weight_grad_kernel(lo_ref, hi_ref, x_ref, dy_ref, o_ref, *, block_m, block_k, block_n):
    group, kb, nb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lo, hi = lo_ref[group], hi_ref[group]
    k0 = pl.multiple_of(kb * block_k, block_k)
    n0 = pl.multiple_of(nb * block_n, block_n)

    def body(rb, acc):
        row0 = pl.multiple_of(rb * block_m, block_m)
        rows = row0 + lax.broadcasted_iota(jnp.int32, (block_m, block_k), 0)
        a = x_ref[pl.ds(row0, block_m), pl.ds(k0, block_k)]
        a = jnp.where((rows >= lo) & (rows < hi), a, jnp.zeros_like(a))
        d = dy_ref[pl.ds(row0, block_m), pl.ds(n0, block_n)]
        return acc + lax.dot_general(a, d, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    first = lo // block_m
    last = jnp.where(hi > lo, (hi + block_m - 1) // block_m, first)
    acc = lax.fori_loop(first, last, body, jnp.zeros((block_k, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _weight_grad(x, dy, group_sizes, num_groups: int, tiles: Tiles, interpret: bool):
    m, k = x.shape
    n = dy.shape[1]
    bm = tiles.t_block_m
    mp, kp, np_ = _round_up(m, bm), _round_up(k, MIN_BLOCK), _round_up(n, MIN_BLOCK)
    bk, bn = _block(kp, tiles.t_block_k), _block(np_, tiles.t_block_n)
    x = jnp.pad(x, ((0, mp - m), (0, kp - k)))
    dy = jnp.pad(dy, ((0, mp - m), (0, np_ - n)))
    ends = jnp.cumsum(group_sizes).astype(jnp.int32)
    starts, ends, x, dy = _same_varying(ends - group_sizes, ends, x, dy)
    out = pl.pallas_call(
        functools.partial(_weight_grad_kernel, block_m=bm, block_k=bk, block_n=bn),
        grid=(num_groups, kp // bk, np_ // bn),
        out_specs=pl.BlockSpec((None, bk, bn), lambda g, i, j: (g, i, j)),
        out_shape=_out_struct((num_groups, kp, np_), x.dtype, x),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.t_warps, num_stages=tiles.t_stages),
        interpret=interpret,
        name="grouped_matmul_weight_grad",
    )(starts, ends, x, dy)
    return out[:, :k, :n]
