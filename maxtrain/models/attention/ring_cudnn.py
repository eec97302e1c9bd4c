"""Ring attention with cuDNN's fused attention per block pair (attention=cudnn, context_parallel_strategy=ring or
usp's ring across slices, NVIDIA GPUs).

The ring is ring_flash.py's (the same passes, the same causal block skipping under dual_chunk_swap, the same online
merge of each pair's (out, lse) and sinks joined once at the end); only a pair's calls differ. Forward: cuDNN's
fused attention, which returns the pair's output and its softmax statistics (the log-sum-exp per query and head).
Backward: cuDNN's fused attention backward, given the GLOBAL out and lse of the ring (as ring_flash.py gives them to
the flash kernel), which is all the pair's gradient needs:

    p = exp(score - lse_global) (masked),   delta = rowsum(d_out * out_global),
    dv = p^T d_out,   d_score = p (d_out v^T - delta),   dq = d_score k scale,   dk = d_score^T q scale.

Why our own call of cuDNN's backward (`cudnn_block_grad`), where JAX has one: jax.nn.dot_product_attention's VJP
feeds the primitive only its own residuals (the pair's out and lse, not the ring's). The primitive
(jax/_src/cudnn/fused_attention_stablehlo.py, `_dot_product_attention_bwd_p_wrapper`) takes the statistics and the
output as operands (`activation, fwd_output, grad_output`), but its name is private and its operands differ by
version (read in the installed sources of jax 0.10.2, 0.11.2 and 0.12.0.1): 0.10 and 0.11 bind 13 operands and the
parameters scale, seed, dropout_rate, variadic_args, mask_type, layout, sliding_window_length; 0.12 adds flex
attention's `*score_mod_args` after grad_output (none here) and the parameter `score_mod` (None). The boolean mask's
bias needs no gradient: 0.10's own path still exports dbias whenever there is a bias (dropped here), 0.11 and 0.12's
do not (variadic_args = (has_bias, has_dbias) as each version's own dot_product_attention sets it). `backward_form`
picks the form by jax's version, then checks it against the installed implementation's signature
(`_dot_product_attention_bwd_impl`, BWD_FORMS); any other jax (or a changed signature) runs the flash kernel's
backward instead, and the start-up summary says so and why (attention.resolve_implementation); asked for directly,
cudnn_block_grad refuses in one line. The forward is reached through the module's public
`dot_product_attention(..., return_residual=True)`, the function jax.nn.dot_product_attention calls, whose signature
is the same in these versions for the arguments used here (checked when called). The public
jax.nn.dot_product_attention(return_residual=True) is not used: it casts the statistics to the output's dtype
(jax/_src/nn/functions.py: `residual = jnp.transpose(residual, (0, 2, 1)).astype(out.dtype)`, line 1248 in 0.10.2),
and a bfloat16 log-sum-exp is off by up to ~0.03 at lse ~ 10: each pair's weight in the merge, and every p of the
backward, off by ~3%. Unchecked on a GPU so far (scripts/gpu_ring_check.py's row "cudnn forward and backward"): that
cuDNN's statistics are the natural-log log-sum-exp both calls assume, and the backward's numbers.

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
(kernel_choice.KERNEL_LIMITS), until a GPU has checked them. `block` and `block_grad` are injectable (block(q, k,
v, mask, causal=, scale=) -> (out [B, T, N, H], lse [B, N, T] float32); block_grad(q, k, v, mask, out, lse, d_out,
causal=, scale=) -> (dq, dk, dv), None for the flash kernel's backward): on CPU the tests give them plain-jnp forms
(reference_block, reference_block_grad), since cuDNN does not run there. The bias materialized per pair is T x S of
the compute dtype, in the backward as in the forward.

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


# jax's private cuDNN backward (fused_attention_stablehlo.py's `_dot_product_attention_bwd_p_wrapper`), read in the
# installed sources of jax 0.10.2, 0.11.2 and 0.12.0.1: the parameters of its implementation
# (`_dot_product_attention_bwd_impl`), which the bind below must match, by form.
_BWD_OPERANDS = ("query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets", "page_table_k",
                 "page_table_v", "activation", "fwd_output", "grad_output")
_BWD_PARAMS = ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout", "sliding_window_length")
BWD_FORMS = {"0.10": _BWD_OPERANDS + _BWD_PARAMS,  # jax 0.10.x and 0.11.x
             "0.12": _BWD_OPERANDS + ("score_mod_args",) + _BWD_PARAMS + ("score_mod",)}  # + flex attention's
_BWD_NAMES = ("_dot_product_attention_bwd_p_wrapper", "get_large_negative_number", "MaskType", "AttentionLayout")


def backward_form(module=None, version: tuple[int, ...] | None = None) -> tuple[str | None, str]:
    """(form, "") when cuDNN's own backward can run per block pair with this jax (a key of BWD_FORMS), else (None,
    why, one line). The form is chosen by jax's version and then checked against the installed signature.
    module, version: jax's cuDNN module and version (tests give others)."""
    version = tuple(jax.__version_info__[:2]) if version is None else tuple(version[:2])
    here = ".".join(map(str, version))
    if (0, 10) <= version < (0, 12):
        form = "0.10"
    elif version == (0, 12):
        form = "0.12"
    else:
        return None, f"jax {here}'s private cuDNN backward was not read here (0.10 to 0.12 were)"
    if module is None:
        # deferred: jax's cuDNN module, only where cuDNN's backward is asked for
        from jax._src.cudnn import fused_attention_stablehlo as module  # pylint: disable=import-outside-toplevel
    impl = getattr(module, "_dot_product_attention_bwd_impl", None)
    found = tuple(inspect.signature(impl).parameters) if impl is not None else ()
    if found != BWD_FORMS[form] or not all(hasattr(module, name) for name in _BWD_NAMES):
        return None, (f"jax {here}'s private cuDNN backward takes ({', '.join(found) or 'nothing found'}), not the "
                      f"jax {form} form ring_cudnn.py binds")
    return form, ""


