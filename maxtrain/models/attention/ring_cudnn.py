"""Ring attention with cuDNN's fused attention forward per block pair (attention=cudnn, context_parallel_strategy=ring,
NVIDIA GPUs).

The ring is ring_flash.py's (the same passes, the same causal block skipping under dual_chunk_swap, the same online
merge of each pair's (out, lse) and sinks joined once at the end); only a pair's forward call differs: cuDNN's fused
attention, which returns the pair's output and its softmax statistics (the log-sum-exp per query and head). The
backward pass is the flash kernel's (Triton), given the GLOBAL out and lse of the ring, as in ring_flash.py:

    p = exp(score - lse_global) (masked),   delta = rowsum(d_out * out_global),
    dv = p^T d_out,   d_score = p (d_out v^T - delta),   dq = d_score k scale,   dk = d_score^T q scale.

Why not cuDNN's backward too (read in jax 0.10.2 and 0.12's jax/_src/cudnn/fused_attention_stablehlo.py): its
backward primitive does take the statistics and the output as operands (`_dot_product_attention_bwd_rule` binds
`_dot_product_attention_bwd_p_wrapper` with `activation, fwd_output, grad_output`), but only through private names
whose operands changed between the two (0.12 adds `score_mod_args` after grad_output and `score_mod` parameters),
and nothing public reaches it: jax.nn.dot_product_attention's VJP takes its own residuals. The forward is reached
through the module's `dot_product_attention(..., return_residual=True)`, the function jax.nn.dot_product_attention
calls, whose signature is the same in both versions for the arguments used here (checked when called). The public
jax.nn.dot_product_attention(return_residual=True) is not used: it casts the statistics to the output's dtype
(jax/_src/nn/functions.py: `residual = jnp.transpose(residual, (0, 2, 1)).astype(out.dtype)`, line 1248 in 0.10.2),
and a bfloat16 log-sum-exp is off by up to ~0.03 at lse ~ 10: each pair's weight in the merge, and every p of the
backward, off by ~3%.

Masks: each pair's mask is ring.block_mask over the tokens' ORIGINAL indices (same segment; causal s <= t; a sliding
window t - s < W), given to cuDNN as a boolean [B, 1, T, S] mask (JAX turns it into an additive bias), so packed
documents, windows and the striped layout are exact; this device's own block under causal dual_chunk_swap also
passes cuDNN's causal mask type (the same mask, which lets cuDNN skip the hidden tiles). A query row that sees no key
of a pair (its document is not in the block, or the window ends before it) gets weight exactly 0 in the merge
(lse = -big), whatever cuDNN returns for such a row. The mask is materialized per pair: T x S (or T x S / 2) of the
compute dtype per row and per pair, where the flash kernel takes segment ids.

Not here: logit soft-capping (cuDNN's fused attention has none: refused with attention=flash as the fix); TPUs (no
cuDNN). Sinks would work (the ring joins them after the merge and takes their gradient from the global lse, as
ring_flash.py; the CPU test checks them) but stay refused with attention=cudnn, as everywhere else
(kernel_choice.KERNEL_LIMITS), until a GPU has checked them. `block` is injectable (block(q, k, v, mask, causal=,
scale=) -> (out [B, T, N, H], lse [B, N, T] float32)): on CPU the tests give it a plain-jnp forward, since cuDNN
does not run there.

Letters as in attention/__init__.py and ring_flash.py.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp

from maxtrain.kernels.flash_tiles import DEFAULT_SHARED_MEMORY, MIN_BLOCK
from maxtrain.models.attention import ring, ring_flash

# The rings' finite "minus infinity" (ring.py's, ring_flash.py's): the lse of a row a pair does not see.
_NO_SCORE = -0.7 * float(jnp.finfo(jnp.float32).max)

# The arguments of jax's cuDNN attention function (jax/_src/cudnn/fused_attention_stablehlo.py) this module passes;
# present in jax 0.10.2 and 0.12.
_CUDNN_ARGS = ("mask", "scale", "mask_type", "return_residual")


def _cudnn_module():
    """jax's cuDNN attention module, checked to take the arguments this module passes."""
    # deferred: jax's cuDNN module (and its cuDNN version check), only where cuDNN runs
    from jax._src.cudnn import fused_attention_stablehlo as cudnn  # pylint: disable=import-outside-toplevel

    params = inspect.signature(cudnn.dot_product_attention).parameters
    missing = [a for a in _CUDNN_ARGS if a not in params]
    if missing:
        raise ValueError(f"attention=cudnn inside context_parallel_strategy=ring needs jax's cuDNN attention to take "
                         f"{', '.join(missing)} (jax 0.10.2 to 0.12 do; this is jax {jax.__version__}); use "
                         "attention=flash")
    return cudnn


def cudnn_block(q, k, v, mask, *, causal: bool, scale: float):
    """cuDNN's fused attention forward of one block pair: (out [B, T, N, H] in q.dtype, lse [B, N, T] float32).
    mask [B, T, S] (boolean); causal: the mask is also top-left causal (cuDNN may skip the hidden tiles)."""
    cudnn = _cudnn_module()
    out, lse = cudnn.dot_product_attention(q, k, v, mask=mask[:, None], scale=scale, return_residual=True,
                                           mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK)
    return out, lse.astype(jnp.float32)


