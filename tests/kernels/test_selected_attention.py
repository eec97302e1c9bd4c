"""The selected-key attention kernel (kernels/selected_attention.py) in interpret mode against DeepSeek-V3.2's
plain-jnp form (models/families/deepseek/selected.py): the same o_c and the same gradients (q_nope, q_rope, c, k_rope
and W_kvb's key half through the absorbed queries) for the keys the indexer chose, with two packed documents and
padding in one row, queries that see fewer than K keys (the causal edge, a document's first tokens), K not a multiple
of the key block and heads not a multiple of the head block. Tolerances: float32 1e-5 (values) and 1e-4 relative /
1e-5 absolute (gradients), as the reference's own tests; bfloat16 operands against the float32 reference 3e-2."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.kernels import selected_attention
from maxtrain.models import attention as attention_lib
from maxtrain.models.families.deepseek import indexer, selected

B, T, N, HN, HR, C, I, E = 2, 16, 3, 8, 4, 10, 2, 8
TOPK = 6
SCALE = (HN + HR) ** -0.5
# two documents then padding (segment 0) in the first row; one document in the second
SEGMENTS = jnp.asarray([[1] * 5 + [2] * 8 + [0] * 3, [1] * 16])


def _inputs(seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 8)
    normal = lambda key, *shape: jax.random.normal(key, shape, jnp.float32)  # noqa: E731
    return dict(q_nope=normal(keys[0], B, T, N, HN), q_rope=normal(keys[1], B, T, N, HR), c=normal(keys[2], B, T, C),
                k_rope=normal(keys[3], B, T, HR), w_k=normal(keys[4], C, N, HN) * C**-0.5,
                index_q=normal(keys[5], B, T, I, E), index_w=normal(keys[6], B, T, I), index_k=normal(keys[7], B, T, E))


def _choice(x):
    """(idx, kept) [B, T, K]: the indexer's top-k under the causal and document masks, as selected.run picks."""
    visible = attention_lib.make_attention_mask(SEGMENTS, SEGMENTS, causal=True)
    index = jnp.where(visible, indexer.combine(x["index_q"], x["index_w"], x["index_k"]), -jnp.inf)
    top, idx = jax.lax.top_k(jax.lax.stop_gradient(index), TOPK)
    return idx, top > -jnp.inf


def _reference(x):
    return selected.attention(x["q_nope"], x["q_rope"], x["c"], x["k_rope"], x["w_k"], x["index_q"], x["index_w"],
                              x["index_k"], SEGMENTS, topk=TOPK, scale=SCALE)


def _kernel(x, dtype=jnp.float32, **tiles):
    idx, kept = _choice(x)
    q_c = jnp.einsum("BTNH,CNH->BTNC", x["q_nope"], x["w_k"])
    cast = lambda a: a.astype(dtype)  # noqa: E731
    return selected_attention.selected_attention(cast(q_c), cast(x["q_rope"]), cast(x["c"]), cast(x["k_rope"]), idx,
                                                 kept, scale=SCALE, interpret=True, **tiles)


def test_the_choice_drops_keys_and_reaches_the_causal_edge():
    _, kept = _choice(_inputs())
    counts = jnp.sum(kept, axis=-1)
    assert int(counts[0, 0]) == 1 and int(counts[0, 5]) == 1  # the first tokens of both documents: one key
    assert int(jnp.sum(counts == TOPK)) > 10 and int(jnp.sum(counts < TOPK)) > 5


@pytest.mark.parametrize("block_heads, block_k", [(2, 4), (16, 64)], ids=["tiles_2x4", "tiles_16x64"])
def test_values_equal_the_reference(block_heads, block_k):
    """(2, 4): three heads in two blocks (one padded), six keys in two blocks (two slots padded); (16, 64): one
    block of each (the key block shrinks to 8)."""
    x = _inputs()
    np.testing.assert_allclose(_kernel(x, block_heads=block_heads, block_k=block_k), _reference(x), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "rows_and_scatter"])
@pytest.mark.parametrize("block_heads, block_k", [(2, 4), (16, 64)], ids=["tiles_2x4", "tiles_16x64"])
def test_gradients_equal_the_reference(block_heads, block_k, atomic):
    """Both backwards: one kernel adding each key's gradient rows into dc and dk_r (atomically on a GPU; heads in two
    blocks add to the same rows), and the rows written per chunk of queries then scatter-added."""
    x = _inputs()
    cotangent = jax.random.normal(jax.random.key(7), (B, T, N, C))
    params = {k: x[k] for k in ("q_nope", "q_rope", "c", "k_rope", "w_k")}

    def loss(fn):
        return lambda p: jnp.sum(fn({**x, **p}) * cotangent)

    want = jax.grad(loss(_reference))(params)
    got = jax.grad(loss(lambda y: _kernel(y, block_heads=block_heads, block_k=block_k, bwd_query_chunk=4,
                                          atomic=atomic)))(params)
    for name in params:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-5, err_msg=name)