@functools.cache
def cudnn_backward_unsupported() -> str:
    """Why cuDNN's backward cannot run per block pair with the installed jax (the Triton backward then runs, and the
    start-up summary says so); "" when it can."""
    return backward_form()[1]


def cudnn_block_grad(q, k, v, mask, out, lse, d_out, *, causal: bool, scale: float):
    """cuDNN's fused attention backward of one block pair, given the ring's GLOBAL out [B, T, N, H] and lse [B, N, T]
    (float32) and d_out: (dq, dk, dv) in q.dtype. mask [B, T, S] and causal as cudnn_block's (the same bias)."""
    form, why = backward_form()
    if form is None:
        raise ValueError(f"attention=cudnn's backward inside the ring: {why}; use attention=flash")
    cudnn = _cudnn_module()
    bias = jnp.where(mask[:, None], jnp.asarray(0, q.dtype), cudnn.get_large_negative_number(q.dtype))  # as forward
    unused = jnp.zeros(0, q.dtype)
    # dbias as each version's own dot_product_attention does for a boolean mask: 0.10 exports it whenever there is a
    # bias (dropped here), 0.11 and 0.12 do not
    export_dbias = tuple(jax.__version_info__[:2]) < (0, 11)
    params = dict(scale=scale, seed=42, dropout_rate=0.0, variadic_args=(True, export_dbias),
                  mask_type=cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK,
                  layout=cudnn.AttentionLayout.BTNH.value, sliding_window_length=None)
    if form == "0.12":
        params["score_mod"] = None  # no score_mod_args operands
    grads = cudnn._dot_product_attention_bwd_p_wrapper.bind(  # pylint: disable=protected-access
        q, k, v, bias, unused, unused, unused, unused, unused, unused, lse.astype(jnp.float32), out.astype(q.dtype),
        d_out.astype(q.dtype), **params)
    return tuple(grads[:3])


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


