"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2; index_n_heads > 0): which keys each query
attends to.

    q_I = W_Iq q_latent              [B, T, N_I, H_I]   (q_latent: MLA's normed low-rank query, rmsnorm(W_qa x))
    k_I = layernorm(W_Ik x)          [B, S, H_I]        (one key for all indexer heads, with a bias)
          RoPE on the first qk_rope_head_dim features of each, by halves (DeepSeek-V3.2; MLA's own RoPE
          interleaves), or on interleaved pairs with index_rope_interleave (GLM-5)
    w   = W_Iw x / sqrt(N_I)         [B, T, N_I]
    I[t, s] = sum_n w[t, n] relu(q_I[t, n] . k_I[s] / sqrt(H_I))          (float32)

Each query keeps the index_topk keys of highest I among those the causal mask and its document let it see;
attention then runs over those alone (MLA's softmax under that mask). Where a query sees index_topk keys or fewer,
it keeps them all: at a length <= index_topk the model is MLA with dense attention, and the family skips the
indexer. The selection is a top-k, with no gradient: the language-model loss does not train the indexer (as
Hugging Face's forward, under no_grad). DeepSeek trains it apart, towards the attention's distribution
(indexer_training, models/families/deepseek/indexer_training.py): `kl_to_attention` with the indexer's weights `trained`
and its inputs x and q_latent always detached. Ties at the k-th score go to the earlier keys (top_k's order), where
transformers' topk keeps an arbitrary k of them: a score is exactly 0 where every indexer head's relu is 0, so a
query whose head weights are all negative (its scores all <= 0) can tie many keys at 0; with weights of both signs
a tie needs all heads' relus at 0 at once. Training and scoring beyond index_topk tokens read only the chosen keys
(selected.py); decoding masks the cache's slots (`keys_kept`), choosing the same keys.

Memory: `scores` holds the per-head scores [B, T, index_n_heads, S] in float32 (the dense warm-up, the sparse stage
at or below index_topk tokens, and decoding, where T is one token); selected.py computes them a block of queries at
a time, and the sparse stage's KL there over each query's selected keys alone (`selected_scores`, `kl_per_query`).

Hugging Face (and DeepSeek's reference) rotate the indexer's queries and keys with a Hadamard transform and score
them in float8 for speed; the transform is orthogonal (q . k unchanged), so this bf16/float32 form is the same
selection up to rounding, as transformers' own.

Precision of the choice (indexer_dtype, `combine`'s dtype): float32 (the default, the numbers above); bfloat16 (q and
k rounded to bfloat16, the dots accumulated in float32); float8 (DeepSeek-V3.2's: q per query head and k per key
scaled by its own absmax / 448 (`row_scales`), rounded to e4m3, the dots accumulated in float32 and multiplied back
by both scales, then the ReLU and the head weights in float32). Only the choice (the top-k, which takes no gradient)
is made at that precision: the KL that trains the indexer (indexer_training) scores the chosen keys in float32 with
its gradient, so nothing needs a straight-through estimator (tests/models/test_deepseek_indexer_dtype.py).

Einsum letters: as blocks.py, and Q the query latent rank, I the indexer heads, E their width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxtrain.models import attention as attention_lib
from maxtrain.models import fp8
from maxtrain.models import rope as rope_lib
from maxtrain.models.params import ParamSpec, dense


def specs(config) -> dict[str, ParamSpec]:
    d, q, n, e = config.base_emb_dim, config.q_lora_rank, config.index_n_heads, config.index_head_dim
    return {"index_wq": dense((q, n, e), ("embed", None, None), q), "index_wk": dense((d, e), ("embed", None), d),
            "index_k_norm": ParamSpec((e,), (None,), "ones"), "index_k_norm_bias": ParamSpec((e,), (None,), "zeros"),
            "index_weights": dense((d, n), ("embed", None), d)}


def _layer_norm(x, scale, bias, eps: float = 1e-6):
    """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, in float32 (Hugging Face's nn.LayerNorm)."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32) + bias.astype(jnp.float32)


_NAMES = ("index_wq", "index_wk", "index_k_norm", "index_k_norm_bias", "index_weights")


def _frozen(p):
    return jax.lax.stop_gradient({k: p[k] for k in _NAMES})


def _rope(x, cos, sin, interleave: bool):
    """RoPE on the first 2 x cos.shape[-1] features of x [B, T, heads, E]: by halves, or on interleaved pairs."""
    return rope_lib.apply_interleaved(x, cos, sin) if interleave else rope_lib.apply(x, cos, sin)


def _weights(p, trained: bool):
    """The indexer's weights: with their gradient when the indexer is trained (indexer_training), else without."""
    return {k: p[k] for k in _NAMES} if trained else _frozen(p)


def keys(x, p, rope, interleave: bool = False, trained: bool = False) -> jax.Array:
    """k_I [B, S, E] float32 of the tokens x [B, S, D] (what decoding caches); no gradient reaches x, nor the
    indexer's weights unless `trained`."""
    p, cos, sin = _weights(p, trained), *rope
    k = _layer_norm(jnp.einsum("BTD,DE->BTE", jax.lax.stop_gradient(x).astype(jnp.float32),
                               p["index_wk"].astype(jnp.float32)), p["index_k_norm"], p["index_k_norm_bias"])
    return _rope(k[:, :, None], cos, sin, interleave)[:, :, 0]


def queries(x, q_latent, p, rope, interleave: bool = False, trained: bool = False) -> tuple[jax.Array, jax.Array]:
    """(q_I [B, T, I, E], w [B, T, I]) float32 of the queries' tokens x [B, T, D] (q_latent [B, T, Q]); no gradient
    reaches x and q_latent, nor the indexer's weights unless `trained`."""
    x, q_latent, p, (cos, sin) = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent), _weights(p, trained), rope
    f32 = jnp.float32
    q = _rope(jnp.einsum("BTQ,QIE->BTIE", q_latent.astype(f32), p["index_wq"].astype(f32)), cos, sin, interleave)
    w = jnp.einsum("BTD,DI->BTI", x.astype(f32), p["index_weights"].astype(f32)) * q.shape[2] ** -0.5
    return q, w


def scores(x, q_latent, k, p, rope, interleave: bool = False, trained: bool = False,
           dtype: str = "float32") -> jax.Array:
    """I [B, T, S] float32 of the queries' tokens x [B, T, D] (q_latent [B, T, Q]) against indexer keys k [B, S, E];
    no gradient reaches x and q_latent, nor the indexer's weights unless `trained`. dtype: `combine`'s."""
    return combine(*queries(x, q_latent, p, rope, interleave, trained), k, dtype)


DTYPES = ("float32", "bfloat16", "float8")  # indexer_dtype: the precision of the scores that choose the keys


def combine(q, w, k, dtype: str = "float32") -> jax.Array:
    """I [B, T, S] = sum_n w[t, n] relu(q[t, n] . k[s] / sqrt(E)) of queries q [B, T, I, E], head weights w [B, T, I]
    and keys k [B, S, E] (`queries`, `keys`), float32; the dots q . k at `dtype` (indexer_dtype: module docstring),
    accumulated in float32."""
    if dtype == "float32":
        per_head = jax.nn.relu(jnp.einsum("BTIE,BSE->BTIS", q, k) * q.shape[3] ** -0.5)
    else:
        per_head = jax.nn.relu(low_precision_dots(q, k, dtype) * q.shape[3] ** -0.5)
    return jnp.einsum("BTI,BTIS->BTS", w, per_head)


def row_scales(a) -> jax.Array:
    """a's absmax over its last axis / 448 (e4m3's largest), float32, keeping that axis (size 1); 1 where it is 0 or
    not finite (a zero row): the scale that maps each row's largest magnitude to the top of e4m3."""
    s = jnp.max(jnp.abs(a.astype(jnp.float32)), axis=-1, keepdims=True) / fp8.LARGEST[fp8.E4M3]
    return jnp.where((s > 0) & jnp.isfinite(s), s, jnp.float32(1.0))


def low_precision_dots(q, k, dtype: str) -> jax.Array:
    """q . k [B, T, I, S] float32 of q [B, T, I, E] and k [B, S, E] with bfloat16 or float8 (e4m3, per-row scales:
    `row_scales` of each query head's row and each key's) operands, accumulated in float32 (the float8 products
    multiplied back by both rows' scales)."""
    if dtype == "bfloat16":
        return jnp.einsum("BTIE,BSE->BTIS", q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)
    if dtype != "float8":
        raise ValueError(f"indexer_dtype={dtype!r} is not one of {', '.join(DTYPES)}; set one of them")
    s_q, s_k = row_scales(q), row_scales(k)                                      # [B, T, I, 1], [B, S, 1]
    dots = jnp.einsum("BTIE,BSE->BTIS", fp8.quantize(q, s_q, fp8.E4M3), fp8.quantize(k, s_k, fp8.E4M3),
                      preferred_element_type=jnp.float32)
    return dots * s_q * s_k[:, None, None, :, 0]


def top(index, visible, topk: int) -> jax.Array:
    """[B, T, S] bool: of the visible keys, each query's topk of highest index (all of them where it sees fewer):
    top_k's choice, ties at the k-th score going to the earlier key, as selected.attention chooses."""
    idx, _ = choose(index, visible, topk)                                            # [B, T, k]
    mark = jax.vmap(jax.vmap(lambda row, at: row.at[at].set(True)))                # per query: its k keys
    return visible & mark(jnp.zeros(index.shape, bool), idx)


def choose(index, visible, topk: int) -> tuple[jax.Array, jax.Array]:
    """(idx [B, T, K] int32, kept [B, T, K] bool), K = min(topk, S): each query's keys of highest index [B, T, S]
    among the visible ones, as `top` chooses them, and which are real (a query seeing fewer than K: the rest not)."""
    best, idx = jax.lax.top_k(jnp.where(visible, index, -jnp.inf), min(topk, index.shape[-1]))
    return idx, best > -jnp.inf


def keys_kept(x, q_latent, rope, visible, *, p, segment_ids, topk: int, cached_keys=None,
              interleave: bool = False, dtype: str = "float32") -> jax.Array:
    """[B, T, S] bool: the keys each query attends to. Training and scoring (visible None): among the causal mask's
    and its document's, scored against the tokens' own indexer keys. Decoding: among `visible` (the cache slots'
    mask), scored against `cached_keys` [B, S, E] (the layer's indexer-key cache, this step's written).
    interleave: the indexer's RoPE on interleaved pairs (index_rope_interleave); dtype: the scores' precision
    (indexer_dtype, `combine`)."""
    if visible is None:
        visible = attention_lib.make_attention_mask(segment_ids, segment_ids, causal=True)
        cached_keys = keys(x, p, rope, interleave)
    return top(scores(x, q_latent, cached_keys, p, rope, interleave, dtype=dtype), visible, topk)


def kl_to_attention(target, index, mask, segment_ids) -> jax.Array:
    """DeepSeek-V3.2's indexer loss: the mean over real query tokens (segment id > 0) of
    KL(target_t || softmax(I_t)) over the keys `mask` [B, T, S] lets query t use (the causal mask in the dense
    warm-up; the kept keys in the sparse stage), target [B, T, S] the attention's head-averaged distribution over
    them (no gradient) and I [B, T, S] the indexer's scores. Scalar float32. selected.py computes the same over each
    query's K selected keys (`kl_per_query` on [B, T, K] slots, `selected_scores`), block by block."""
    real = (segment_ids > 0).astype(jnp.float32)
    return jnp.sum(kl_per_query(target, index, mask) * real) / jnp.maximum(jnp.sum(real), 1.0)


def kl_per_query(target, index, mask) -> jax.Array:
    """[B, T] float32: KL(target_t || softmax(I_t)) over the keys (last axis: all S, or a query's K selected slots)
    `mask` keeps, target the attention's head-averaged probabilities there and I the indexer's scores."""
    log_q = jax.nn.log_softmax(jnp.where(mask, index, -jnp.inf), axis=-1)
    log_q = jnp.where(mask, log_q, 0.0)  # no -inf (nor NaN in the gradient) outside the mask
    log_p = jnp.log(jnp.where(target > 0, target, 1.0))
    return jnp.sum(jnp.where(mask & (target > 0), target * (log_p - log_q), 0.0), axis=-1)


def selected_scores(q, w, k, idx) -> jax.Array:
    """I [B, T, K] float32 of queries q [B, T, I, E] (head weights w [B, T, I]) against the keys idx [B, T, K] picks
    from k [B, S, E]: `combine`'s scores at those keys alone, their gradient scatter-added into k's picked rows."""
    k_sel = jax.vmap(lambda rows, at: rows[at])(k, idx)                                  # [B, T, K, E]
    per_head = jax.nn.relu(jnp.einsum("BTIE,BTKE->BTIK", q, k_sel) * q.shape[3] ** -0.5)
    return jnp.einsum("BTI,BTIK->BTK", w, per_head)
