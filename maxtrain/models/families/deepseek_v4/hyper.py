"""DeepSeek-V4's manifold-constrained hyper-connections (mHC): the residual is hc_mult streams [B, T, N, D].

Per block (attention or MoE), from the streams X [B, T, N, D]:

    f            = rms(flatten(X)) . fn^T                  fn [(2 + N) N, N D]; rms unweighted, eps = rms_norm_eps
    pre          = sigmoid(f_pre  * s0 + b_pre) + hc_eps    [B, T, N]
    post         = 2 sigmoid(f_post * s1 + b_post)          [B, T, N]
    comb         = softmax_rows(f_comb * s2 + b_comb) + hc_eps, then Sinkhorn: columns normalized once, then
                   (rows, columns) hc_sinkhorn_iters - 1 times, each x / (sum + hc_eps)      [B, T, N, N]
    block input  = sum_n pre[n] X[n]
    X'[k]        = post[k] * block_out + sum_j comb[j, k] X[j]

The hyper head collapses the streams before the final norm: sum_n (sigmoid(f . s + b) + eps)[n] X[n], f from its
own hc_fn [N, N D]. Everything here runs in float32. The Sinkhorn loop is a lax.fori_loop of static length, so
the layer traces once under scan and remat (its backward recomputes it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unweighted_rms(x, eps):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def sinkhorn(comb, iters, eps):
    """comb [.., N, N] positive; columns normalized first, then iters - 1 rounds of rows then columns."""
    comb = comb / (jnp.sum(comb, axis=-2, keepdims=True) + eps)

    def body(_, c):
        c = c / (jnp.sum(c, axis=-1, keepdims=True) + eps)
        return c / (jnp.sum(c, axis=-2, keepdims=True) + eps)

    return jax.lax.fori_loop(0, max(iters - 1, 0), body, comb)


def hc_weights(fn, base, scale, streams, *, iters, hc_eps, rms_eps):
    """streams [B, T, N, D] -> (post [B, T, N], comb [B, T, N, N], collapsed [B, T, D])."""
    b, t, n, d = streams.shape
    f = unweighted_rms(streams.reshape(b, t, n * d), rms_eps) @ fn.astype(jnp.float32).T
    f_pre, f_post, f_comb = f[..., :n], f[..., n:2 * n], f[..., 2 * n:].reshape(b, t, n, n)
    pre = jax.nn.sigmoid(f_pre * scale[0] + base[:n]) + hc_eps
    post = 2.0 * jax.nn.sigmoid(f_post * scale[1] + base[n:2 * n])
    comb = jax.nn.softmax(f_comb * scale[2] + base[2 * n:].reshape(n, n), axis=-1) + hc_eps
    comb = sinkhorn(comb, iters, hc_eps)
    collapsed = jnp.einsum('btn,btnd->btd', pre, streams.astype(jnp.float32)).astype(streams.dtype)
    return post, comb, collapsed


def hc_merge(post, comb, block_out, streams):
    """X'[k] = post[k] * block_out + sum_j comb[j, k] X[j]."""
    dt = streams.dtype
    return (post.astype(dt)[..., None] * block_out[..., None, :]
            + jnp.einsum('btjk,btjd->btkd', comb.astype(dt), streams))


def hyper_head(hc_fn, hc_base, hc_scale, streams, *, hc_eps, rms_eps):
    """streams [B, T, N, D] -> [B, T, D]."""
    b, t, n, d = streams.shape
    f = unweighted_rms(streams.reshape(b, t, n * d), rms_eps) @ hc_fn.astype(jnp.float32).T
    pre = jax.nn.sigmoid(f * hc_scale[0] + hc_base) + hc_eps
    return jnp.einsum('btn,btnd->btd', pre, streams.astype(jnp.float32)).astype(streams.dtype)
