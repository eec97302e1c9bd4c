"""A Llama-family decoder as pure functions of (params, tokens, positions, segment_ids).

    embed -> L x [RMSNorm -> attention (RoPE, GQA) -> residual -> RMSNorm -> SwiGLU MLP -> residual]
          -> RMSNorm -> logits

Einsum letters, used everywhere in maxtrain:
    B batch, T query length, S key length, D embed (model width), N query heads, G kv heads,
    R = N // G query heads per kv head, H head dim, F mlp width, V vocab, L layers.

Parameters are a plain nested dict of arrays. `param_specs(config)` declares each parameter once
(shape, logical axes, initializer); sharded initialization, checkpoint checks and the Hugging Face
converter all read that declaration. The decoder layers are stacked on a leading "layers" axis and
run with `jax.lax.scan` (or unrolled, `scan_layers=false`) under `jax.checkpoint`.

Precision: parameters are stored in `weight_dtype` and cast to the compute dtype at use; RMSNorm,
softmax, logits and the loss are computed in float32.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from maxtrain import attention as attention_lib
from maxtrain import ops
from maxtrain.sharding import shard

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """One parameter: its shape, the logical name of each axis, and how to initialize it."""

    shape: tuple[int, ...]
    axes: tuple[str | None, ...]
    init: str  # "normal" (with stddev) or "ones"
    stddev: float = 0.0


def param_specs(config) -> Params:
    """The declaration of every parameter, as a nested dict of ParamSpec."""
    d, n, g, h = config.base_emb_dim, config.base_num_query_heads, config.base_num_kv_heads, config.head_dim
    f, v, num_layers = config.base_mlp_dim, config.vocab_size, config.base_num_decoder_layers

    def dense(shape, axes, fan_in):
        return ParamSpec((num_layers,) + shape, ("layers",) + axes, "normal", fan_in**-0.5)

    specs = {
        # A tied embedding is also the output projection, so it starts at the output's scale.
        "token_embedding": ParamSpec((v, d), ("vocab", "embed"), "normal",
                                     d**-0.5 if config.logits_via_embedding else 1.0),
        "layers": {
            "attn_norm": ParamSpec((num_layers, d), ("layers", "embed"), "ones"),
            "wq": dense((d, n, h), ("embed", "heads", "head_dim"), d),
            "wk": dense((d, g, h), ("embed", "kv_heads", "head_dim"), d),
            "wv": dense((d, g, h), ("embed", "kv_heads", "head_dim"), d),
            "wo": dense((n, h, d), ("heads", "head_dim", "embed"), n * h),
            "mlp_norm": ParamSpec((num_layers, d), ("layers", "embed"), "ones"),
            "w_gate": dense((d, f), ("embed", "mlp"), d),
            "w_up": dense((d, f), ("embed", "mlp"), d),
            "w_down": dense((f, d), ("mlp", "embed"), f),
        },
        "final_norm": ParamSpec((d,), ("embed",), "ones"),
    }
    if not config.logits_via_embedding:
        specs["output"] = ParamSpec((d, v), ("embed", "vocab"), "normal", d**-0.5)
    return specs


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def num_params(config) -> int:
    return sum(math.prod(s.shape) for s in jax.tree.leaves(param_specs(config), is_leaf=is_spec))


def init_params(config, key) -> Params:
    """Draws every parameter from its spec. Under jit with out_shardings, each is created sharded.

    Each parameter's key is `fold_in(key, i)` with i its position in the flattened (sorted) tree,
    so values do not depend on the mesh.
    """
    specs = param_specs(config)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    dtype = jnp.dtype(config.weight_dtype)
    out = []
    for i, spec in enumerate(leaves):
        if spec.init == "ones":
            out.append(jnp.ones(spec.shape, dtype))
        else:
            out.append((spec.stddev * jax.random.normal(jax.random.fold_in(key, i), spec.shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def rms_norm(x, scale, eps: float):
    """RMSNorm in float32; returns x's dtype."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (x32 * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotary position embedding on x [B, T, heads, H], rotating the two halves of H (as HF Llama)."""
    h = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))  # [H/2]
    angles = positions.astype(jnp.float32)[:, :, None, None] * inv_freq  # [B, T, 1, H/2]
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# Names of the projection (matmul) outputs inside a layer; `minimal` saves exactly these, which are
# the matmuls without batch dimensions (the attention score and value matmuls are recomputed).
PROJECTION_NAMES = ("query_proj", "key_proj", "value_proj", "out_proj", "mlp_gate", "mlp_up", "mlp_down")

