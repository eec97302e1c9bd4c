"""The gated delta-net mixer (Qwen3-Next, Qwen3.5): a recurrent layer in place of attention.

    q, k, v, z = x W_q, x W_k, x W_v, x W_z        Nk query/key heads of Hk, Nv value heads of Hv (Nv a
                                                   multiple of Nk: each key head serves Nv / Nk value heads)
    b, a       = x W_b, x W_a                      one per value head
    q, k, v    = silu(causal_conv(q, k, v))        a depthwise convolution over the last gdn_conv_kernel_dim
                                                   tokens of the same document, per channel
    q, k       = l2norm(q) * Hk ** -0.5, l2norm(k)
    beta       = sigmoid(b);  log g = -exp(A_log) softplus(a + dt_bias)
    o          = gated_delta(q, k, v, log g, beta) (models/recurrent/gated_delta.py: chunks of gdn_chunk_size; gdn_kernel
                                                   picks the jnp form or kernels/gated_delta.py's Pallas kernel)
    out        = (rmsnorm_Hv(o) * silu(z)) W_o      the norm over each value head, gated by z

Packed documents stay apart: the convolution reads only its own document's tokens and the rule's state
restarts at each boundary (segment ids), so a packed row computes what its documents would alone.

With context parallelism (the sequence split over devices, parallel/context.py) the convolution and the rule run
per device on its chunks with what they need of the others' (models/recurrent/context_parallel.py).

Decoding keeps, per layer, the rule's state and the convolution's last K-1 inputs (`cache_spec`): the
prefill runs the chunked rule from them, each new token the recurrent step.

Parameters (one layer): lin_wq, lin_wk [D, Nk, Hk], lin_wv, lin_wz [D, Nv, Hv], lin_wb, lin_wa [D, Nv],
conv [K, 2 Nk Hk + Nv Hv] (the q, k, v channels in that order), dt_bias, a_log [Nv], lin_norm [Hv],
lin_wo [Nv, Hv, D].

Einsum letters: B batch, T length, D embed, N heads (Nk or Nv), H head dim, C conv channels.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain import errors
from maxtrain.kernels import gated_delta as gated_delta_kernel
from maxtrain.models import ops
from maxtrain.models.recurrent import context_parallel, gated_delta
from maxtrain.models.params import ParamSpec, dense
from maxtrain.parallel import sharding
from maxtrain.parallel.sharding import shard

KERNELS = ("jnp", "pallas")
_TOKEN_AXES, _GATE_AXES = ("batch", None, "heads", None), ("batch", None, "heads")


def resolve_kernel(setting: str, backend: str, chunk_size: int, key_dim: int = 128, value_dim: int = 128) -> str:
    """gdn_kernel for a backend: `autoselected` is the Pallas kernel on GPUs and TPUs (on a GPU only for head widths
    its Triton kernel takes), jnp on CPU (where `pallas` runs in interpret mode: slow, for tests). A chunk size or
    head width the kernel cannot take is refused here, at start-up (a ConfigError naming the setting)."""
    widths = gated_delta_kernel.head_width_problem("gpu" if backend == "cpu" else backend, key_dim, value_dim)
    if setting == "autoselected":
        setting = "pallas" if backend in ("gpu", "tpu") and not widths else "jnp"
    if setting not in KERNELS:
        raise errors.ConfigError(f"gdn_kernel={setting!r} is not one of autoselected, {', '.join(KERNELS)}")
    if setting == "pallas" and widths:  # on CPU the interpret-mode kernel is the GPU's
        raise errors.ConfigError(f"gdn_kernel=pallas: {widths}; use gdn_kernel=jnp")
    if setting == "pallas":
        try:
            gated_delta_kernel.check_chunk_size(chunk_size)
        except ValueError as e:
            raise errors.ConfigError(str(e)) from None
    return setting


def describe_kernel(implementation: str, backend: str) -> str:
    """How the gated delta rule runs, for the start-up summary."""
    if implementation == "jnp":
        return "jnp chunked"
    kind = {"gpu": "Pallas Triton", "tpu": "Pallas Mosaic"}.get(backend, f"Pallas, interpret mode on {backend}")
    return f"{kind} kernel (backward: jnp chunked)"


def rule(q, k, v, log_decay, beta, segment_ids, *, chunk_size: int, implementation: str, backend: str,
         reorder: str = "dual_chunk_swap"):
    """The rule's output [B, T, N, V] by the chosen implementation; the kernel runs per shard (shard_map). With
    context parallelism (tokens in the layout `reorder`), per device on its chunks (context_parallel.rule)."""
    if sharding.ways("length") > 1:
        return context_parallel.rule(q, k, v, log_decay, beta, segment_ids, reorder=reorder,
                                     local=_local_rule(chunk_size, implementation, backend))
    if implementation == "jnp":
        return gated_delta.chunked(q, k, v, log_decay, beta, segment_ids, chunk_size=chunk_size)[0]
    on_chip = backend in ("gpu", "tpu")
    kernel = gated_delta_kernel.make(gated_delta.chunked, chunk_size=chunk_size,
                                     platform=backend if on_chip else "gpu", interpret=not on_chip)
    local = lambda q, k, v, a, b, seg: kernel(q, k, v, a, b, seg, None)[0]
    return sharding.run_in_shards(local, (q, k, v, log_decay, beta, segment_ids),
                                  (_TOKEN_AXES,) * 3 + (_GATE_AXES,) * 2 + (("batch", None),), _TOKEN_AXES)


def _local_rule(chunk_size: int, implementation: str, backend: str):
    """f(q, k, v, log_decay, beta, segment_ids, initial_state) -> (o, final state) on one device's tokens."""
    if implementation == "jnp":
        return lambda *args: gated_delta.chunked(*args[:6], chunk_size=chunk_size, initial_state=args[6])
    on_chip = backend in ("gpu", "tpu")
    kernel = gated_delta_kernel.make(gated_delta.chunked, chunk_size=chunk_size,
                                     platform=backend if on_chip else "gpu", interpret=not on_chip)
    if backend == "tpu":  # the TPU kernel's blocks span the whole value head
        return kernel

    def in_gpu_blocks(q, k, v, log_decay, beta, segment_ids, initial_state):
        """The GPU kernel's value blocks are a power of two or whole GPU_BLOCK_V columns; context parallelism
        widens the values to Dv + Dk (e.g. 160): zero columns (values and state) up to such a width, then cut."""
        width, block = v.shape[-1], gated_delta_kernel.GPU_BLOCK_V
        pad = (-(-width // block) * block if width > block else 1 << (width - 1).bit_length()) - width
        if pad:
            v, initial_state = (jnp.pad(x, ((0, 0),) * 3 + ((0, pad),)) for x in (v, initial_state))
        o, state = kernel(q, k, v, log_decay, beta, segment_ids, initial_state)
        return o[..., :width], state[..., :width]
    return in_gpu_blocks


def conv_channels(config) -> int:
    return 2 * config.gdn_num_key_heads * config.gdn_key_head_dim + config.gdn_num_value_heads * config.gdn_value_head_dim


def specs(config) -> dict[str, ParamSpec]:
    d, nk, nv = config.base_emb_dim, config.gdn_num_key_heads, config.gdn_num_value_heads
    hk, hv, width = config.gdn_key_head_dim, config.gdn_value_head_dim, config.gdn_conv_kernel_dim
    return {
        "lin_wq": dense((d, nk, hk), ("embed", "heads", "head_dim"), d),
        "lin_wk": dense((d, nk, hk), ("embed", "heads", "head_dim"), d),
        "lin_wv": dense((d, nv, hv), ("embed", "heads", "head_dim"), d),
        "lin_wz": dense((d, nv, hv), ("embed", "heads", "head_dim"), d),
        "lin_wb": dense((d, nv), ("embed", "heads"), d),
        "lin_wa": dense((d, nv), ("embed", "heads"), d),
        "conv": dense((width, conv_channels(config)), (None, None), width),
        "dt_bias": ParamSpec((nv,), ("heads",), "ones"),
        "a_log": ParamSpec((nv,), ("heads",), "zeros"),     # A = exp(a_log) = 1 at initialization
        "lin_norm": ParamSpec((hv,), ("head_dim",), "ones"),
        "lin_wo": dense((nv, hv, d), ("heads", "head_dim", "embed"), nv * hv),
    }


def causal_conv(x, w, segment_ids):
    """Depthwise causal convolution of x [B, T, C] by w [K, C]: out_t = sum_j w_j x_{t - (K - 1) + j}, over the
    tokens of x_t's own document only (segment_ids [B, T])."""
    width, t = w.shape[0], x.shape[1]
    out = jnp.zeros(x.shape, jnp.float32)
    for j in range(width):
        shift = width - 1 - j
        if shift >= t:
            continue
        earlier = jnp.pad(x, ((0, 0), (shift, 0), (0, 0)))[:, :t]
        same = jnp.pad(segment_ids, ((0, 0), (shift, 0)), constant_values=-1)[:, :t] == segment_ids
        out = out + jnp.where(same[..., None], earlier.astype(jnp.float32), 0.0) * w[j].astype(jnp.float32)
    return out


def l2norm(x, eps: float = 1e-6):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def mixer(x, p, segment_ids, config, rt, cache=None):
    """The gated delta-net of x [B, T, D] (already normed) -> [B, T, D].

    Decoding (cache = (state [B, Nv, Hk, Hv] float32, window [B, K-1, C], valid [B, T] bool)): x continues the
    sequence whose rule state and last K-1 convolution inputs the cache holds (zeros: nothing before); tokens
    that are not `valid` (left padding) leave both untouched. A single token runs the recurrent step, more
    tokens the chunked rule. Returns (out, (new state, new window)) then."""
    dt, backend = rt.dtype, rt.backend
    nk, nv, hk, hv = (config.gdn_num_key_heads, config.gdn_num_value_heads, config.gdn_key_head_dim,
                      config.gdn_value_head_dim)
    b, t, _ = x.shape
    q = ops.dense(x, p["lin_wq"].astype(dt), backend=backend)   # "BTD,DNH->BTNH"
    k = ops.dense(x, p["lin_wk"].astype(dt), backend=backend)
    v = ops.dense(x, p["lin_wv"].astype(dt), backend=backend)
    z = ops.dense(x, p["lin_wz"].astype(dt), backend=backend)
    beta_logits = ops.dense(x, p["lin_wb"].astype(dt), backend=backend)   # "BTD,DN->BTN"
    a = ops.dense(x, p["lin_wa"].astype(dt), backend=backend)
    qkv = jnp.concatenate([q.reshape(b, t, nk * hk), k.reshape(b, t, nk * hk), v.reshape(b, t, nv * hv)], axis=-1)
    if cache is None and sharding.ways("length") > 1:  # the tokens in the layout, split over the context axes
        qkv = jax.nn.silu(context_parallel.causal_conv(qkv, p["conv"], segment_ids, local=causal_conv,
                                                       reorder=config.context_parallel_reorder_strategy))
    elif cache is None:
        qkv = jax.nn.silu(causal_conv(qkv, p["conv"], segment_ids))
    else:  # the window's inputs precede x's; padding enters as zeros, as a document's start sees them
        state, window, valid = cache
        qkv = jnp.concatenate([window, jnp.where(valid[..., None], qkv, 0).astype(window.dtype)], axis=1)
        window = qkv[:, t:]                                           # the last K-1 inputs, for the next call
        qkv = jax.nn.silu(causal_conv(qkv, p["conv"], jnp.ones(qkv.shape[:2], jnp.int32))[:, -t:])
    q, k, v = jnp.split(qkv, [nk * hk, 2 * nk * hk], axis=-1)
    q = l2norm(q.reshape(b, t, nk, hk)) * hk**-0.5
    k = l2norm(k.reshape(b, t, nk, hk))
    v = v.reshape(b, t, nv, hv)
    if nv > nk:  # each key head serves nv / nk consecutive value heads
        q, k = jnp.repeat(q, nv // nk, axis=2), jnp.repeat(k, nv // nk, axis=2)
    beta = jax.nn.sigmoid(beta_logits.astype(jnp.float32))
    log_decay = -jnp.exp(p["a_log"].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    if cache is None:
        o = rule(q, k, v, log_decay, beta, segment_ids, chunk_size=config.gdn_chunk_size,
                 implementation=rt.gdn_kernel, backend=backend, reorder=config.context_parallel_reorder_strategy)
    else:  # padding writes nothing (beta 0) and decays nothing (log g 0): the state passes it unchanged
        beta, log_decay = jnp.where(valid[..., None], beta, 0.0), jnp.where(valid[..., None], log_decay, 0.0)
        if t == 1:
            o, state = gated_delta.recurrent(q, k, v, log_decay, beta, initial_state=state)
        else:
            o, state = gated_delta.chunked(q, k, v, log_decay, beta, chunk_size=config.gdn_chunk_size,
                                           initial_state=state)
    o = shard(o, ("batch", "length", "heads", "head_dim"))
    o32 = o.astype(jnp.float32)
    normed = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + config.normalization_layer_epsilon)
    gated = normed * p["lin_norm"].astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
    out = ops.dense(gated.astype(dt), p["lin_wo"].astype(dt), 2, backend=backend)   # "BTNH,NHD->BTD"
    return out if cache is None else (out, (state.astype(jnp.float32), window))


def cache_spec(config, batch: int) -> dict:
    """One layer's decoding cache: the rule's state [B, Nv, Hk, Hv] (float32) and the convolution's window, the
    last K-1 inputs [B, K-1, C] (the cache's dtype): a fixed size, whatever the sequence's length."""
    nv, hk, hv = config.gdn_num_value_heads, config.gdn_key_head_dim, config.gdn_value_head_dim
    return {"state": ((batch, nv, hk, hv), jnp.float32),
            "conv": ((batch, config.gdn_conv_kernel_dim - 1, conv_channels(config)), None)}


def matmul_params(config) -> int:
    """Weights one token multiplies in the mixer: its projections, the convolution's taps and the output."""
    d, nk, nv = config.base_emb_dim, config.gdn_num_key_heads, config.gdn_num_value_heads
    hk, hv = config.gdn_key_head_dim, config.gdn_value_head_dim
    return d * (2 * nk * hk + 2 * nv * hv + 2 * nv) + config.gdn_conv_kernel_dim * conv_channels(config) + nv * hv * d


def rule_flops(config) -> float:
    """Forward FLOPs per token of the gated delta rule itself (models/recurrent/gated_delta.py)."""
    return gated_delta.flops_per_token(config.gdn_num_value_heads, config.gdn_key_head_dim, config.gdn_value_head_dim,
                                       config.gdn_chunk_size)
