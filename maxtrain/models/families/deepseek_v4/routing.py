"""DeepSeek-V4's MoE: sqrtsoftplus scores, top-k or hash routing, clamped SwiGLU experts and a shared expert.

    s        = sqrt(softplus(x . W_gate^T))                            [.., E]
    top-k    idx = top_k(s + e_score_correction_bias)  (the bias picks, it does not weigh)
    hash     idx = tid2eid[token id]                   (a fixed table [V, k]; the gate still weighs)
    w        = s[idx] / (sum s[idx] + 1e-20) * routed_scaling_factor
    expert   e(x) = down_e(silu(min(g, L)) * clip(u, -L, L)),  [g | u] = gate_up_e x,  L = swiglu_limit
    out      = sum_k w_k e_{idx_k}(x) + shared(x)

`moe` runs the experts densely (every expert on every token, then the routing weights pick): the reference form,
for the parity tests. The family's layer (families/deepseek_v4/__init__.py) routes with `route` and runs the experts
through the shared MoE block (models/moe/, router "given", activation "clamped_silu"): dropless or capacity
dispatch, grouped matmuls, expert parallelism and FSDP."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sqrtsoftplus(x):
    return jnp.sqrt(jax.nn.softplus(x))


def topk_route(weight, bias, x, *, top_k, scaling):
    """x [N, D] -> (weights [N, k], indices [N, k])."""
    s = sqrtsoftplus(x.astype(jnp.float32) @ weight.astype(jnp.float32).T)
    _, idx = jax.lax.top_k(s + bias, top_k)
    return _weigh(s, idx, scaling), idx


def hash_route(weight, tid2eid, x, ids, *, scaling):
    """x [N, D], ids [N] -> (weights [N, k], indices [N, k]) with indices = tid2eid[ids]."""
    s = sqrtsoftplus(x.astype(jnp.float32) @ weight.astype(jnp.float32).T)
    idx = tid2eid[ids].astype(jnp.int32)
    return _weigh(s, idx, scaling), idx


def _weigh(s, idx, scaling):
    w = jnp.take_along_axis(s, idx, axis=-1)
    return w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20) * scaling


def clamped_swiglu(gate, up, limit):
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def experts_dense(gate_up, down, x, weights, idx, *, limit):
    """gate_up [E, 2I, D], down [E, D, I], x [N, D] -> [N, D]."""
    e, two_i, _ = gate_up.shape
    gu = jnp.einsum('nd,efd->nef', x, gate_up)
    h = clamped_swiglu(gu[..., :two_i // 2], gu[..., two_i // 2:], limit)
    y = jnp.einsum('nei,edi->ned', h, down)
    comb = jnp.sum(jax.nn.one_hot(idx, e, dtype=y.dtype) * weights[..., None].astype(y.dtype), axis=1)
    return jnp.einsum('ne,ned->nd', comb, y)


def shared_mlp(p, x, *, limit):
    g = x @ p['gate_proj.weight'].T
    u = x @ p['up_proj.weight'].T
    return clamped_swiglu(g, u, limit) @ p['down_proj.weight'].T


def route(p, flat, ids, *, is_hash, top_k, scaling):
    """p: the gate's weights by transformers' names under mlp.; flat [N, D], ids [N] -> (weights, indices) [N, k]."""
    if is_hash:
        return hash_route(p['gate.weight'], p['gate.tid2eid'], flat, ids, scaling=scaling)
    return topk_route(p['gate.weight'], p['gate.e_score_correction_bias'], flat, top_k=top_k, scaling=scaling)


def shared(p, flat, *, limit):
    """The shared expert over flat [N, D], p by transformers' names under mlp."""
    return shared_mlp({k[len('shared_experts.'):]: v for k, v in p.items() if k.startswith('shared_experts.')},
                      flat, limit=limit)


def moe(p, x, ids, *, is_hash, top_k, scaling, limit):
    """p: the block's weights by transformers' names under mlp.; x [B, T, D], ids [B, T] -> [B, T, D]."""
    b, t, d = x.shape
    flat = x.reshape(b * t, d)
    w, idx = route(p, flat, ids.reshape(-1), is_hash=is_hash, top_k=top_k, scaling=scaling)
    routed = experts_dense(p['experts.gate_up_proj'], p['experts.down_proj'], flat, w, idx, limit=limit)
    return (routed + shared(p, flat, limit=limit)).reshape(b, t, d)
