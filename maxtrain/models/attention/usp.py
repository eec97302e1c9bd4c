"""Unified sequence parallelism (context_parallel_strategy=usp): ulysses inside a slice, the ring across slices.

The context group of C = Co x Ci devices spans two levels of the mesh: the `context` mesh axis is
dcn_context_parallelism (Co, slices) x ici_context_parallelism (Ci, devices of a slice), the slice index the major
part (sharding.hybrid_device_array), so device c of the group is device i = c mod Ci of slice d = c // Ci. As for
ring and ulysses the sequence is in a load-balanced layout over all C devices (parallel/context.py): device c holds
the T / C tokens at positions [c T / C, (c + 1) T / C) of the layout, every head.

Inside shard_map over the context axis:

1. An all-to-all within each slice's Ci devices (ulysses.py's, with axis_index_groups) trades tokens for heads:
   device (d, i) then holds the T / Co tokens of its slice (positions [d T / Co, (d + 1) T / Co), the slice's Ci
   pieces in device order) for the i-th group of N / Ci query heads and G / Ci kv heads. This all-to-all never
   leaves the slice (fast links).
2. The ring (ring.py's `ring_attention_shard`) across slices: device (d, i) passes its key/value block to
   (d + 1 mod Co, i), which holds the same heads, Co - 1 times, the softmax merged online; masks compare the
   original token indices of each block (the layout's `order` over the slice's positions), so packed segments,
   causality and windows are those of the unsplit sequence. Only these ppermutes cross slices (slow links).
   With attention=flash (GPUs; interpret mode on CPU) each block pair is ring_flash.py's flash kernel, masking by
   the tokens' original indices (a slice's tokens are its devices' pieces, not two chunks, so no pair is skipped);
   with attention=cudnn (GPUs) the same ring with cuDNN per block pair (ring_cudnn.py: its forward, and its backward
   given the global out and lse where the installed jax allows, else the flash kernel's), masked by position too.
   On TPUs (splash: static masks, no positions) under dual_chunk_swap the slice's pieces are put in order first
   (`runs`): device c holds chunks c and 2C - 1 - c of L tokens, so slice d's pieces hold chunks d Ci .. d Ci + Ci - 1
   (the run of super-chunk d of Ci L tokens) and 2C - 1 - d Ci - i (the run of super-chunk 2 Co - 1 - d, i in
   reverse): taking each piece's first halves in order, then their second halves in reverse, gives exactly the
   dual_chunk_swap layout over Co devices, and ring_splash.py's ring runs on it (causal own block, half of each
   other pair skipped, the global out and lse in the backward); the output goes back to the pieces' order.
3. The inverse all-to-all gives each device its T / C tokens back with every head.

Per device: T / Co tokens x N / Ci heads of q, and one key/value block of as many tokens, at a time (no [T, ...]
buffer); the gradient is the ring's custom VJP between the all-to-alls' transposes. N and G (per tensor-parallel
shard) must be multiples of Ci (config/context_checks.py `_usp_applies` refuses other models before compiling).

Letters as in attention/__init__.py: B batch, T tokens, N query heads = G kv heads x R, H head dim (Hv the value's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.models.attention import ring, ring_cudnn, ring_flash
from maxtrain.parallel import context, sharding

LANES = 128  # splash's tiles: each slice's two runs (T / 2 Co tokens) must be a multiple of this


def splash_unsupported(reorder: str, sliding_window: int, length: int, outer: int) -> str:
    """Why usp's ring with splash (TPUs) cannot run here, as the end of a sentence; "" if it can."""
    if reorder != "dual_chunk_swap" or sliding_window > 0:
        return (f"on TPUs (the splash kernel) runs dual_chunk_swap without a sliding window only (here {reorder}, "
                f"sliding_window={sliding_window}); use attention=dot_product with usp")
    if length % (2 * outer * LANES):
        return (f"on TPUs (the splash kernel) needs each slice's two runs of tokens to be a multiple of {LANES}: "
                f"max_target_length={length} must be a multiple of {2 * outer * LANES}")
    return ""


