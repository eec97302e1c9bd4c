"""The attention kernels as functions on local arrays, and how they run per shard: the flash kernel (Pallas
Triton on GPUs, interpreted on CPU), splash on TPUs, cuDNN and tokamax, each built by `local_kernel` for the target
platform as kernel(q, k, v, segment_ids[, sinks]) on whole sequences of one device's rows and heads.
attention.attention runs it inside shard_map over the batch and head mesh axes (`per_shard`); ulysses.py on the
heads an all-to-all gave the device. What each kernel supports and which is chosen: kernel_choice.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from maxtrain.config import chips
from maxtrain.parallel import sharding

PLATFORMS = ("cpu", "gpu", "tpu")


def canonical_platform(platform: str) -> str:
    """cpu, gpu or tpu; "cuda" and "rocm" (device platform names) are "gpu"."""
    name = {"cuda": "gpu", "rocm": "gpu"}.get(platform, platform)
    if name not in PLATFORMS:
        raise ValueError(f"unknown platform {platform!r}: attention runs on one of {', '.join(PLATFORMS)}")
    return name


def _local_devices(platform: str):
    """This machine's devices of `platform`, if it has any (the target is then this machine)."""
    try:
        return jax.devices(platform)
    except RuntimeError:
        return None


# Logical axes of the kernels' operands: split over the batch and head mesh axes, whole along the
# sequence and head_dim (a kernel needs every key of its rows, and whole heads).
_Q_AXES = ("batch", None, "heads", None)
_KV_AXES = ("batch", None, "kv_heads", None)
_SEGMENT_AXES = ("batch", None)


def per_shard(kernel, q, k, v, segment_ids, sinks=None):
    """kernel(q, k, v, segment_ids[, sinks]) on each device's batch rows and heads, inside shard_map.

    GSPMD cannot partition a Pallas or cuDNN custom call (it would gather the inputs, or, for a
    TPU kernel, refuse), so every kernel runs on local shards and its inputs are never gathered.
    """
    specs = sharding.active_specs([_Q_AXES, _KV_AXES])
    if specs is not None and specs[0][2] != specs[1][2]:
        q_spec, kv_spec = specs
        raise ValueError(
            f"logical_axis_rules put 'heads' on {q_spec[2]} but 'kv_heads' on {kv_spec[2]}: attention kernels "
            "need both on the same mesh axes, so that each device holds whole groups of query heads with "
            "their kv head. Map them to the same axes, or use attention=dot_product.")
    if sinks is not None:  # [N]: split over the heads like q
        return sharding.run_in_shards(kernel, (q, k, v, segment_ids, sinks),
                                      (_Q_AXES, _KV_AXES, _KV_AXES, _SEGMENT_AXES, ("heads",)), _Q_AXES)
    return sharding.run_in_shards(kernel, (q, k, v, segment_ids), (_Q_AXES, _KV_AXES, _KV_AXES, _SEGMENT_AXES),
                                  _Q_AXES)


def _cudnn_attention(q, k, v, segment_ids, *, causal, sliding_window, scale):
    # jax.nn.dot_product_attention takes BTNH and handles GQA (N a multiple of G) itself.
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]  # [B, 1, T, S]
    window = None
    if sliding_window > 0:
        window = (sliding_window - 1, 0 if causal else k.shape[1])
    q, k, v, scale, v_head_dim = pad_head_dims(q, k, v, scale)
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, is_causal=causal,
                                       local_window_size=window, implementation="cudnn")
    return out[..., :v_head_dim]


def pad_head_dims(q, k, v, scale):
    """(q, k, v, scale, Hv) with one head dim for a kernel that takes one: a value head dim Hv != H (MLA)
    zero-padded to H, or q and k zero-padded to Hv; q.k, the output's first Hv features and (with the
    scale fixed from H) the scores are unchanged."""
    h, hv = q.shape[-1], v.shape[-1]
    scale = h**-0.5 if scale is None else scale
    width = max(h, hv)

    def pad(x):
        return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    return pad(q), pad(k), pad(v), scale, hv


def local_kernel(implementation: str, platform: str | None, *, causal: bool = True, sliding_window: int = 0,
                 logits_soft_cap: float = 0.0, scale: float | None = None, block_q: int = 128, block_kv: int = 128,
                 interpret: bool | None = None):
    """The kernel `implementation` (flash, cudnn or tokamax) for `platform` as kernel(q, k, v, segment_ids,
    sinks=None) on whole local sequences: one device's batch rows and heads (attention() runs it per shard;
    ulysses.py on the heads an all-to-all gave the device)."""
    if implementation not in ("flash", "cudnn", "tokamax"):
        raise ValueError(f"unresolved attention implementation {implementation!r}")
    if platform is None:
        raise ValueError(f"attention={implementation} needs platform= (cpu, gpu or tpu: the target the step is "
                         "compiled for, e.g. the Runtime's backend)")
    platform = canonical_platform(platform)
    interpret = platform == "cpu" if interpret is None else interpret
    if implementation == "cudnn":
        return functools.partial(_cudnn_attention, causal=causal, sliding_window=sliding_window, scale=scale)
    if implementation == "tokamax":
        # deferred: the optional [gpu] extra's wrapper, imported only where tokamax was chosen
        from maxtrain.kernels import tokamax_attention  # pylint: disable=import-outside-toplevel

        return functools.partial(tokamax_attention.tokamax_attention, causal=causal, sliding_window=sliding_window,
                                 logits_soft_cap=logits_soft_cap, scale=scale,
                                 implementation="xla" if interpret else "mosaic")
    if platform == "tpu":
        # deferred: the Pallas kernels' imports (0.12 s flash, 0.16 s splash, measured) that dot_product runs never use
        from maxtrain.kernels import splash_attention  # pylint: disable=import-outside-toplevel

        def kernel(q, k, v, segment_ids, sinks=None):
            return splash_attention.splash_attention(
                q, k, v, segment_ids, causal=causal, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                scale=scale, block_q=block_q, block_kv=block_kv, interpret=interpret, sinks=sinks)
        return kernel
    # deferred: as splash_attention above
    from maxtrain.kernels import flash_attention  # pylint: disable=import-outside-toplevel

    devices = sharding.active_devices() or _local_devices(platform)
    shared_memory = chips.gpu_shared_memory(devices) if platform == "gpu" else flash_attention.DEFAULT_SHARED_MEMORY

    def kernel(q, k, v, segment_ids, sinks=None):
        return flash_attention.flash_attention(
            q, k, v, segment_ids, segment_ids, causal=causal, sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap, sm_scale=scale, block_q=block_q, block_k=block_kv,
            shared_memory=shared_memory, interpret=interpret, sinks=sinks)
    return kernel
