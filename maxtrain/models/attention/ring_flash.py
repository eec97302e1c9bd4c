"""Ring attention with the flash kernel per block (attention=flash, context_parallel_strategy=ring, on GPUs).

ring.py computes each (query block, key block) pair of the ring in plain jnp over the whole block, masked entries
included. Here each pair is maxtrain/kernels/flash_attention.py's Pallas kernel (Triton on GPUs, interpret mode on
CPU), and the causal mask's structure under dual_chunk_swap decides which pairs run at all. Device d of the C of a
context group holds chunks d and 2C - 1 - d of the 2C (parallel/context.py), two contiguous runs of L = T / 2C tokens
in increasing order, so against the key block of device s:

    s == d (this device's own block, step 0): causal attention over its 2L tokens as they lie (local order is
            original order: chunk d's queries see chunk d causally, chunk 2C - 1 - d's see chunk d whole and
            chunk 2C - 1 - d causally, chunk d never sees chunk 2C - 1 - d);
    s <  d: every query sees the block's first chunk (s < d) whole and never its second (2C - 1 - s > 2C - 1 - d):
            all 2L queries against L keys, no causal mask;
    s >  d: the first query chunk sees nothing (both key chunks are later), the second (2C - 1 - d >= C) sees both
            whole: L queries against 2L keys, no causal mask.

So every step after the first does 2L x L pairs, half of the block pair's 2L x 2L: the other half is skipped, not
masked (`lax.cond` on s < d: s is the device's ring index minus the step). Packed documents go through the kernel's
segment masks; soft-capping through its scores. Each call returns (out, lse) (lse: log of the softmax denominator)
and the calls are merged with the online softmax,

    lse' = logaddexp(lse, lse_b),   out' = out exp(lse - lse') + out_b exp(lse_b - lse'),

rows a call does not see carrying lse_b = -big (weight exactly 0). An attention sink (gpt-oss) joins once at the end
with the global lse (as flash_attention._with_sinks). The gradient is a custom VJP: the key/value blocks go round the
ring again with their running dk and dv, and each pair's dq, dk, dv come from the kernel's own backward
(flash_attention._backward) given the GLOBAL out and lse (its delta = rowsum(d_out * out) is then global, as the
softmax's gradient needs); a last pass takes dk and dv home. Per device the kernel holds T / C keys at a time.

Refused here (one line each, resolve_implementation says so before compiling): striped layouts (each pair would be
causal with a shift the kernel's mask does not take), sliding windows (the chunk offsets are not in the kernel's
mask yet), TPUs (the splash kernel is not inside the ring yet). Per-block outputs and gradients are rounded to the
input dtype by the kernel before being merged or summed in float32 (exact for float32 inputs).

Letters as in attention/__init__.py: B batch, T this device's tokens (2L), S keys of a block, N query heads, G kv
heads, H head dim (padded to a power of two >= 16 for the kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from maxtrain.config import chips
from maxtrain.kernels import flash_attention as flash
from maxtrain.kernels.flash_tiles import DEFAULT_SHARED_MEMORY, MIN_BLOCK, default_tuning
from maxtrain.parallel import sharding

_NO_SCORE = flash._MASK_VALUE  # pylint: disable=protected-access  # lse of a row that sees no key of a call


def _configs(head_pad: int, dtype, chunk: int, *, logits_soft_cap: float, scale: float, interpret: bool,
             block_q: int, block_k: int, shared_memory: int):
    """(causal, full) KernelConfigs whose blocks divide the chunk length L (so no call pads)."""
    tuning = default_tuning(head_pad, dtype, block_q, block_k, shared_memory)
    fit = chunk & -chunk  # the largest power of two dividing L
    if fit < MIN_BLOCK:
        raise ValueError(f"attention=flash with context_parallel_strategy=ring needs each device's two chunks of "
                         f"{chunk} tokens to be a multiple of {MIN_BLOCK}; use a max_target_length that is a multiple "
                         f"of {MIN_BLOCK} x 2 x context parallelism")
    tuning = {name: dataclasses.replace(t, block_q=min(t.block_q, fit), block_k=min(t.block_k, fit))
              for name, t in tuning.items()}
    common = dict(sliding_window=0, soft_cap=float(logits_soft_cap), scale=float(scale), kv_len=0, kv_padded=False,
                  interpret=bool(interpret), **tuning)
    return flash.KernelConfig(causal=True, **common), flash.KernelConfig(causal=False, **common)


def _merge(out, lse, out_b, lse_b):
    """Online-softmax merge of two partial attentions: out [B, T, N, H] float32, lse [B, N, T]."""
    lse_new = jnp.logaddexp(lse, lse_b)
    weight = lambda l: jnp.exp(l - lse_new).transpose(0, 2, 1)[..., None]  # noqa: E731  [B, T, N, 1]
    return out * weight(lse) + out_b.astype(jnp.float32) * weight(lse_b), lse_new


class _RingFlash:
    """One device's ring passes (forward and backward) with the flash kernel per block pair."""

    def __init__(self, axes, ways, causal, causal_cfg, full_cfg):
        self.axes, self.ways, self.causal = axes, ways, causal
        self.causal_cfg, self.full_cfg = causal_cfg, full_cfg
        self.pairs = [(i, (i + 1) % ways) for i in range(ways)]  # device c sends to c + 1

    def pass_on(self, block):
        return jax.lax.ppermute(block, self.axes, self.pairs)

    def sees_early(self, step):
        """True where the block in hand after `step` passes came from an earlier device (s < d)."""
        d = jax.lax.axis_index(self.axes)
        return (d - step) % self.ways < d

    # -- forward -------------------------------------------------------------------------------------------
    def block_forward(self, q, segment_ids, block, step):
        """(out [B, T, N, H] float32, lse [B, N, T]) of this device's queries against the block in hand."""
        k, v, kv_segment_ids = block
        if not self.causal:
            out, lse = flash.forward_call(q, k, v, segment_ids, kv_segment_ids, self.full_cfg)
            return out.astype(jnp.float32), lse
        half = q.shape[1] // 2

        def early(q, k, v, segment_ids, kv_segment_ids):  # all queries, the block's first chunk
            out, lse = flash.forward_call(q, k[:, :half], v[:, :half], segment_ids, kv_segment_ids[:, :half],
                                          self.full_cfg)
            return out.astype(jnp.float32), lse

        def late(q, k, v, segment_ids, kv_segment_ids):  # the second query chunk, the whole block
            out, lse = flash.forward_call(q[:, half:], k, v, segment_ids[:, half:], kv_segment_ids, self.full_cfg)
            unseen = jnp.full(lse.shape, _NO_SCORE, lse.dtype)
            return (jnp.concatenate([jnp.zeros(out.shape, jnp.float32), out.astype(jnp.float32)], axis=1),
                    jnp.concatenate([unseen, lse], axis=2))

        return jax.lax.cond(self.sees_early(step), early, late, q, k, v, segment_ids, kv_segment_ids)

    def forward(self, q, k, v, segment_ids, sinks):
        """(out [B, T, N, H] in q.dtype, lse [B, N, T] float32), sinks joined."""
        cfg = self.causal_cfg if self.causal else self.full_cfg
        out, lse = flash.forward_call(q, k, v, segment_ids, segment_ids, cfg)  # own block
        out = out.astype(jnp.float32)

        def step(carry, i):
            out, lse, block = carry
            block = self.pass_on(block)
            out, lse = _merge(out, lse, *self.block_forward(q, segment_ids, block, i))
            return (out, lse, block), None

        (out, lse, _), _ = jax.lax.scan(step, (out, lse, (k, v, segment_ids)), jnp.arange(1, self.ways))
        if sinks is not None:  # one more column of each softmax, no value row (flash._with_sinks)
            lse_sinks = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
            out, lse = out * jnp.exp(lse - lse_sinks).transpose(0, 2, 1)[..., None], lse_sinks
        return out.astype(q.dtype), lse

    # -- backward ------------------------------------------------------------------------------------------
    def block_backward(self, q, segment_ids, out, lse, d_out, block, step):
        """(dq [B, T, N, H], dk, dv [B, S, G, H]) float32 of the pair of this device's queries and the block."""
        k, v, kv_segment_ids = block
        f32 = lambda *xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
        if not self.causal:
            return f32(*flash._backward(q, k, v, segment_ids, kv_segment_ids, out, lse, d_out, self.full_cfg))  # pylint: disable=protected-access
        half = q.shape[1] // 2

        def early(q, k, v, segment_ids, kv_segment_ids, out, lse, d_out):
            dq, dk, dv = f32(*flash._backward(q, k[:, :half], v[:, :half], segment_ids, kv_segment_ids[:, :half],  # pylint: disable=protected-access
                                              out, lse, d_out, self.full_cfg))
            pad = lambda x: jnp.concatenate([x, jnp.zeros(x.shape, x.dtype)], axis=1)  # noqa: E731
            return dq, pad(dk), pad(dv)

        def late(q, k, v, segment_ids, kv_segment_ids, out, lse, d_out):
            dq, dk, dv = f32(*flash._backward(q[:, half:], k, v, segment_ids[:, half:], kv_segment_ids,  # pylint: disable=protected-access
                                              out[:, half:], lse[:, :, half:], d_out[:, half:], self.full_cfg))
            return jnp.concatenate([jnp.zeros(dq.shape, dq.dtype), dq], axis=1), dk, dv

        return jax.lax.cond(self.sees_early(step), early, late, q, k, v, segment_ids, kv_segment_ids, out, lse,
                            d_out)

    def backward(self, q, k, v, segment_ids, sinks, out, lse, d_out):
        """(dq, dk, dv, d_sinks or None) from the global out and lse (sinks joined)."""
        cfg = self.causal_cfg if self.causal else self.full_cfg
        dq, dk, dv = (x.astype(jnp.float32) for x in flash._backward(  # pylint: disable=protected-access
            q, k, v, segment_ids, segment_ids, out, lse, d_out, cfg))

        def step(carry, i):
            dq, block = carry
            k, v, kv_segment_ids, dk, dv = self.pass_on(block)
            dq_b, dk_b, dv_b = self.block_backward(q, segment_ids, out, lse, d_out, (k, v, kv_segment_ids), i)
            return (dq + dq_b, (k, v, kv_segment_ids, dk + dk_b, dv + dv_b)), None

        (dq, block), _ = jax.lax.scan(step, (dq, (k, v, segment_ids, dk, dv)), jnp.arange(1, self.ways))
        dk, dv = self.pass_on(block[3:])  # each block's dk, dv home to the device that holds its keys
        d_sinks = None
        if sinks is not None:  # d sink = -sum over queries of exp(sink - lse) delta (flash._flash_bwd)
            delta = jnp.einsum("BTNH,BTNH->BNT", d_out.astype(jnp.float32), out.astype(jnp.float32))
            p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
            d_sinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks


def ring_flash_shard(q, k, v, segment_ids, sinks=None, *, axes: tuple[str, ...], ways: int, causal: bool = True,
                     logits_soft_cap: float = 0.0, scale: float | None = None, interpret: bool = False,
                     block_q: int = 128, block_k: int = 128, shared_memory: int = DEFAULT_SHARED_MEMORY):
    """One device's part inside shard_map over the context mesh `axes` (dual_chunk_swap layout): q [B, T, N, H],
    k and v [B, T, G, H] (v's head dim may differ), segment_ids [B, T], sinks [N] or None. Returns [B, T, N, Hv]."""
    n, g, h, hv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({g})")
    head_pad = max(MIN_BLOCK, 1 << (max(h, hv) - 1).bit_length())
    causal_cfg, full_cfg = _configs(head_pad, q.dtype, q.shape[1] // 2, logits_soft_cap=logits_soft_cap,
                                    scale=h**-0.5 if scale is None else scale, interpret=interpret, block_q=block_q,
                                    block_k=block_k, shared_memory=shared_memory)
    ring = _RingFlash(axes, ways, causal, causal_cfg, full_cfg)
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, head_pad - x.shape[3])])  # noqa: E731  q.k and out unchanged
    segment_ids = segment_ids.astype(jnp.int32)  # the kernel's segment masks
    with_sinks = sinks is not None

    @jax.custom_vjp
    def attend(q, k, v, sinks, segment_ids):
        return ring.forward(q, k, v, segment_ids, sinks if with_sinks else None)[0]

    def forward(q, k, v, sinks, segment_ids):
        out, lse = ring.forward(q, k, v, segment_ids, sinks if with_sinks else None)
        return out, (q, k, v, sinks, segment_ids, out, lse)

    def backward(residuals, d_out):
        q, k, v, sinks, segment_ids, out, lse = residuals
        dq, dk, dv, d_sinks = ring.backward(q, k, v, segment_ids, sinks if with_sinks else None, out, lse, d_out)
        return dq, dk, dv, d_sinks if with_sinks else jnp.zeros_like(sinks), None  # no gradient for the ids

    attend.defvjp(forward, backward)
    out = attend(pad(q), pad(k), pad(v), sinks if with_sinks else jnp.zeros((n,), jnp.float32), segment_ids)
    return out[..., :hv]