def runs(x, inner: int, axis: int = 1):
    """A slice's tokens along `axis` from its `inner` devices' pieces (each two chunks of L) to its two runs: the
    pieces' first chunks in order, then their second chunks in reverse (the dual_chunk_swap layout over the slices:
    the module docstring)."""
    shape = x.shape
    pieces = x.reshape(*shape[:axis], inner, 2, shape[axis] // (2 * inner), *shape[axis + 1:])
    first = jax.lax.index_in_dim(pieces, 0, axis + 1, keepdims=False)
    second = jnp.flip(jax.lax.index_in_dim(pieces, 1, axis + 1, keepdims=False), axis)
    return jnp.concatenate([first, second], axis).reshape(shape)


def pieces_of(x, inner: int, axis: int = 1):
    """The inverse of `runs`: a slice's two runs back to its devices' pieces."""
    shape = x.shape
    both = x.reshape(*shape[:axis], 2, inner, shape[axis] // (2 * inner), *shape[axis + 1:])
    first = jax.lax.index_in_dim(both, 0, axis, keepdims=False)
    second = jnp.flip(jax.lax.index_in_dim(both, 1, axis, keepdims=False), axis)
    return jnp.stack([first, second], axis + 1).reshape(shape)


def usp_attention_shard(q, k, v, segment_ids, order, sinks=None, *, axes: tuple[str, ...], inner: int, outer: int,
                        causal: bool = True, sliding_window: int = 0, logits_soft_cap: float = 0.0,
                        scale: float | None = None, flash: dict | None = None, splash: dict | None = None,
                        cudnn: dict | None = None):
    """One device's part, inside shard_map over the context mesh `axes` (C = outer x inner devices, each slice's
    `inner` consecutive): q [B, T/C, N, H], k [B, T/C, G, H], v [B, T/C, G, Hv], segment_ids [B, T/C] of this
    device, order [T] the layout's original indices, sinks [N] or None. Returns [B, T/C, N, Hv] in q.dtype.
    flash: None for the plain-jnp ring across slices, else ring_flash_shard's kernel settings (interpret, block_q,
    block_k, shared_memory): the flash kernel per block pair, masking by the tokens' original indices. splash:
    ring_splash_shard's settings (interpret, block_q, block_kv): the TPU form, dual_chunk_swap without a window only
    (the slice's tokens put into two runs around the ring). cudnn: ring_cudnn_shard's settings (flash's, and block,
    block_grad): cuDNN per block pair, masking by the tokens' original indices."""
    n, g, length = q.shape[2], k.shape[2], order.shape[0]
    if n % inner or g % inner:
        raise ValueError(f"usp attention splits the heads {inner} ways inside each slice: query heads ({n}) and kv "
                         f"heads ({g}) per device must be multiples of {inner}")
    groups = [[d * inner + i for i in range(inner)] for d in range(outer)]

    def by_heads(x):  # [B, T/C, heads, H] -> [B, T/Co, heads/Ci, H], within the slice
        return jax.lax.all_to_all(x, axes, split_axis=2, concat_axis=1, tiled=True, axis_index_groups=groups)
    q, k, v = by_heads(q), by_heads(k), by_heads(v)
    segment_ids = jax.lax.all_gather(segment_ids, axes, axis=1, tiled=True, axis_index_groups=groups)  # [B, T/Co]
    device = jax.lax.axis_index(axes)
    slice_tokens = length // outer
    q_index = jax.lax.dynamic_slice_in_dim(order, (device // inner) * slice_tokens, slice_tokens)
    if sinks is not None:  # this device's N / Ci heads of the sinks
        sinks = jax.lax.dynamic_slice_in_dim(sinks, (device % inner) * (n // inner), n // inner)
    pairs = [(c, (c + inner) % (inner * outer)) for c in range(inner * outer)]  # (d, i) -> (d + 1 mod Co, i)
    if splash is not None:
        # deferred: the splash kernel's import (jax's TPU Pallas ops), only where it runs
        from maxtrain.models.attention import ring_splash  # pylint: disable=import-outside-toplevel

        why = splash_unsupported("dual_chunk_swap", sliding_window, length, outer)
        if why:
            raise ValueError(f"attention=flash with context_parallel_strategy=usp {why}")
        in_runs = lambda x: runs(x, inner)  # noqa: E731
        out = ring_splash.ring_splash_shard(in_runs(q), in_runs(k), in_runs(v), in_runs(segment_ids),
                                            runs(q_index, inner, axis=0), sinks, axes=axes, ways=outer, pairs=pairs,
                                            inner=inner, causal=causal, logits_soft_cap=logits_soft_cap, scale=scale,
                                            **splash)
        out = pieces_of(out, inner)
    elif cudnn is not None:  # as flash's below: masked by position, no pair skipped
        out = ring_cudnn.ring_cudnn_shard(q, k, v, segment_ids, q_index, sinks, axes=axes, ways=outer, pairs=pairs,
                                          reorder="striped", causal=causal, sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap, scale=scale, **cudnn)
    elif flash is None:
        out = ring.ring_attention_shard(q, k, v, segment_ids, q_index, sinks, axes=axes, ways=outer, pairs=pairs,
                                        causal=causal, sliding_window=sliding_window,
                                        logits_soft_cap=logits_soft_cap, scale=scale)
    else:  # a slice's tokens are its devices' pieces, not two chunks: "striped" makes the kernel mask by position
        out = ring_flash.ring_flash_shard(q, k, v, segment_ids, q_index, sinks, axes=axes, ways=outer, pairs=pairs,
                                          reorder="striped", causal=causal, sliding_window=sliding_window,
                                          logits_soft_cap=logits_soft_cap, scale=scale, **flash)
    return jax.lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True, axis_index_groups=groups)


def usp_attention(q, k, v, segment_ids, *, inner: int, reorder: str = "dual_chunk_swap", causal: bool = True,
                  sliding_window: int = 0, logits_soft_cap: float = 0.0, scale: float | None = None, sinks=None,
                  flash: dict | None = None, splash: dict | None = None, cudnn: dict | None = None):
    """Attention of q [B, T, N, H] over k, v [B, T, G, H] in the load-balanced layout `reorder`, sharded along T over
    the context mesh axes of the active mesh, `inner` (ici_context_parallelism) consecutive devices of the group in
    each slice: ulysses inside the slices, the ring across them (the module docstring), its block pairs in plain jnp
    or (flash: ring_flash_shard's kernel settings) with the flash kernel, or (splash: ring_splash_shard's settings;
    dual_chunk_swap without a window) with the TPU's splash kernel, or (cudnn: ring_cudnn_shard's settings) with
    cuDNN. Equals the reference attention over the
    unsplit sequence (tests/parallel/test_context_usp.py)."""
    active = sharding.active_mesh()
    if active is None:
        raise ValueError("usp attention runs under sharding.activation_sharding (a mesh with a context axis)")
    mesh, rules = active
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    if inner < 2 or ways % inner or ways == inner:
        raise ValueError(f"usp attention needs the context group ({ways} devices) to be several slices of inner={inner}"
                         " > 1 devices each (ici_context_parallelism > 1 and dcn_context_parallelism > 1); with one "
                         "context level use context_parallel_strategy=ring or ulysses")
    if splash is not None and splash_unsupported(reorder, sliding_window, q.shape[1], ways // inner):
        raise ValueError("attention=flash with context_parallel_strategy=usp "
                         + splash_unsupported(reorder, sliding_window, q.shape[1], ways // inner))
    order = jnp.asarray(context.layout(q.shape[1], ways, reorder), jnp.int32)
    q_axes, kv_axes = ("batch", "length", "heads", None), ("batch", "length", "kv_heads", None)
    specs = sharding.active_specs([q_axes, kv_axes])
    if specs is not None and specs[0][2] != specs[1][2]:
        raise ValueError(f"logical_axis_rules put 'heads' on {specs[0][2]} but 'kv_heads' on {specs[1][2]}: usp "
                         "attention needs both on the same mesh axes. Map them to the same axes, or use "
                         "context_parallel_strategy=all_gather.")

    def shard_fn(q, k, v, segment_ids, order, *rest):
        return usp_attention_shard(q, k, v, segment_ids, order, *rest, axes=axes, inner=inner, outer=ways // inner,
                                   causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                                   scale=scale, flash=flash, splash=splash, cudnn=cudnn)
    args, in_axes = [q, k, v, segment_ids, order], [q_axes, kv_axes, kv_axes, ("batch", "length"), (None,)]
    if sinks is not None:
        args.append(sinks)
        in_axes.append(("heads",))
    return sharding.run_in_shards(shard_fn, args, in_axes, q_axes)
