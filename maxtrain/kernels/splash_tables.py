"""Splash attention's block tables (its MaskInfo), built from block ranges instead of splash's per-block pass.

Why our own code: JAX's splash kernel (jax.experimental.pallas.ops.tpu.splash_attention) turns its mask into block
tables when the step is traced, in `splash_attention_mask_info._process_mask`: a Python loop over every (query
block, key block) pair that makes the mask's numpy elements of the block, twice (to classify the blocks, then for
`data_next`), and hashes every partial block. That is (T / block)^2 Python steps over T^2 mask elements: 1.6 / 5.2 /
20.5 s of CPU at 32k / 64k / 128k tokens (docs/scale.md), about 1,300 s per table at 1M, once for the forward's and
once for the backward's. ulysses (splash on all T tokens) could not be compiled at 1M for that alone; all_gather's
late chunk (L x T) pays the same, the ring's pairs (L x L) less.

The masks maxtrain gives splash (kernels/splash_attention.py, models/attention/ring_splash.py and
all_gather_splash.py) are CausalMask and LocalMask (each with an offset: the key may be visible iff
lo <= k - q <= hi, the mask's window) and FullMask. Over a block of queries [q0, q1] and keys [k0, k1], k - q takes
every value of [k0 - q1, k1 - q0], so the block is empty, partial or full by comparing that range with [lo, hi]:
arrays over the block indices, no mask element made. The tables then follow splash's definitions, vectorised:

- block_mask [1, Q, K]: 0 empty, 1 partial, 2 full (one row of heads: splash's tables for identical heads and one
  head shard, which its kernel broadcasts over the heads);
- data_next: at each grid step (forward and dq: query-major; dkv: key-major) the key (forward, dq) or query (dkv)
  block index of the first non-empty block at or after it, the first non-empty block's after the last;
- shrink_grid (splash's default; dkv too unless the fused backward kernel is used): each row (dkv: each column)
  keeps only its non-empty blocks, padded with zeros to the longest (dkv: padded in front);
- each table cast down to int8 / int16 when its values fit, as `_downcast_to_small_type` does;
- mask_next and partial_mask_blocks are None: the Causal and Local masks hand splash a mask_function (the kernel
  computes partial blocks from q_sequence instead of loading them), and a FullMask has no partial block. So splash's
  deduplication of partial blocks never reaches its output for these masks and is not needed here.

Format: MaskInfo (data_next, mask_next, block_mask, partial_mask_blocks, q_sequence, is_dynamic_mask) and the
SplashAttentionKernel keyword arguments are the same in jax 0.10.2 and 0.12 (their sources differ only in type
annotations there). `check_format()` runs once per process before the first kernel: it builds small tables of each
mask kind with splash's own `_process_mask` and with this module and compares every array (values, dtype, shape) and
the kernel's keyword names; any difference (another jax whose format changed) raises, naming this module: never
silently wrong tables.

Build time, `JAX_PLATFORMS=cpu python scripts/splash_tables_time.py --splash-up-to 131072` (the causal mask's
forward / dkv tables; blocks of 256 at 32k, 512 at 128k, 2,048 at 1M as the ulysses rows of docs/scale.md; jax 0.12
on the shared 2-core machine at a load of 5 to 6, 2026-12-02): here 1.4 / 0.9 ms at 32k, 3.3 / 3.3 ms at 128k and
21 / 18 ms at 1M; splash's own 2.1 / 2.1 s at 32k and 35 / 32 s at 128k (the same tables), and at 1M, T^2 from
128k, about 64 x 33 s = 35 minutes a table (not run). Llama 3 8B under ulysses at 1M tokens on a v5p-16 no
longer waits on them: it compiled in 879 s (docs/scale.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mask_info_lib

MASK_INFO_FIELDS = ("data_next", "mask_next", "block_mask", "partial_mask_blocks", "q_sequence", "is_dynamic_mask")
KERNEL_KWARGS = {"block_sizes", "is_mqa", "save_residuals", "mask_value", "attn_logits_soft_cap",
                 "residual_checkpoint_name", "mask_function", "interpret"}
_FIX = ("maxtrain/kernels/splash_tables.py builds them for the format of jax 0.10.2 and 0.12: update it for this "
        f"jax ({jax.__version__})")


def _window(mask: masks.Mask) -> tuple[float, float] | None:
    """(lo, hi): key k is visible to query q iff lo <= k - q <= hi (infinite: no bound); None for a FullMask."""
    if type(mask) is masks.FullMask:  # pylint: disable=unidiomatic-typecheck
        return None
    if type(mask) not in (masks.CausalMask, masks.LocalMask):  # pylint: disable=unidiomatic-typecheck
        raise TypeError(f"splash_tables builds the tables of CausalMask, LocalMask and FullMask, not "
                        f"{type(mask).__name__}; pass one of those or build the kernel with splash's own maker")
    if not np.array_equal(mask.q_sequence, np.arange(mask.shape[0])):
        raise ValueError("splash_tables needs the mask's q_sequence to be arange(q_len) (splash's own); build this "
                         "kernel with splash's own maker")
    if type(mask) is masks.CausalMask:  # pylint: disable=unidiomatic-typecheck
        return -np.inf, float(mask.offset)
    left, right = mask.window_size
    return (-np.inf if left is None else float(mask.offset - left),
            np.inf if right is None else float(mask.offset + right))


def block_kinds(mask: masks.Mask, block_shape: tuple[int, int]) -> np.ndarray:
    """[Q, K] int32: 0 where a block of the mask is empty, 1 partial, 2 full (splash's block_mask of one head)."""
    (q_len, kv_len), (bq, bkv) = mask.shape, block_shape
    if q_len % bq or kv_len % bkv:
        raise ValueError(f"block_q={bq} should divide q_len={q_len} and block_kv={bkv} kv_len={kv_len}")
    window = _window(mask)
    if window is None:
        return np.full((q_len // bq, kv_len // bkv), 2, np.int32)
    lo, hi = window
    q0 = np.arange(0, q_len, bq, dtype=np.int64)[:, None]
    k0 = np.arange(0, kv_len, bkv, dtype=np.int64)[None, :]
    least, most = k0 - (q0 + bq - 1), (k0 + bkv - 1) - q0  # the range of k - q over the block
    some = (most >= lo) & (least <= hi)
    every = (least >= lo) & (most <= hi)
    return np.where(every, 2, np.where(some, 1, 0)).astype(np.int32)


def _data_next(kinds: np.ndarray, is_dkv: bool) -> np.ndarray:
    """splash's data_next over the whole grid (before shrinking): [Q, K] int32."""
    grid = kinds.T if is_dkv else kinds  # the grid's order: dkv steps key-major
    flat = grid.reshape(-1) != 0
    if not flat.any():
        return np.zeros(kinds.shape, np.int32)
    index = np.arange(flat.size)
    after = np.minimum.accumulate(np.where(flat, index, flat.size)[::-1])[::-1]
    after = np.where(after == flat.size, index[flat][0], after)  # past the last: the first non-empty block
    data = (after % grid.shape[1]).reshape(grid.shape).astype(np.int32)  # the other axis' index
    return data.T if is_dkv else data


def _shrink(kinds: np.ndarray, data: np.ndarray, is_dkv: bool) -> tuple[np.ndarray, np.ndarray]:
    """splash's `_shrink_mask_info` (each row keeps its non-empty columns, in order, zero-padded at the end to the
    longest row) and `_shrink_mask_info_dkv` (each column keeps its non-empty rows, zero-padded in front)."""
    axis = 0 if is_dkv else 1
    nonzero = kinds != 0
    counts = nonzero.sum(axis=axis, keepdims=True)
    width = int(counts.max())
    if width == 0:
        raise ValueError("splash's tables need at least one visible block: the mask hides every key")
    first = np.argsort(~nonzero, axis=axis, kind="stable")  # the non-empty blocks' indices first, in order
    slot = np.arange(width).reshape((-1, 1) if is_dkv else (1, -1))
    source = slot - (width - counts) if is_dkv else slot  # dkv: padded in front
    keep = (source >= 0) & (source < counts)
    index = np.take_along_axis(first, np.clip(source, 0, None), axis=axis)
    return tuple(np.where(keep, np.take_along_axis(x, index, axis=axis), 0).astype(np.int32) for x in (kinds, data))


def _downcast(array: np.ndarray) -> np.ndarray:
    """splash's `_downcast_to_small_type`: int8 or int16 when every (non-negative) value fits."""
    if array.size == 0:
        return array
    top = int(array.max())
    for kind in (np.int8, np.int16):
        if top <= np.iinfo(kind).max:
            return array.astype(kind)
    return array.astype(np.int32)


@functools.lru_cache(maxsize=32)
def mask_info(mask: masks.Mask, block_shape: tuple[int, int], is_dkv: bool, *, shrink_grid: bool = True):
    """(MaskInfo, mask_function) equal to splash's `_process_mask(MultiHeadMask([mask] * heads), block_shape, is_dkv,
    head_shards=1, q_seq_shards=1, shrink_grid=shrink_grid)` (numpy arrays), in O(blocks) numpy work. Cached by mask,
    as splash caches its own (one mask_function object per mask value)."""
    kinds = block_kinds(mask, block_shape)
    data = _data_next(kinds, is_dkv)
    if shrink_grid:
        kinds, data = _shrink(kinds, data, is_dkv)
    computable = isinstance(mask, (masks.CausalMask, masks.LocalMask))
    info = mask_info_lib.MaskInfo(data_next=_downcast(data[None]), mask_next=None, block_mask=_downcast(kinds[None]),
                                  partial_mask_blocks=None, q_sequence=mask.q_sequence if computable else None)
    return info, (mask.mask_function if computable else None)


def make_kernel(mask: masks.Mask, block_sizes: splash.BlockSizes, *, save_residuals: bool = False,
                attn_logits_soft_cap: float | None = None, interpret: bool = False) -> splash.SplashAttentionKernel:
    """`splash.make_splash_mha_single_device(MultiHeadMask([mask] * heads), ...)` with this module's tables: the
    same SplashAttentionKernel (any number of query heads: one mask for all of them)."""
    check_format()
    if block_sizes.use_fused_bwd_kernel or not block_sizes.has_backward_blocks:
        raise ValueError("splash_tables.make_kernel takes block sizes with separate dq and dkv blocks (as "
                         "kernels/splash_attention.block_sizes makes)")
    fwd, function = mask_info(mask, (block_sizes.block_q, block_sizes.block_kv), False)
    dq, _ = mask_info(mask, (block_sizes.block_q_dq, block_sizes.block_kv_dq), False)
    dkv, _ = mask_info(mask, (block_sizes.block_q_dkv, block_sizes.block_kv_dkv), True)
    to_device = functools.partial(jax.tree_util.tree_map, jnp.array)  # as splash's maker does
    return splash.SplashAttentionKernel(
        to_device(fwd), to_device(dq), to_device(dkv), block_sizes=block_sizes, is_mqa=False,
        save_residuals=save_residuals, mask_value=splash.DEFAULT_MASK_VALUE, attn_logits_soft_cap=attn_logits_soft_cap,
        residual_checkpoint_name=None, mask_function=function, interpret=interpret)


def sample_masks() -> list[masks.Mask]:
    """Small masks of every kind and offset this module builds (the format check's and the tests' cases)."""
    return [masks.CausalMask((512, 512)), masks.CausalMask((256, 768), offset=512),
            masks.CausalMask((512, 256), offset=-128), masks.LocalMask((512, 512), (199, 0), 0),
            masks.LocalMask((256, 1024), (299, 0), 768), masks.LocalMask((512, 512), (99, None), 0),
            masks.LocalMask((512, 512), (None, None), 0), masks.FullMask((256, 512))]


def compare(ours, theirs) -> str:
    """'' if two (MaskInfo, mask_function) pairs are equal: every field's value, dtype and shape; else what differs."""
    (info, function), (expected, expected_function) = ours, theirs
    if tuple(type(expected)._fields) != MASK_INFO_FIELDS:
        return f"MaskInfo's fields are {type(expected)._fields}, not {MASK_INFO_FIELDS}"
    if (function is None) != (expected_function is None):
        return f"mask_function {function} against splash's {expected_function}"
    if function is not None:  # equal masks' functions (each cache keeps its first mask's): compare their values
        rows = np.arange(min(len(expected.q_sequence), 2048))[:, None]
        cols = np.arange(4 * rows.size)[None, :]
        if not np.array_equal(function(rows, cols), expected_function(rows, cols)):
            return "mask_function differs"
    for name in MASK_INFO_FIELDS:
        a, b = getattr(info, name), getattr(expected, name)
        if (a is None) != (b is None) or (isinstance(b, bool) and a != b):
            return f"{name}: {a!r} against splash's {b!r}"
        if a is not None and not isinstance(b, bool):
            a, b = np.asarray(a), np.asarray(b)
            if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a, b):
                return f"{name}: {a.dtype}{list(a.shape)} against splash's {b.dtype}{list(b.shape)} (or its values)"
    return ""


@functools.cache
def check_format() -> None:
    """Once per process: this module's tables and kernel arguments against splash's own on sample_masks(); raises
    (naming the fix) on any difference."""
    if tuple(mask_info_lib.MaskInfo._fields) != MASK_INFO_FIELDS:
        raise RuntimeError(f"splash's MaskInfo fields are {mask_info_lib.MaskInfo._fields}: {_FIX}")
    for mask in sample_masks():
        for block_shape in ((128, 128), (128, 256), (256, 128)):
            for is_dkv in (False, True):
                ours = mask_info(mask, block_shape, is_dkv)
                why = compare(ours, mask_info_lib._process_mask(  # pylint: disable=protected-access
                    masks.MultiHeadMask([mask]), block_shape, is_dkv))
                if why:
                    raise RuntimeError(f"splash's tables for {type(mask).__name__}{mask.shape} at blocks {block_shape} "
                                       f"({'dkv' if is_dkv else 'forward'}) differ from ours ({why}): {_FIX}")
    sizes = splash.BlockSizes(block_q=128, block_kv=128, block_kv_compute=128, block_q_dkv=128, block_kv_dkv=128,
                              block_kv_dkv_compute=128, block_q_dq=128, block_kv_dq=128)
    kwargs = splash.make_splash_mha_single_device(masks.MultiHeadMask([masks.FullMask((128, 128))]),
                                                  block_sizes=sizes).kwargs
    if set(kwargs) != KERNEL_KWARGS:
        raise RuntimeError(f"splash's kernel takes {sorted(kwargs)}, not {sorted(KERNEL_KWARGS)}: {_FIX}")
