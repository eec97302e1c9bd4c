"""Attention with the sequence split over the context mesh axes (parallel/context.py): the strategy's dispatch
(context_parallel_strategy) for the plain-jnp forms and ulysses' kernels, and all_gather's forms.

all_gather (the default) lets GSPMD gather each layer's keys and values over the context group: T keys per device,
written with sharding constraints, so it composes with pipeline stages and every other mesh axis. ring.py passes
the key/value blocks round the group instead (T / C per device), ulysses.py trades tokens for heads with an
all-to-all, usp.py does ulysses inside each slice and the ring across slices. Their plain-jnp forms mask by the
tokens' original indices (`context.layout`), so each equals attention over the unsplit sequence.

The kernels. attention.attention (models/attention/__init__.py) sends attention=flash under all_gather, ring and usp
to its own module before this dispatch, which takes a kernel (attention.local_kernel) only for ulysses (every
kernel: each device puts its whole sequences back into the original order, ulysses.py). With attention=flash:
- all_gather on GPUs (interpret mode on CPU): all_gather_flash below gathers the keys and values inside shard_map
  and runs the flash kernel on the device's T / C queries against all T keys, masking by the tokens' original
  indices (the kernel's positions operands): no [T / C, T] scores, every key block visited (the tiles the causal
  mask hides by position run no matmul, but are loaded: 1.3x, not 2x, on an H200, docs/gpu.md) and T keys held per
  device. The backward pass reduce-scatters dK and dV (all_gather's transpose).
- all_gather on TPUs: all_gather_splash.py. Splash takes no positions, so each device puts the gathered keys back
  into the original order and runs splash on a window of them per query chunk, one static causal mask with an
  offset (dual_chunk_swap only): no scores in HBM, T keys per device, about 1.5x the pairs its queries see computed.
- ring: ring_flash.py (the Triton kernel per block pair, half of each other pair skipped under dual_chunk_swap);
  on TPUs ring_splash.py (splash per block pair, dual_chunk_swap without windows).
- usp: usp.py's ring across slices with ring_flash's calls (masked by position), on TPUs ring_splash's.
autoselected keeps the plain form under all_gather and takes flash under ring and usp (resolve_implementation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.kernels import flash_attention
from maxtrain.models.attention import dot_product_attention, ring, ulysses, usp
from maxtrain.parallel import context, sharding

STRATEGIES = ("all_gather", "ring", "ulysses", "usp")


def attention(q, k, v, segment_ids, *, strategy: str = "all_gather", reorder: str = "dual_chunk_swap",
              causal: bool = True, sliding_window: int = 0, logits_soft_cap: float = 0.0, scale: float | None = None,
              sinks=None, kernel=None, inner: int = 0):
    """q [B, T, N, H], k and v [B, T, G, H] in the layout `reorder`, sharded along T over the context axes, through
    the context strategy `strategy`. kernel: the attention kernel (attention.local_kernel) the strategy runs on
    whole local sequences, or None for the plain-jnp form (kernel_choice.CONTEXT_KERNELS says which strategies take
    one; resolve_implementation refuses the others before compiling). inner: usp's devices of the group in one
    slice (ici_context_parallelism)."""
    kwargs = dict(causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap, scale=scale,
                  sinks=sinks)
    if kernel is not None and strategy != "ulysses":
        raise ValueError(f"context_parallel_strategy={strategy} runs the flash kernel (attention=flash) or the "
                         "plain-jnp attention, not this kernel; use attention=flash or dot_product, or "
                         "context_parallel_strategy=ulysses, which runs every kernel")
    if strategy == "ulysses":
        return ulysses.ulysses_attention(q, k, v, segment_ids, reorder=reorder, kernel=kernel, **kwargs)
    if strategy == "ring":
        return ring.ring_attention(q, k, v, segment_ids, reorder=reorder, **kwargs)
    if strategy == "usp":  # ulysses inside each slice, the ring across slices (usp.py)
        return usp.usp_attention(q, k, v, segment_ids, inner=inner, reorder=reorder, **kwargs)
    if strategy != "all_gather":
        raise ValueError(f"context_parallel_strategy={strategy!r} is not one of {', '.join(STRATEGIES)}")
    return context_parallel_attention(q, k, v, segment_ids, reorder=reorder, **kwargs)


def all_gather_flash(q, k, v, segment_ids, *, reorder: str, causal: bool, sliding_window: int,
                     logits_soft_cap: float, scale: float | None, sinks, flash: dict):
    """all_gather's contract (q [B, T, N, H] in the layout `reorder`, sharded along T over the context axes of the
    active mesh) with the flash kernel on the gathered keys (the module docstring). flash: the kernel's settings
    (ring_flash.kernel_settings: interpret, block_q, block_k, shared_memory)."""
    active = sharding.active_mesh()
    if active is None:
        raise ValueError("all_gather attention with the flash kernel runs under sharding.activation_sharding")
    mesh, rules = active
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    order = jnp.asarray(context.layout(q.shape[1], sharding.ways("length"), reorder), jnp.int32)
    q_axes, kv_axes = ("batch", "length", "heads", None), ("batch", "length", "kv_heads", None)
    specs = sharding.active_specs([q_axes, kv_axes])
    if specs is not None and specs[0][2] != specs[1][2]:
        raise ValueError(f"logical_axis_rules put 'heads' on {specs[0][2]} but 'kv_heads' on {specs[1][2]}: the flash "
                         "kernel needs both on the same mesh axes. Map them to the same axes.")

    def shard_fn(q, k, v, segment_ids, q_index, order, *rest):
        k, v, kv_segments = (jax.lax.all_gather(x, axes, axis=1, tiled=True) for x in (k, v, segment_ids))
        return flash_attention.flash_attention(
            q, k, v, segment_ids, kv_segments, causal=causal, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, sm_scale=scale, sinks=rest[0] if rest else None,
            q_positions=jnp.broadcast_to(q_index[None], segment_ids.shape),
            kv_positions=jnp.broadcast_to(order[None], kv_segments.shape), **flash)
    args = [q, k, v, segment_ids, order, order]
    in_axes = [q_axes, kv_axes, kv_axes, ("batch", "length"), ("length",), (None,)]
    if sinks is not None:
        args.append(sinks)
        in_axes.append(("heads",))
    return sharding.run_in_shards(shard_fn, args, in_axes, q_axes)


def context_parallel_attention(q, k, v, segment_ids, *, causal: bool = True, sliding_window: int = 0,
                               logits_soft_cap: float = 0.0, scale: float | None = None, sinks=None,
                               reorder: str = "dual_chunk_swap"):
    """Attention with the sequence split over the context mesh axes (parallel/context.py): queries
    [B, T, N, H] in the load-balanced layout `reorder`, sharded along T, attend to all keys.

    The keys, values and segment ids are constrained to be whole along T (GSPMD all-gathers them
    across the context group), the queries, the mask and the output stay split along T, and the
    mask compares original token indices (same segment, causal, sliding window): the plain-jnp
    reference attention, on T / C queries per device against T keys. Written with sharding
    constraints rather than shard_map, it composes with pipeline stages (already inside shard_map)
    and with every other mesh axis.
    """
    order = jnp.asarray(context.layout(q.shape[1], sharding.ways("length"), reorder))
    k = sharding.shard(k, ("batch", None, "kv_heads", None))
    v = sharding.shard(v, ("batch", None, "kv_heads", None))
    kv_segments = sharding.shard(segment_ids, ("batch", None))
    t, s = order[:, None], order[None, :]
    mask = segment_ids[:, :, None] == kv_segments[:, None, :]
    if causal:
        mask = mask & (s <= t)[None]
    if sliding_window > 0:
        mask = mask & (t - s < sliding_window)[None]
    mask = sharding.shard(mask, ("batch", "length", None))
    out = dot_product_attention(q, k, v, mask, scale=scale, logits_soft_cap=logits_soft_cap, sinks=sinks)
    return sharding.shard(out, ("batch", "length", "heads", None))
