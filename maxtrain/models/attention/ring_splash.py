"""Ring attention with JAX's TPU splash kernel per block pair (attention=flash, context_parallel_strategy=ring on TPUs).

The ring of ring_flash.py (the same calls, block skipping under dual_chunk_swap, online-softmax merge, sinks joined
at the end, custom VJP from the global out and lse), each call a splash kernel instead of the Triton one. Splash
returns its log-sum-exp with save_residuals=True (forward only: it refuses AD through that form), so the forward
builds kernels that save residuals, and the backward calls splash's own backward (`_splash_attention_bwd`, private
to JAX: checked against jax 0.10.2 and 0.12) with residuals made from the GLOBAL out and lse. Splash does not
scale: q is scaled before the ring (the gradient's chain rule then scales dq). Its masks are static per call shape:
causal (the own block) and full (the other pairs); dual_chunk_swap without a window only, and chunks of a multiple
of 128 tokens (the TPU's lanes).

Letters as in attention/__init__.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

from maxtrain.kernels import splash_tables
from maxtrain.models.attention import ring_flash
from maxtrain.models.attention.ring import run_ring

LANES = 128


class _RingSplash(ring_flash.RingFlash):
    """ring_flash.RingFlash's ring with splash calls; the kernel "configs" are the mask kinds "causal" and "full"."""

    def __init__(self, axes, ways, causal, *, logits_soft_cap: float, block: int, interpret: bool, pairs=None,
                 inner: int = 1):
        super().__init__(axes, ways, causal, "dual_chunk_swap", 0, {"causal": "causal", "full": "full",
                                                                      "positions": None}, pairs)
        self.logits_soft_cap, self.block, self.interpret, self.inner = logits_soft_cap, block, interpret, inner

    def sees_early(self, step):
        """As RingFlash's, the ring index being the device's over `inner` (usp.py: its slice, rings of every
        inner-th device)."""
        d = jax.lax.axis_index(self.axes) // self.inner
        return (d - step) % self.ways < d

    def kernel(self, kind: str, q_len: int, kv_len: int, heads: int):
        """A splash kernel (saving residuals) for one call's shape and mask kind, built in the trace that uses it
        (its mask tables are arrays of that trace)."""
        shape = (q_len, kv_len)
        mask = masks.CausalMask(shape) if kind == "causal" else masks.FullMask(shape)
        b = self.block
        sizes = splash.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                                  block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
        return splash_tables.make_kernel(  # splash's own table pass costs (L / block)^2 Python steps
            mask, sizes, save_residuals=True, interpret=self.interpret,
            attn_logits_soft_cap=self.logits_soft_cap if self.logits_soft_cap > 0 else None)

    def call_forward(self, q, k, v, segment_ids, q_index, kv_segment_ids, kv_index, cfg):
        kernel = self.kernel(cfg, q.shape[1], k.shape[1], q.shape[2])

        def one_row(q, k, v, q_seg, kv_seg):  # splash is head-major: [N, T, H]
            out, (lse,) = kernel(q.swapaxes(0, 1), k.swapaxes(0, 1), v.swapaxes(0, 1),
                                 segment_ids=splash.SegmentIds(q=q_seg, kv=kv_seg))
            return out.swapaxes(0, 1).astype(jnp.float32), lse
        with jax.named_scope(scope(cfg)):
            return jax.vmap(one_row)(q, k, v, segment_ids, kv_segment_ids)

    def call_backward(self, q, k, v, segment_ids, q_index, kv_segment_ids, kv_index, out, lse, d_out, cfg):
        kernel = self.kernel(cfg, q.shape[1], k.shape[1], q.shape[2])
        kw = kernel.kwargs
        def collapse(info):  # as splash's own entry point does before its custom VJP
            if info is None or info.partial_mask_blocks is None:
                return info
            return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(
                -1, *info.partial_mask_blocks.shape[-2:]))

        def one_row(q, k, v, q_seg, kv_seg, out, lse, d_out):
            heads = lambda x: x.swapaxes(0, 1)  # noqa: E731
            res = (heads(q), heads(k), heads(v), splash.SegmentIds(q=q_seg, kv=kv_seg), None, heads(out), lse,
                   collapse(kernel.dq_mask_info), collapse(kernel.dkv_mask_info))
            grads = splash._splash_attention_bwd(  # pylint: disable=protected-access
                False, kw["mask_value"], kw["is_mqa"], kw["block_sizes"], None, kw["mask_function"],
                kw["attn_logits_soft_cap"], kw["interpret"], res, heads(d_out))
            dq, dk, dv = grads[3:6]
            return tuple(heads(g).astype(jnp.float32) for g in (dq, dk, dv))
        with jax.named_scope(scope(cfg)):
            return jax.vmap(one_row)(q, k, v, segment_ids, kv_segment_ids, out, lse, d_out)


def scope(kind: str) -> str:
    """The name scope of a call's splash kernels, kept in their compiled ops' op_name: the full-mask pairs' says
    `_every_block`, which the step-time predictor (compile/hlo_kernels.py) counts whole, as it does our flash kernel's
    calls of that name (splash names its calls itself); the causal calls' are halved."""
    return "ring_splash_full_every_block" if kind == "full" else f"ring_splash_{kind}"


def ring_splash_attention(q, k, v, segment_ids, *, causal: bool = True, logits_soft_cap: float = 0.0,
                          scale: float | None = None, sinks=None, interpret: bool = False, block_q: int = 512,
                          block_kv: int = 512):
    """ring_flash.ring_flash_attention's contract (dual_chunk_swap, no window) with splash kernels per block pair."""
    shard_fn = functools.partial(ring_splash_shard, causal=causal, logits_soft_cap=logits_soft_cap, scale=scale,
                                 interpret=interpret, block_q=block_q, block_kv=block_kv)
    return ring_flash.run_in_shards(shard_fn, q, k, v, segment_ids, sinks, "dual_chunk_swap")


def ring_splash_shard(q, k, v, segment_ids, q_index, sinks=None, *, axes, ways, causal=True, logits_soft_cap=0.0,
                      scale=None, interpret=False, block_q=512, block_kv=512, pairs=None, inner=1):
    """ring_flash.ring_flash_shard's contract with splash kernels (dual_chunk_swap, no window). usp.py passes its
    ring across slices: `pairs`, and `inner` devices per ring position (the ring index is axis_index // inner)."""
    h, hv = q.shape[3], v.shape[3]
    chunk = q.shape[1] // 2
    block = min(max(block_q, block_kv), chunk & -chunk)
    if block < LANES:
        raise ValueError(f"attention=flash with context_parallel_strategy=ring on TPUs needs each device's two chunks "
                         f"of {chunk} tokens to be a multiple of {LANES}; use a max_target_length that is a multiple "
                         f"of {LANES} x 2 x context parallelism")
    ring = _RingSplash(axes, ways, causal, logits_soft_cap=logits_soft_cap, block=block, interpret=interpret,
                       pairs=pairs, inner=inner)
    width = max(h, hv)
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, width - x.shape[3])])  # noqa: E731
    q = q * jnp.asarray(h**-0.5 if scale is None else scale, q.dtype)  # splash does not scale
    return run_ring(ring, pad(q), pad(k), pad(v), segment_ids, q_index, sinks)[..., :hv]