def ring_flash_attention(q, k, v, segment_ids, *, reorder: str = "dual_chunk_swap", causal: bool = True,
                         sliding_window: int = 0, logits_soft_cap: float = 0.0, scale: float | None = None, sinks=None,
                         interpret: bool = False, block_q: int = 128, block_k: int = 128,
                         shared_memory: int = DEFAULT_SHARED_MEMORY):
    """ring.ring_attention's contract (q [B, T, N, H] in the layout `reorder`, sharded along T over the context axes
    of the active mesh) with the flash kernel per block pair; dual_chunk_swap only, no sliding window."""
    if reorder != "dual_chunk_swap":
        raise ValueError(f"attention=flash with context_parallel_strategy=ring runs the dual_chunk_swap layout only, "
                         f"not {reorder}; set context_parallel_reorder_strategy=dual_chunk_swap, or attention="
                         "dot_product")
    if sliding_window > 0:
        raise ValueError(f"attention=flash with context_parallel_strategy=ring does not take sliding windows yet "
                         f"(sliding_window={sliding_window}); use attention=dot_product with the ring")
    active = sharding.active_mesh()
    if active is None:
        raise ValueError("ring attention runs under sharding.activation_sharding (a mesh with a context axis)")
    mesh, rules = active
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    shard_fn = functools.partial(ring_flash_shard, axes=axes, ways=ways, causal=causal,
                                 logits_soft_cap=logits_soft_cap, scale=scale, interpret=interpret, block_q=block_q,
                                 block_k=block_k, shared_memory=shared_memory)
    q_axes, kv_axes = ("batch", "length", "heads", None), ("batch", "length", "kv_heads", None)
    specs = sharding.active_specs([q_axes, kv_axes])
    if specs is not None and specs[0][2] != specs[1][2]:
        raise ValueError(f"logical_axis_rules put 'heads' on {specs[0][2]} but 'kv_heads' on {specs[1][2]}: ring "
                         "attention needs both on the same mesh axes. Map them to the same axes.")
    args, in_axes = [q, k, v, segment_ids], [q_axes, kv_axes, kv_axes, ("batch", "length")]
    if sinks is not None:
        args.append(sinks)
        in_axes.append(("heads",))
    return sharding.run_in_shards(shard_fn, args, in_axes, q_axes)


def attention(q, k, v, segment_ids, *, platform: str, causal: bool, logits_soft_cap: float, scale: float | None,
              block_q: int, block_kv: int, interpret: bool | None, sinks=None):
    """attention.attention's form with attention=flash and context_parallel_strategy=ring (checked there): the
    target `platform` (gpu or cpu) sets the kernel's shared memory and, on cpu, interpret mode."""
    shared_memory = chips.gpu_shared_memory(sharding.active_devices()) if platform == "gpu" else DEFAULT_SHARED_MEMORY
    return ring_flash_attention(q, k, v, segment_ids, causal=causal, logits_soft_cap=logits_soft_cap, scale=scale,
                                sinks=sinks, interpret=platform == "cpu" if interpret is None else interpret,
                                block_q=block_q, block_k=block_kv, shared_memory=shared_memory)