REMAT_POLICIES: dict[str, Callable | None] = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "minimal": jax.checkpoint_policies.save_only_these_names(*PROJECTION_NAMES),
    "save_qkv_proj": jax.checkpoint_policies.save_only_these_names("query_proj", "key_proj", "value_proj"),
    "save_out_proj": jax.checkpoint_policies.save_only_these_names("out_proj"),
    "none": None,
}


def resolve_remat_policy(name: str, backend: str | None = None) -> str:
    """`autoselected` is `full` on every backend. On accelerators it needs the least memory; on CPU
    it was also measured the fastest (docs/performance.md): recomputing a layer's forward pass
    costs less there than writing every activation to the scan's stacked buffers and reading it
    back, so `none` saved memory traffic nowhere and cost up to 20% more CPU time per step."""
    del backend  # the same choice everywhere, for the reasons above
    return "full" if name == "autoselected" else name


def resolve_dtype(name: str, backend: str | None = None):
    """`autoselected` computes in float32 on CPU and bfloat16 elsewhere. On this project's CPU
    bfloat16 was measured no faster than float32 (docs/performance.md: XLA:CPU runs only some of
    the matmuls in bfloat16 and adds conversions around the rest), so exact float32 wins there."""
    if name == "autoselected":
        name = "float32" if (backend or jax.default_backend()) == "cpu" else "bfloat16"
    return jnp.dtype(name)


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Choices resolved for this backend once, at start-up, from the config."""

    dtype: Any
    attention: str
    remat_policy: str
    backend: str = "cpu"
    autoselected: tuple[str, ...] = ()  # which of dtype, attention, remat_policy the config left to us

    @classmethod
    def from_config(cls, config, backend: str | None = None) -> "Runtime":
        backend = backend or jax.default_backend()
        dtype = resolve_dtype(config.dtype, backend)
        auto = tuple(k for k in ("dtype", "attention", "remat_policy") if getattr(config, k) == "autoselected")
        return cls(dtype=dtype,
                   attention=attention_lib.resolve_implementation(config.attention, backend, dtype=dtype,
                                                                  head_dim=config.head_dim),
                   remat_policy=resolve_remat_policy(config.remat_policy, backend),
                   backend=backend, autoselected=auto)

    def describe(self) -> str:
        """`dtype float32 (autoselected for cpu)  attention ...  remat ...` for the start-up summary."""
        def tag(key):
            return f" (autoselected for {self.backend})" if key in self.autoselected else ""

        return (f"dtype {jnp.dtype(self.dtype).name}{tag('dtype')}  "
                f"attention {attention_lib.describe(self.attention, self.backend)}{tag('attention')}  "
                f"remat {self.remat_policy}{tag('remat_policy')}")


def _attention_block(x, p, positions, segment_ids, config, rt: Runtime, cache=None):
    """Returns (attention output [B, T, D], updated (k, v) cache or None)."""
    dt = rt.dtype
    q = ops.dense(x, p["wq"].astype(dt))       # "BTD,DNH->BTNH": queries per head
    k = ops.dense(x, p["wk"].astype(dt))       # "BTD,DGH->BTGH": keys per kv head
    v = ops.dense(x, p["wv"].astype(dt))       # "BTD,DGH->BTGH": values per kv head
    q = checkpoint_name(q, "query_proj")
    k = checkpoint_name(k, "key_proj")
    v = checkpoint_name(v, "value_proj")
    q = rope(q, positions, config.rope_max_timescale)
    k = rope(k, positions, config.rope_max_timescale)
    q = shard(q, ("batch", "length", "heads", "head_dim"))
    if cache is None:
        out = attention_lib.attention(q, k, v, segment_ids, implementation=rt.attention, platform=rt.backend,
                                      block_q=config.sa_block_q, block_kv=config.sa_block_kv)
        new_cache = None
    else:
        # Decoding: write this step's k, v at `index` and attend to every filled cache slot.
        cache_k, cache_v, index = cache
        cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), index, axis=1)
        cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), index, axis=1)
        slots = jnp.arange(cache_k.shape[1])
        mask = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]: causal over absolute positions
        out = attention_lib.dot_product_attention(q, cache_k.astype(dt), cache_v.astype(dt), mask)
        new_cache = (cache_k, cache_v)
    out = ops.dense(out, p["wo"].astype(dt), 2)  # "BTNH,NHD->BTD"
    return checkpoint_name(out, "out_proj"), new_cache


def _mlp_block(x, p, rt: Runtime):
    dt = rt.dtype
    gate = checkpoint_name(ops.dense(x, p["w_gate"].astype(dt)), "mlp_gate")  # "BTD,DF->BTF"
    up = checkpoint_name(ops.dense(x, p["w_up"].astype(dt)), "mlp_up")        # "BTD,DF->BTF"
    hidden = shard(jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
    return checkpoint_name(ops.dense(hidden, p["w_down"].astype(dt)), "mlp_down")  # "BTF,FD->BTD"


def decoder_layer(x, p, positions, segment_ids, config, rt: Runtime, cache=None):
    """One pre-norm decoder layer. x: [B, T, D] in the compute dtype."""
    eps = config.normalization_layer_epsilon
    attn, new_cache = _attention_block(rms_norm(x, p["attn_norm"], eps), p, positions, segment_ids,
                                       config, rt, cache)
    x = shard(x + attn, ("batch", "length", "embed"))
    x = x + _mlp_block(rms_norm(x, p["mlp_norm"], eps), p, rt)
    return shard(x, ("batch", "length", "embed")), new_cache


def _layer_fn(config, rt: Runtime):
    def layer(x, p, positions, segment_ids):
        return decoder_layer(x, p, positions, segment_ids, config, rt)[0]

    if rt.remat_policy == "none":
        return layer
    return jax.checkpoint(layer, policy=REMAT_POLICIES[rt.remat_policy], prevent_cse=not config.scan_layers)


def _embed(params, tokens, rt: Runtime):
    x = jnp.take(params["token_embedding"], tokens, axis=0).astype(rt.dtype)
    return shard(x, ("batch", "length", "embed"))


def _logits(params, x, config, rt: Runtime):
    """float32 logits [B, T, V] from the final hidden states."""
    x = rms_norm(x, params["final_norm"], config.normalization_layer_epsilon)
    if config.logits_via_embedding:
        w = params["token_embedding"].astype(rt.dtype).T      # "BTD,VD->BTV"
    else:
        w = params["output"].astype(rt.dtype)                 # "BTD,DV->BTV"
    logits = ops.dense(x, w, 1, jnp.float32)
    return shard(logits, ("batch", "length", "vocab"))


def forward(params: Params, tokens, positions, segment_ids, config, rt: Runtime):
    """Logits [B, T, V] (float32) for tokens [B, T]; positions restart at 0 in each packed document."""
    x = _embed(params, tokens, rt)
    layer = _layer_fn(config, rt)
    if config.scan_layers:
        x, _ = jax.lax.scan(lambda carry, p: (layer(carry, p, positions, segment_ids), None), x, params["layers"])
    else:
        for i in range(config.base_num_decoder_layers):
            x = layer(x, jax.tree.map(lambda a, i=i: a[i], params["layers"]), positions, segment_ids)
    return _logits(params, x, config, rt)


def loss_fn(params: Params, batch: dict, config, rt: Runtime):
    """(sum of per-token cross-entropy x weight, sum of weights), both float32.

    Returning sums, not a mean, lets gradient accumulation and multi-host eval weight every real
    token equally; padding has weight 0.
    """
    logits = forward(params, batch["inputs"], batch["positions"], batch["segment_ids"], config, rt)
    weights = batch["loss_weights"].astype(jnp.float32)
    return ops.cross_entropy(logits, batch["targets"], weights), jnp.sum(weights)


# --------------------------------------------------------------------------------------------
# Decoding with a KV cache
# --------------------------------------------------------------------------------------------


def init_cache(config, batch_size: int, max_length: int, dtype) -> dict:
    """An empty KV cache: k and v [L, B, S, G, H]."""
    shape = (config.base_num_decoder_layers, batch_size, max_length, config.base_num_kv_heads, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def forward_with_cache(params: Params, tokens, positions, cache: dict, index, config, rt: Runtime):
    """Runs tokens [B, T] at cache slots [index, index + T); returns (logits [B, T, V], new cache).

    positions must equal index + arange(T) (one sequence per row, no packing while decoding).
    """
    x = _embed(params, tokens, rt)
    segment_ids = jnp.ones_like(tokens)

    def step(carry, layer_inputs):
        p, ck, cv = layer_inputs
        carry, (ck, cv) = decoder_layer(carry, p, positions, segment_ids, config, rt, cache=(ck, cv, index))
        return carry, (ck, cv)

    x, (k, v) = jax.lax.scan(step, x, (params["layers"], cache["k"], cache["v"]))
    return _logits(params, x, config, rt), {"k": k, "v": v}