def reference_block(q, k, v, mask, *, causal: bool, scale: float):
    """cudnn_block's contract in plain jnp (tests on CPU): masked scores at dtype's large negative (a row that sees
    no key gets cuDNN's uniform softmax; the ring gives it weight 0 anyway)."""
    n, g = q.shape[2], k.shape[2]
    scores = jnp.einsum("BTNH,BSNH->BNTS", q, jnp.repeat(k, n // g, axis=2),
                        preferred_element_type=jnp.float32) * scale
    if causal:
        mask = mask & jnp.tril(jnp.ones(mask.shape[1:], bool))[None]
    scores = jnp.where(mask[:, None], scores, -0.7 * float(jnp.finfo(q.dtype).max))
    lse = jax.nn.logsumexp(scores, axis=-1)
    p = jnp.exp(scores - lse[..., None])
    out = jnp.einsum("BNTS,BSNH->BTNH", p, jnp.repeat(v, n // g, axis=2).astype(jnp.float32))
    return out.astype(q.dtype), lse


class RingCudnn(ring_flash.RingFlash):
    """RingFlash with `block` (cuDNN's forward) for each pair's forward; the backward stays the flash kernel's."""

    def __init__(self, axes, ways, causal, reorder, sliding_window, cfgs, pairs=None, block=cudnn_block):
        super().__init__(axes, ways, causal, reorder, sliding_window, cfgs, pairs)
        self.causal, self.sliding_window, self.block = causal, sliding_window, block

    def call_forward(self, q, k, v, segment_ids, q_index, kv_segment_ids, kv_index, cfg):
        mask = ring.block_mask(segment_ids, kv_segment_ids, q_index, kv_index, causal=self.causal,
                               sliding_window=self.sliding_window)  # by original indices: right for every pair
        out, lse = self.block(q, k, v, mask, causal=cfg.causal and not cfg.positions, scale=cfg.scale)
        seen = jnp.any(mask, axis=-1)  # [B, T]: rows that meet at least one key of this pair
        lse = jnp.where(seen[:, None], lse.astype(jnp.float32), _NO_SCORE)
        return jnp.where(seen[..., None, None], out.astype(jnp.float32), 0.0), lse


def ring_cudnn_shard(q, k, v, segment_ids, q_index, sinks=None, *, axes: tuple[str, ...], ways: int,
                     reorder: str = "dual_chunk_swap", causal: bool = True, sliding_window: int = 0,
                     logits_soft_cap: float = 0.0, scale: float | None = None, interpret: bool = False,
                     block_q: int = 128, block_k: int = 128, shared_memory: int = DEFAULT_SHARED_MEMORY, pairs=None,
                     block=cudnn_block):
    """ring_flash.ring_flash_shard's contract with `block` (cuDNN) for each pair's forward; interpret, block_q,
    block_k and shared_memory are the flash backward kernel's."""
    if logits_soft_cap > 0:
        raise ValueError(f"attention=cudnn has no logit soft-capping (logits_soft_cap={logits_soft_cap}); use "
                         "attention=flash inside the ring")
    n, g, h, hv = q.shape[2], k.shape[2], q.shape[3], v.shape[3]
    if n % g:
        raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({g})")
    head_pad = max(MIN_BLOCK, 1 << (max(h, hv) - 1).bit_length())
    run = q.shape[1] // 2 if causal and reorder == "dual_chunk_swap" else q.shape[1]  # the shortest call's tokens
    cfgs = ring_flash.kernel_configs(head_pad, q.dtype, run, causal=causal, sliding_window=sliding_window,
                                     logits_soft_cap=0.0, scale=h**-0.5 if scale is None else scale,
                                     interpret=interpret, block_q=block_q, block_k=block_k, shared_memory=shared_memory)
    attention_ring = RingCudnn(axes, ways, causal, reorder, sliding_window, cfgs, pairs, block)
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, head_pad - x.shape[3])])  # noqa: E731  q.k and out unchanged
    return ring.run_ring(attention_ring, pad(q), pad(k), pad(v), segment_ids, q_index, sinks)[..., :hv]


def ring_cudnn_attention(q, k, v, segment_ids, *, reorder: str = "dual_chunk_swap", causal: bool = True,
                         sliding_window: int = 0, logits_soft_cap: float = 0.0, scale: float | None = None, sinks=None,
                         interpret: bool = False, block_q: int = 128, block_k: int = 128,
                         shared_memory: int = DEFAULT_SHARED_MEMORY, block=cudnn_block):
    """ring.ring_attention's contract (q [B, T, N, H] in the layout `reorder`, sharded along T over the context axes
    of the active mesh) with cuDNN's forward (`block`) and the flash kernel's backward per block pair."""
    shard_fn = functools.partial(ring_cudnn_shard, reorder=reorder, causal=causal, sliding_window=sliding_window,
                                 logits_soft_cap=logits_soft_cap, scale=scale, interpret=interpret, block_q=block_q,
                                 block_k=block_k, shared_memory=shared_memory, block=block)
    return ring_flash.run_in_shards(shard_fn, q, k, v, segment_ids, sinks, reorder)


def attention(q, k, v, segment_ids, *, platform: str, reorder: str, causal: bool, sliding_window: int,
              logits_soft_cap: float, scale: float | None, block_q: int, block_kv: int, interpret: bool | None,
              sinks=None):
    """attention.attention's form with attention=cudnn and context_parallel_strategy=ring (GPUs)."""
    if platform != "gpu":
        raise ValueError(f"attention=cudnn inside context_parallel_strategy=ring needs an NVIDIA GPU (cuDNN), but the "
                         f"platform is {platform!r}; use attention=flash")
    if sinks is not None:
        raise ValueError("attention=cudnn has no attention sinks; use attention=flash inside the ring")
    return ring_cudnn_attention(q, k, v, segment_ids, reorder=reorder, causal=causal, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap, scale=scale,
                                **ring_flash.kernel_settings(platform, block_q, block_kv, interpret))
