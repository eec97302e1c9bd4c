"""The lightning indexer's fused scores (kernels/index_scores.py) in interpret mode against the jnp reference
(models/families/deepseek/indexer.combine): the same [B, T, S] scores with T, S and E off the blocks' sizes and
heads that disagree in sign (the ReLU and the weights), and the same keys chosen through selected.chosen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.kernels import index_scores
from maxtrain.models.families.deepseek import indexer, selected


def _inputs(b, t, heads, e, s, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(keys[0], (b, t, heads, e)), jax.random.normal(keys[1], (b, t, heads)),
            jax.random.normal(keys[2], (b, s, e)))


@pytest.mark.parametrize("shape, blocks", [((2, 20, 3, 12, 20), (8, 16)), ((1, 64, 4, 16, 100), (16, 32))],
                         ids=["padded_t_s_e", "keys_beyond_queries"])
def test_scores_equal_the_reference(shape, blocks):
    q, w, k = _inputs(*shape)
    got = index_scores.index_scores(q, w, k, block_q=blocks[0], block_k=blocks[1], interpret=True)
    want = indexer.combine(q, w, k)
    assert got.shape == want.shape and got.dtype == jnp.float32
    assert float(jnp.mean(want == 0.0)) < 0.5  # the weighted ReLU sums are not mostly zero: a real comparison
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_chosen_keys_are_the_same_with_fused_scores():
    b, t, heads, e = 2, 64, 4, 8
    q, w, k = _inputs(b, t, heads, e, t, seed=1)
    segments = jnp.asarray([[1] * 20 + [2] * 36 + [0] * 8, [1] * 64])
    plain = selected.chosen(q, w, k, segments, topk=12, block=16)
    fused = selected.chosen(q, w, k, segments, topk=12, block=16, fused=True)
    np.testing.assert_array_equal(fused[1], plain[1])  # the same slots kept
    np.testing.assert_array_equal(jnp.sort(jnp.where(fused[1], fused[0], -1), axis=-1),
                                  jnp.sort(jnp.where(plain[1], plain[0], -1), axis=-1))
    assert int(jnp.sum(~plain[1])) > 0 and int(jnp.sum(plain[1])) > 0  # the causal edge and documents drop slots
