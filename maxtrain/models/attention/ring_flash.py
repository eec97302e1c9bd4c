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
(flash_attention.backward) given the GLOBAL out and lse (its delta = rowsum(d_out * out) is then global, as the
softmax's gradient needs); a last pass takes dk and dv home. Per device the kernel holds T / C keys at a time.

A sliding window, and the striped layout (token t on device t mod C: every pair is causal with a shift), need the
tokens' original indices in the mask, not the call's own: the kernel then takes them as operands (KernelConfig
positions=True, q_pos and kv_pos after the segment ids), visiting every key block of a call (a tile that the
positions' bounds hide runs no matmul: contiguous runs of tokens skip as by index, striped ones little). Under dual_chunk_swap
the calls are those above (the window only hides more); under striped each pair runs whole, masked by position
(no pair is wholly hidden, so nothing is skipped beyond the kernel's own masking). Per-block outputs and gradients
are rounded to the input dtype by the kernel before being merged or summed in float32 (exact for float32 inputs).
On TPUs the calls are JAX's splash kernel (ring_splash.py: dual_chunk_swap without windows).

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
from maxtrain.kernels import flash_attention
from maxtrain.kernels.flash_tiles import DEFAULT_SHARED_MEMORY, MIN_BLOCK, default_tuning
from maxtrain.models.attention.ring import run_ring
from maxtrain.parallel import context, sharding

_NO_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)  # the kernel's finite "minus infinity": lse of an unseen row


def kernel_configs(head_pad: int, dtype, run: int, *, causal: bool, sliding_window: int, logits_soft_cap: float,
             scale: float, interpret: bool, block_q: int, block_k: int, shared_memory: int):
    """KernelConfigs {"causal", "full", "positions"} whose blocks divide `run` (the tokens of the shortest call, so
    no call pads). "positions" masks causally (if causal) and by the window with the tokens' original indices."""
    tuning = default_tuning(head_pad, dtype, block_q, block_k, shared_memory)
    fit = run & -run  # the largest power of two dividing it
    if fit < MIN_BLOCK:
        raise ValueError(f"attention=flash with context_parallel_strategy=ring needs runs of a multiple of {MIN_BLOCK} "
                         f"tokens per call, not {run}; use a max_target_length that is a multiple of {MIN_BLOCK} x 2 x "
                         "context parallelism")
    tuning = {name: dataclasses.replace(t, block_q=min(t.block_q, fit), block_k=min(t.block_k, fit))
              for name, t in tuning.items()}
    common = dict(soft_cap=float(logits_soft_cap), scale=float(scale), kv_len=0, kv_padded=False,
                  interpret=bool(interpret), **tuning)
    return {"causal": flash_attention.KernelConfig(causal=True, sliding_window=0, **common),
            "full": flash_attention.KernelConfig(causal=False, sliding_window=0, **common),
            "positions": flash_attention.KernelConfig(causal=causal, sliding_window=sliding_window, positions=True,
                                                      **common)}


def _merge(out, lse, out_b, lse_b):
    """Online-softmax merge of two partial attentions: out [B, T, N, H] float32, lse [B, N, T]."""
    lse_new = jnp.logaddexp(lse, lse_b)
    weight = lambda l: jnp.exp(l - lse_new).transpose(0, 2, 1)[..., None]  # noqa: E731  [B, T, N, 1]
    return out * weight(lse) + out_b.astype(jnp.float32) * weight(lse_b), lse_new


class RingFlash:
    """One device's ring passes (forward and backward) with the flash kernel per block pair.

    A block is (k, v, kv_segment_ids, kv_index); the queries' side (segment_ids, q_index) stays. `skip`: causal
    dual_chunk_swap, whose block pairs after the own one run half (the module docstring); otherwise each pair runs
    whole. `positions`: a sliding window or the striped layout, whose masks need the tokens' original indices
    (the kernel's positions operands) rather than the call's own indices.
    """

    def __init__(self, axes, ways, causal, reorder, sliding_window, cfgs, pairs=None):
        self.axes, self.ways, self.cfgs = axes, ways, cfgs
        self.skip = causal and reorder == "dual_chunk_swap"
        self.positions = sliding_window > 0 or reorder != "dual_chunk_swap"
        self.own_cfg = cfgs["positions"] if self.positions else cfgs["causal" if causal else "full"]
        self.pair_cfg = cfgs["positions"] if self.positions else cfgs["full"]
        self.pairs = pairs if pairs is not None else [(i, (i + 1) % ways) for i in range(ways)]  # c sends to c + 1

    def pass_on(self, block):
        return jax.lax.ppermute(block, self.axes, self.pairs)

    def sees_early(self, step):
        """True where the block in hand after `step` passes came from an earlier device (s < d)."""
        d = jax.lax.axis_index(self.axes)
        return (d - step) % self.ways < d

    def indices(self, segment_ids, index):
        """The kernel's position operand [B, T] for `index` [T] (None without positions)."""
        return jnp.broadcast_to(index[None], segment_ids.shape) if self.positions else None

    def call_forward(self, q, k, v, segment_ids, q_index, kv_segment_ids, kv_index, cfg):
        out, lse = flash_attention.forward_call(q, k, v, segment_ids, kv_segment_ids, cfg,
                                                self.indices(segment_ids, q_index),
                                                self.indices(kv_segment_ids, kv_index))
        return out.astype(jnp.float32), lse

    def call_backward(self, q, k, v, segment_ids, q_index, kv_segment_ids, kv_index, out, lse, d_out, cfg):
        grads = flash_attention.backward(q, k, v, segment_ids, kv_segment_ids, out, lse, d_out, cfg,
                                self.indices(segment_ids, q_index), self.indices(kv_segment_ids, kv_index))
        return tuple(g.astype(jnp.float32) for g in grads)

    # -- forward -------------------------------------------------------------------------------------------
    def block_forward(self, q, segment_ids, q_index, block, step):
        """(out [B, T, N, H] float32, lse [B, N, T]) of this device's queries against the block in hand."""
        if not self.skip:
            return self.call_forward(q, *block[:2], segment_ids, q_index, *block[2:], self.pair_cfg)
        half = q.shape[1] // 2

        def early(q, segment_ids, q_index, k, v, kv_segment_ids, kv_index):  # all queries, the block's first chunk
            return self.call_forward(q, k[:, :half], v[:, :half], segment_ids, q_index, kv_segment_ids[:, :half],
                                     kv_index[:half], self.pair_cfg)

        def late(q, segment_ids, q_index, k, v, kv_segment_ids, kv_index):  # the second query chunk, the whole block
            out, lse = self.call_forward(q[:, half:], k, v, segment_ids[:, half:], q_index[half:], kv_segment_ids,
                                         kv_index, self.pair_cfg)
            unseen = jnp.full(lse.shape, _NO_SCORE, lse.dtype)
            return jnp.concatenate([jnp.zeros_like(out), out], axis=1), jnp.concatenate([unseen, lse], axis=2)

        return jax.lax.cond(self.sees_early(step), early, late, q, segment_ids, q_index, *block)

    def forward(self, q, k, v, segment_ids, q_index, sinks):
        """(out [B, T, N, H] in q.dtype, lse [B, N, T] float32), sinks joined."""
        block = (k, v, segment_ids, q_index)
        out, lse = self.call_forward(q, k, v, segment_ids, q_index, segment_ids, q_index, self.own_cfg)
        if self.ways > 1:  # a ring of one (one device, e.g. docs/gpu.md's ring check) has only its own block
            incoming = self.pass_on(block)  # each block travels on while the one in hand is attended (neither waits)

            def step(carry, i):
                out, lse, block = carry
                incoming = self.pass_on(block)
                out, lse = _merge(out, lse, *self.block_forward(q, segment_ids, q_index, block, i))
                return (out, lse, incoming), None

            (out, lse, last), _ = jax.lax.scan(step, (out, lse, incoming), jnp.arange(1, self.ways - 1))
            out, lse = _merge(out, lse, *self.block_forward(q, segment_ids, q_index, last, self.ways - 1))
        if sinks is not None:  # one more column of each softmax, no value row (flash_attention._with_sinks)
            lse_sinks = jnp.logaddexp(lse, sinks.astype(jnp.float32)[None, :, None])
            out, lse = out * jnp.exp(lse - lse_sinks).transpose(0, 2, 1)[..., None], lse_sinks
        return out.astype(q.dtype), lse

    # -- backward ------------------------------------------------------------------------------------------
    def block_backward(self, q, segment_ids, q_index, out, lse, d_out, block, step):
        """(dq [B, T, N, H], dk, dv [B, S, G, H]) float32 of the pair of this device's queries and the block."""
        if not self.skip:
            return self.call_backward(q, *block[:2], segment_ids, q_index, *block[2:], out, lse, d_out, self.pair_cfg)
        half = q.shape[1] // 2

        def early(q, segment_ids, q_index, out, lse, d_out, k, v, kv_segment_ids, kv_index):
            dq, dk, dv = self.call_backward(q, k[:, :half], v[:, :half], segment_ids, q_index,
                                            kv_segment_ids[:, :half], kv_index[:half], out, lse, d_out, self.pair_cfg)
            pad = lambda x: jnp.concatenate([x, jnp.zeros_like(x)], axis=1)  # noqa: E731
            return dq, pad(dk), pad(dv)

        def late(q, segment_ids, q_index, out, lse, d_out, k, v, kv_segment_ids, kv_index):
            dq, dk, dv = self.call_backward(q[:, half:], k, v, segment_ids[:, half:], q_index[half:], kv_segment_ids,
                                            kv_index, out[:, half:], lse[:, :, half:], d_out[:, half:], self.pair_cfg)
            return jnp.concatenate([jnp.zeros_like(dq), dq], axis=1), dk, dv

        return jax.lax.cond(self.sees_early(step), early, late, q, segment_ids, q_index, out, lse, d_out, *block)

    def backward(self, q, k, v, segment_ids, q_index, sinks, out, lse, d_out):
        """(dq, dk, dv, d_sinks or None) from the global out and lse (sinks joined)."""
        block = (k, v, segment_ids, q_index)
        dq, dk, dv = self.call_backward(q, k, v, segment_ids, q_index, segment_ids, q_index, out, lse, d_out,
                                        self.own_cfg)
        if self.ways > 1:
            incoming = self.pass_on(block)  # k, v, ids travel on while the block in hand is attended

            def step(carry, i):
                dq, block, (dk, dv) = carry  # dk, dv: the sums of the devices this block has passed, following it
                incoming = self.pass_on(block)
                dq_b, dk_b, dv_b = self.block_backward(q, segment_ids, q_index, out, lse, d_out, block, i)
                return (dq + dq_b, incoming, self.pass_on((dk + dk_b, dv + dv_b))), None

            (dq, last, (dk, dv)), _ = jax.lax.scan(step, (dq, incoming, self.pass_on((dk, dv))),
                                                   jnp.arange(1, self.ways - 1))
            dq_b, dk_b, dv_b = self.block_backward(q, segment_ids, q_index, out, lse, d_out, last, self.ways - 1)
            dq = dq + dq_b
            dk, dv = self.pass_on((dk + dk_b, dv + dv_b))  # each block's dk, dv home to the device holding its keys
        d_sinks = None
        if sinks is not None:  # d sink = -sum over queries of exp(sink - lse) delta (flash_attention._flash_bwd)
            delta = jnp.einsum("BTNH,BTNH->BNT", d_out.astype(jnp.float32), out.astype(jnp.float32))
            p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
            d_sinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_sinks


def ring_flash_shard(q, k, v, segment_ids, q_index, sinks=None, *, axes: tuple[str, ...], ways: int,
                     reorder: str = "dual_chunk_swap", causal: bool = True, sliding_window: int = 0,
                     logits_soft_cap: float = 0.0, scale: float | None = None, interpret: bool = False,
                     block_q: int = 128, block_k: int = 128, shared_memory: int = DEFAULT_SHARED_MEMORY, pairs=None):
    """One device's part inside shard_map over the context mesh `axes` (a ring of `ways` devices, the layout
    `reorder`): q [B, T, N, H], k and v [B, T, G, H] (v's head dim may differ), segment_ids [B, T], q_index [T] (the
    tokens' original indices), sinks [N] or None. Returns [B, T, N, Hv] in q.dtype. `pairs`: the ring's (source,
    destination) over `axes`, default c -> c + 1 mod `ways`; usp.py passes its ring across slices, with a `reorder`
    other than dual_chunk_swap (its tokens are a slice's pieces: masked by position, no block skipped)."""
    n, g, h, hv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({g})")
    head_pad = max(MIN_BLOCK, 1 << (max(h, hv) - 1).bit_length())
    run = q.shape[1] // 2 if causal and reorder == "dual_chunk_swap" else q.shape[1]  # the shortest call's tokens
    cfgs = kernel_configs(head_pad, q.dtype, run, causal=causal, sliding_window=sliding_window,
                    logits_soft_cap=logits_soft_cap, scale=h**-0.5 if scale is None else scale, interpret=interpret,
                    block_q=block_q, block_k=block_k, shared_memory=shared_memory)
    ring = RingFlash(axes, ways, causal, reorder, sliding_window, cfgs, pairs)
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, head_pad - x.shape[3])])  # noqa: E731  q.k and out unchanged
    return run_ring(ring, pad(q), pad(k), pad(v), segment_ids, q_index, sinks)[..., :hv]