def test_max_logits_equal_the_reference():
    x = _inputs()
    idx, kept = _choice(x)
    q_c = jnp.einsum("BTNH,CNH->BTNC", x["q_nope"], x["w_k"])
    _, got = selected_attention.selected_attention(q_c, x["q_rope"], x["c"], x["k_rope"], idx, kept, scale=SCALE,
                                                   interpret=True, with_max_logits=True, block_heads=2, block_k=4)
    _, want = selected.attention(x["q_nope"], x["q_rope"], x["c"], x["k_rope"], x["w_k"], x["index_q"],
                                 x["index_w"], x["index_k"], SEGMENTS, topk=TOPK, scale=SCALE, with_max_logits=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_another_documents_keys_change_nothing():
    """The second document's queries (and their gradients) do not move when the first document's keys do."""
    x = _inputs()
    second = slice(5, 13)
    moved = {**x, "c": x["c"].at[0, :5].add(3.0), "k_rope": x["k_rope"].at[0, :5].add(-2.0)}
    np.testing.assert_array_equal(_kernel(moved, block_k=4)[0, second], _kernel(x, block_k=4)[0, second])

    def grad_c(y):
        return jax.grad(lambda c: jnp.sum(_kernel({**y, "c": c}, block_k=4)[0, second]))(y["c"])
    assert float(jnp.max(jnp.abs(grad_c(x)[0, :5]))) == 0.0


def test_bfloat16_is_close_to_the_float32_reference():
    x = _inputs()
    got = _kernel(x, jnp.bfloat16, block_heads=2, block_k=4)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), _reference(x), rtol=3e-2, atol=3e-2)
    dc = jax.grad(lambda c: jnp.sum(_kernel({**x, "c": c}, jnp.bfloat16, block_heads=2, block_k=4)
                                    .astype(jnp.float32)))(x["c"])
    want = jax.grad(lambda c: jnp.sum(_reference({**x, "c": c})))(x["c"])
    np.testing.assert_allclose(dc, want, rtol=3e-2, atol=3e-2 * float(jnp.max(jnp.abs(want))))


def test_duplicate_keys_of_one_query_add_up():
    """A query that lists a key twice attends to it twice, and its gradient rows add up (the atomic backward's adds,
    and in interpret mode their scatter-add, sum duplicates: top_k never chooses one twice, a caller may)."""
    x = _inputs()
    idx, kept = _choice(x)
    idx = idx.at[:, 8:, 1].set(idx[:, 8:, 0])  # from query 8 on, slot 1 repeats slot 0's key
    q_c = jnp.einsum("BTNH,CNH->BTNC", x["q_nope"], x["w_k"])
    cotangent = jax.random.normal(jax.random.key(3), (B, T, N, C))

    def loss(atomic, q_c, c):
        out = selected_attention.selected_attention(q_c, x["q_rope"], c, x["k_rope"], idx, kept, scale=SCALE,
                                                    interpret=True, block_heads=2, block_k=4, atomic=atomic)
        return jnp.sum(out * cotangent)
    want = jax.grad(functools.partial(loss, False), argnums=(0, 1))(q_c, x["c"])
    got = jax.grad(functools.partial(loss, True), argnums=(0, 1))(q_c, x["c"])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_a_query_with_no_kept_key_gives_zero_and_no_gradient():
    """Slots not kept are ignored even where every slot of a query is (output 0, as selected.py's masked softmax)."""
    x = _inputs()
    idx, kept = _choice(x)
    kept = kept.at[1, 3].set(False)
    q_c = jnp.einsum("BTNH,CNH->BTNC", x["q_nope"], x["w_k"])

    def run(q_c, c):
        return selected_attention.selected_attention(q_c, x["q_rope"], c, x["k_rope"], idx, kept, scale=SCALE,
                                                     interpret=True, block_heads=2, block_k=4)
    out = run(q_c, x["c"])
    assert float(jnp.max(jnp.abs(out[1, 3]))) == 0.0 and float(jnp.max(jnp.abs(out[1, 4]))) > 0.0
    dq_c, dc = jax.grad(lambda q, c: jnp.sum(run(q, c)[1, 3]), argnums=(0, 1))(q_c, x["c"])
    assert float(jnp.max(jnp.abs(dq_c))) == 0.0 and float(jnp.max(jnp.abs(dc))) == 0.0