def reference_block_grad(q, k, v, mask, out, lse, d_out, *, causal: bool, scale: float):
    """cudnn_block_grad's contract in plain jnp (tests on CPU): the pair's (dq, dk, dv) in q.dtype from the global out
    and lse, p = exp(score - lse) over the pair's visible keys, delta = rowsum(d_out * out)."""
    n, g = q.shape[2], k.shape[2]
    if causal:
        mask = mask & jnp.tril(jnp.ones(mask.shape[1:], bool))[None]
    k_n, v_n = (jnp.repeat(x, n // g, axis=2).astype(jnp.float32) for x in (k, v))
    d_out, out = d_out.astype(jnp.float32), out.astype(jnp.float32)
    scores = jnp.einsum("BTNH,BSNH->BNTS", q.astype(jnp.float32), k_n) * scale
    p = jnp.where(mask[:, None], jnp.exp(jnp.where(mask[:, None], scores, 0.0) - lse[..., None]), 0.0)
    delta = jnp.einsum("BTNH,BTNH->BNT", d_out, out)
    d_scores = p * (jnp.einsum("BTNH,BSNH->BNTS", d_out, v_n) - delta[..., None]) * scale
    group = lambda x: x.reshape(*x.shape[:2], g, n // g, x.shape[-1]).sum(axis=3)  # noqa: E731  [B, S, G, H]
    dq = jnp.einsum("BNTS,BSNH->BTNH", d_scores, k_n)
    dk = group(jnp.einsum("BNTS,BTNH->BSNH", d_scores, q.astype(jnp.float32)))
    dv = group(jnp.einsum("BNTS,BTNH->BSNH", p, d_out))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


class RingCudnn(ring_flash.RingFlash):
    """RingFlash with `block` (cuDNN's forward) for each pair's forward, and `block_grad` (cuDNN's backward, given the
    global out and lse) for each pair's backward; block_grad None: the flash kernel's backward."""

    def __init__(self, axes, ways, causal, reorder, sliding_window, cfgs, pairs=None, block=cudnn_block,
                 block_grad=None):
        super().__init__(axes, ways, causal, reorder, sliding_window, cfgs, pairs)
        self.causal, self.sliding_window, self.block, self.block_grad = causal, sliding_window, block, block_grad

    def mask(self, segment_ids, q_index, kv_segment_ids, kv_index):
        """[B, T, S] by the tokens' original indices: right for every pair."""
        return ring.block_mask(segment_ids, kv_segment_ids, q_index, kv_index, causal=self.causal,
                               sliding_window=self.sliding_window)

    def call_forward(self, q, k, v, segment_ids, q_index, kv_segment_ids, kv_index, cfg):
        mask = self.mask(segment_ids, q_index, kv_segment_ids, kv_index)
        out, lse = self.block(q, k, v, mask, causal=cfg.causal and not cfg.positions, scale=cfg.scale)
        seen = jnp.any(mask, axis=-1)  # [B, T]: rows that meet at least one key of this pair
        lse = jnp.where(seen[:, None], lse.astype(jnp.float32), _NO_SCORE)
        return jnp.where(seen[..., None, None], out.astype(jnp.float32), 0.0), lse

    def call_backward(self, q, k, v, segment_ids, q_index, kv_segment_ids, kv_index, out, lse, d_out, cfg):
        if self.block_grad is None:
            return super().call_backward(q, k, v, segment_ids, q_index, kv_segment_ids, kv_index, out, lse, d_out, cfg)
        mask = self.mask(segment_ids, q_index, kv_segment_ids, kv_index)  # a row that sees no key: p = 0 by the bias
        grads = self.block_grad(q, k, v, mask, out, lse, d_out, causal=cfg.causal and not cfg.positions,
                                scale=cfg.scale)
        return tuple(g.astype(jnp.float32) for g in grads)


def ring_cudnn_shard(q, k, v, segment_ids, q_index, sinks=None, *, axes: tuple[str, ...], ways: int,
                     reorder: str = "dual_chunk_swap", causal: bool = True, sliding_window: int = 0,
                     logits_soft_cap: float = 0.0, scale: float | None = None, interpret: bool = False,
                     block_q: int = 128, block_k: int = 128, shared_memory: int = DEFAULT_SHARED_MEMORY, pairs=None,
                     block=cudnn_block, block_grad=None):
    """ring_flash.ring_flash_shard's contract with `block` (cuDNN) for each pair's forward and `block_grad` (cuDNN's
    backward; None: the flash kernel's, whose settings interpret, block_q, block_k and shared_memory are) for each
    pair's backward. usp.py passes its ring across slices (`pairs`, reorder striped: masked by position)."""
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
    attention_ring = RingCudnn(axes, ways, causal, reorder, sliding_window, cfgs, pairs, block, block_grad)
    pad = lambda x: jnp.pad(x, [(0, 0)] * 3 + [(0, head_pad - x.shape[3])])  # noqa: E731  q.k and out unchanged
    return ring.run_ring(attention_ring, pad(q), pad(k), pad(v), segment_ids, q_index, sinks)[..., :hv]


def ring_cudnn_attention(q, k, v, segment_ids, *, reorder: str = "dual_chunk_swap", causal: bool = True,
                         sliding_window: int = 0, logits_soft_cap: float = 0.0, scale: float | None = None, sinks=None,
                         interpret: bool = False, block_q: int = 128, block_k: int = 128,
                         shared_memory: int = DEFAULT_SHARED_MEMORY, block=cudnn_block, block_grad=None):
    """ring.ring_attention's contract (q [B, T, N, H] in the layout `reorder`, sharded along T over the context axes
    of the active mesh) with cuDNN's forward (`block`) and backward (`block_grad`; None: the flash kernel's) per
    block pair."""
    shard_fn = functools.partial(ring_cudnn_shard, reorder=reorder, causal=causal, sliding_window=sliding_window,
                                 logits_soft_cap=logits_soft_cap, scale=scale, interpret=interpret, block_q=block_q,
                                 block_k=block_k, shared_memory=shared_memory, block=block, block_grad=block_grad)
    return ring_flash.run_in_shards(shard_fn, q, k, v, segment_ids, sinks, reorder)


def settings(platform: str, block_q: int, block_kv: int, interpret: bool | None, sinks=None,
             strategy: str = "ring") -> dict:
    """ring_cudnn_shard's settings for attention=cudnn on `platform` (GPUs) inside context_parallel_strategy
    `strategy`'s ring: cuDNN's forward, its backward where the installed jax's is one this module binds
    (cudnn_backward_unsupported; else the flash kernel's, as the start-up summary says), the flash kernel's settings."""
    if platform != "gpu":
        raise ValueError(f"attention=cudnn inside context_parallel_strategy={strategy} needs an NVIDIA GPU (cuDNN), "
                         f"but the platform is {platform!r}; use attention=flash")
    if sinks is not None:
        raise ValueError(f"attention=cudnn has no attention sinks; use attention=flash inside "
                         f"context_parallel_strategy={strategy}")
    return {"block": cudnn_block, "block_grad": default_block_grad(),
            **ring_flash.kernel_settings(platform, block_q, block_kv, interpret)}


def attention(q, k, v, segment_ids, *, platform: str, reorder: str, causal: bool, sliding_window: int,
              logits_soft_cap: float, scale: float | None, block_q: int, block_kv: int, interpret: bool | None,
              sinks=None):
    """attention.attention's form with attention=cudnn and context_parallel_strategy=ring (GPUs; `settings`)."""
    return ring_cudnn_attention(q, k, v, segment_ids, reorder=reorder, causal=causal, sliding_window=sliding_window,
                                logits_soft_cap=logits_soft_cap, scale=scale,
                                **settings(platform, block_q, block_kv, interpret, sinks))


def default_block_grad():
    """The pair backward attention=cudnn runs: cudnn_block_grad, or None (the flash kernel's) where the installed
    jax's private cuDNN backward is not one this module binds (cudnn_backward_unsupported says why)."""
    return None if cudnn_backward_unsupported() else cudnn_block_grad
