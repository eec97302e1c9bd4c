"""all_gather context parallelism with JAX's TPU splash kernel (attention=flash, context_parallel_strategy=all_gather
on TPUs).

Splash takes no positions: its masks are static, made when the step is traced, the same program on every device,
while each device's queries sit at other places of the sequence. So each device gathers the keys, values and
segment ids of the context group, puts them back into the original order (a fixed permutation of the
dual_chunk_swap layout), and cuts for each of its two query chunks a window of keys that ends where the chunk ends.
Relative to that window every device's mask is the same: causal with an offset (or a sliding window with one).

Device d of C holds chunks d and 2C - 1 - d of 2C, L = T / 2C tokens each (parallel/context.py). Chunk c's queries
(original positions cL .. (c + 1)L - 1) see the keys before (c + 1)L, so:

    chunk d (early):         the S_e = C L keys ending at (d + 1)L,  CausalMask((L, S_e), offset S_e - L)
    chunk 2C - 1 - d (late): the S_l = T keys ending at (2C - d)L,   CausalMask((L, S_l), offset S_l - L)

Windows reaching before position 0 (d < C - 1) read a front padding of (C - 1)L keys whose segment id is -1, which
no token has, so they are masked by segment id. A sliding window W is LocalMask((L, S), (W - 1, 0), offset S - L).
Splash skips the blocks the static mask hides (the triangle above the diagonal; outside the window); the padding
and the keys after the chunk are computed and masked: per device about 3C L^2 query-key pairs (C L^2 early, 2C L^2
late) against the 2C L^2 its queries see, 1.5x, where the plain form computes all 2L x T = 4C L^2 (2x) and keeps
[2L, T] scores. Memory per device: T keys, values and segment ids (as all_gather), no scores. Without a causal mask every
query sees every key: one call over the gathered keys in their layout order (a non-causal sliding window is
refused: run ulysses or dot_product). Sinks and soft-caps are splash's own. The backward is splash's VJP; the
transposes of the window cut, the permutation and the all-gather take dK and dV home (a reduce-scatter).

Letters as in attention/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from maxtrain.kernels import splash_tables
from maxtrain.kernels.splash_attention import LANES
from maxtrain.parallel import context, sharding

_PAD_SEGMENT = -1  # the key padding's segment id: no token has it (kernels/splash_attention.py pads so too)


def unsupported(reorder: str, causal: bool, sliding_window: int, length: int, ways: int) -> str:
    """Why all_gather with splash cannot run this, as the end of a sentence; "" if it can."""
    if reorder != "dual_chunk_swap":
        return (f"on TPUs (the splash kernel) runs dual_chunk_swap only (here {reorder}): its masks are static, cut "
                "per contiguous chunk; use context_parallel_reorder_strategy=dual_chunk_swap or attention=dot_product")
    if sliding_window > 0 and not causal:
        return "on TPUs (the splash kernel) has no non-causal sliding window; use ulysses or attention=dot_product"
    if length and length % (2 * ways * LANES):
        return (f"on TPUs (the splash kernel) needs each device's two chunks to be a multiple of {LANES} tokens: "
                f"max_target_length={length} must be a multiple of {2 * ways * LANES}")
    return ""


def _kernel(shape, mask, heads: int, block: int, logits_soft_cap: float, interpret: bool):
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                              block_kv_dkv=block, block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    del shape, heads  # one mask serves every head: splash_tables' kernel takes any number
    return splash_tables.make_kernel(  # splash's own table pass costs (L / block) x (T / block) Python steps
        mask, sizes, interpret=interpret, attn_logits_soft_cap=logits_soft_cap if logits_soft_cap > 0 else None)


def _attend(kernel, q, k, v, q_seg, kv_seg, sinks):
    """kernel over rows: q [B, T, N, H], k/v [B, S, G, H] -> [B, T, N, H] (splash is head-major per row)."""
    def one_row(q, k, v, q_seg, kv_seg):
        out = kernel(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1),
                     segment_ids=splash.SegmentIds(q=q_seg, kv=kv_seg),
                     sinks=None if sinks is None else sinks.astype(jnp.float32))
        return out.swapaxes(0, 1)
    return jax.vmap(one_row)(q, k, v, q_seg, kv_seg)


def all_gather_splash_shard(q, k, v, segment_ids, sinks=None, *, axes, ways: int, reorder: str = "dual_chunk_swap",
                            causal: bool = True, sliding_window: int = 0, logits_soft_cap: float = 0.0,
                            scale: float | None = None, block: int = 512, interpret: bool = False):
    """One device's part inside shard_map over the context axes `axes` (C = `ways` devices, dual_chunk_swap):
    q [B, 2L, N, H], k [B, 2L, G, H], v [B, 2L, G, Hv], segment_ids [B, 2L], sinks [N] or None -> [B, 2L, N, Hv]."""
    h, hv, heads = q.shape[3], v.shape[3], q.shape[2]
    chunk = q.shape[1] // 2
    total = 2 * ways * chunk
    why = unsupported(reorder, causal, sliding_window, total, ways)
    if why:
        raise ValueError(f"attention=flash with context_parallel_strategy=all_gather {why}")
    block = min(block, chunk & -chunk)
    width = max(h, hv)
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[3])])  # noqa: E731
    q = pad(q * jnp.asarray(h**-0.5 if scale is None else scale, q.dtype))  # splash does not scale
    gather = lambda x: jax.lax.all_gather(x, axes, axis=1, tiled=True)  # noqa: E731  the layout's order
    k, v, kv_seg = gather(pad(k)), gather(pad(v)), gather(segment_ids.astype(jnp.int32))
    segment_ids = segment_ids.astype(jnp.int32)
    if not causal:  # every query sees every key: their order does not matter
        kernel = _kernel((2 * chunk, total), masks.FullMask((2 * chunk, total)), heads, block, logits_soft_cap,
                         interpret)
        return _attend(kernel, q, k, v, segment_ids, kv_seg, sinks)[..., :hv]

    original = np.argsort(context.layout(total, ways))  # position p of the sequence is at original[p] of the layout
    front = (ways - 1) * chunk
    padded = [jnp.pad(jnp.take(x, original, axis=1), [(0, 0), (front, 0)] + [(0, 0)] * (x.ndim - 2),
                      constant_values=_PAD_SEGMENT if x.ndim == 2 else 0) for x in (k, v, kv_seg)]
    d = jax.lax.axis_index(axes)
    outs = []
    for start, size, rows in ((d * chunk, ways * chunk, slice(0, chunk)),  # chunk d: keys [(d + 1 - C)L, (d + 1)L)
                              ((ways - 1 - d) * chunk, total, slice(chunk, None))):  # chunk 2C-1-d: [-dL, (2C-d)L)
        window = [jax.lax.dynamic_slice_in_dim(x, start, size, axis=1) for x in padded]
        shape, offset = (chunk, size), size - chunk
        mask = (masks.LocalMask(shape, window_size=(sliding_window - 1, 0), offset=offset) if sliding_window > 0
                else masks.CausalMask(shape, offset=offset))
        kernel = _kernel(shape, mask, heads, block, logits_soft_cap, interpret)
        outs.append(_attend(kernel, q[:, rows], window[0], window[1], segment_ids[:, rows], window[2], sinks))
    return jnp.concatenate(outs, axis=1)[..., :hv]


def all_gather_splash(q, k, v, segment_ids, *, reorder: str, causal: bool, sliding_window: int,
                      logits_soft_cap: float, scale: float | None, sinks, block: int = 512, interpret: bool = False):
    """all_gather's contract (q [B, T, N, H] in the dual_chunk_swap layout, sharded along T over the context axes of
    the active mesh) with splash kernels (the module docstring)."""
    active = sharding.active_mesh()
    if active is None:
        raise ValueError("all_gather attention with the splash kernel runs under sharding.activation_sharding")
    mesh, rules = active
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    q_axes, kv_axes = ("batch", "length", "heads", None), ("batch", "length", "kv_heads", None)
    specs = sharding.active_specs([q_axes, kv_axes])
    if specs is not None and specs[0][2] != specs[1][2]:
        raise ValueError(f"logical_axis_rules put 'heads' on {specs[0][2]} but 'kv_heads' on {specs[1][2]}: the splash "
                         "kernel needs both on the same mesh axes. Map them to the same axes.")
    shard_fn = functools.partial(all_gather_splash_shard, axes=axes, ways=ways, reorder=reorder, causal=causal,
                                 sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                                 block=block, interpret=interpret)
    args, in_axes = [q, k, v, segment_ids], [q_axes, kv_axes, kv_axes, ("batch", "length")]
    if sinks is not None:
        args.append(sinks)
        in_axes.append(("heads",))
    return sharding.run_in_shards(shard_fn, args, in_axes, q_axes)