def ring_flash_attention(q, k, v, segment_ids, *, reorder: str = "dual_chunk_swap", causal: bool = True,
                         sliding_window: int = 0, logits_soft_cap: float = 0.0, scale: float | None = None, sinks=None,
                         interpret: bool = False, block_q: int = 128, block_k: int = 128,
                         shared_memory: int = DEFAULT_SHARED_MEMORY):
    """ring.ring_attention's contract (q [B, T, N, H] in the layout `reorder`, sharded along T over the context axes
    of the active mesh) with the flash kernel per block pair."""
    shard_fn = functools.partial(ring_flash_shard, reorder=reorder, causal=causal, sliding_window=sliding_window,
                                 logits_soft_cap=logits_soft_cap, scale=scale, interpret=interpret, block_q=block_q,
                                 block_k=block_k, shared_memory=shared_memory)
    return run_in_shards(shard_fn, q, k, v, segment_ids, sinks, reorder)


def run_in_shards(shard_fn, q, k, v, segment_ids, sinks, reorder: str):
    """shard_fn(q, k, v, segment_ids, q_index[, sinks], axes=, ways=) on each device's part of the sequence, inside
    shard_map over the context axes of the active mesh (q_index: the tokens' original indices in the layout)."""
    active = sharding.active_mesh()
    if active is None:
        raise ValueError("ring attention runs under sharding.activation_sharding (a mesh with a context axis)")
    mesh, rules = active
    axes = tuple(a for a in sharding.mesh_axes_of("length", rules) if mesh.shape[a] > 1)
    ways = int(np.prod([mesh.shape[a] for a in axes]))
    q_index = jnp.asarray(context.layout(q.shape[1], ways, reorder), jnp.int32)
    q_axes, kv_axes = ("batch", "length", "heads", None), ("batch", "length", "kv_heads", None)
    specs = sharding.active_specs([q_axes, kv_axes])
    if specs is not None and specs[0][2] != specs[1][2]:
        raise ValueError(f"logical_axis_rules put 'heads' on {specs[0][2]} but 'kv_heads' on {specs[1][2]}: ring "
                         "attention needs both on the same mesh axes. Map them to the same axes.")
    args, in_axes = [q, k, v, segment_ids, q_index], [q_axes, kv_axes, kv_axes, ("batch", "length"), ("length",)]
    if sinks is not None:
        args.append(sinks)
        in_axes.append(("heads",))
    return sharding.run_in_shards(functools.partial(shard_fn, axes=axes, ways=ways), args, in_axes, q_axes)


def kernel_settings(platform: str, block_q: int, block_kv: int, interpret: bool | None) -> dict:
    """ring_flash_shard's kernel settings for the target `platform` (gpu or cpu): its shared memory and, on cpu,
    interpret mode."""
    shared_memory = chips.gpu_shared_memory(sharding.active_devices()) if platform == "gpu" else DEFAULT_SHARED_MEMORY
    return {"interpret": platform == "cpu" if interpret is None else interpret, "block_q": block_q,
            "block_k": block_kv, "shared_memory": shared_memory}


def attention(q, k, v, segment_ids, *, platform: str, reorder: str, causal: bool, sliding_window: int,
              logits_soft_cap: float, scale: float | None, block_q: int, block_kv: int, interpret: bool | None,
              sinks=None):
    """attention.attention's form with attention=flash and context_parallel_strategy=ring on a GPU or CPU (checked
    there)."""
    return ring_flash_attention(q, k, v, segment_ids, reorder=reorder, causal=causal, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap, scale=scale, sinks=sinks,
                                **kernel_settings(platform, block_q, block_kv, interpret))
