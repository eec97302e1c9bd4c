"""The vocab-tiled loss (num_vocab_tiling): the same loss and gradients as the full logits, and far less memory."""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML, TINY
from maxtrain import builder, models, ops
from maxtrain.config import ConfigError, load_config, with_overrides


def loss_and_grads(*overrides):
    cfg = load_config([BASE_YML, *with_overrides(TINY, "vocab_size=1024", *overrides)])
    rt = models.Runtime.from_config(cfg)
    params = models.init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (2, 33)).astype(np.int32)
    seg = np.ones((2, 32), np.int32)
    seg[:, 20:] = 2
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": seg,
             "positions": np.where(seg == 1, np.arange(32), np.arange(32) - 20).astype(np.int32),
             "loss_weights": (rng.random((2, 32)) > 0.2).astype(np.float32)}
    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(lambda p: models.loss_fn(p, batch, cfg, rt)[0]))(params)


# float32 with full-precision matmuls: tiling changes only the order of some sums. Tolerance: the loss to
# 1e-6 relative; each gradient to 1e-5 relative or 1e-6 of its largest entry (rounding noise of the sums).
@pytest.mark.parametrize("model", [[], ["logits_via_embedding=true"],
                                   ["decoder_block=gemma2", "final_logits_soft_cap=3.0", "sliding_window_size=8"]],
                         ids=["untied", "tied", "gemma2-softcap"])
@pytest.mark.parametrize("tiles", [4, 32])
def test_tiled_loss_and_gradients_equal_the_untiled_ones(model, tiles):
    loss, grads = loss_and_grads(*model)
    tiled_loss, tiled_grads = loss_and_grads(*model, f"num_vocab_tiling={tiles}")
    assert float(tiled_loss) == pytest.approx(float(loss), rel=1e-6)
    for path, g in jax.tree_util.tree_flatten_with_path(grads)[0]:
        t = jax.tree_util.tree_map(lambda x: x, tiled_grads)
        for key in path:
            t = t[key.key]
        np.testing.assert_allclose(np.asarray(t), np.asarray(g), rtol=1e-5, atol=1e-6 * float(np.abs(g).max()),
                                   err_msg=jax.tree_util.keystr(path))


def test_tiling_must_divide_the_sequence():
    with pytest.raises(ConfigError, match="num_vocab_tiling=3 must divide max_target_length=32"):
        load_config([BASE_YML, *TINY, "num_vocab_tiling=3"])


def temporaries(*overrides) -> int:
    cfg = load_config([BASE_YML, "model_name=gemma2-2b", "base_emb_dim=64", "base_mlp_dim=128", "head_dim=32",
                       "base_num_query_heads=2", "base_num_kv_heads=1", "base_num_decoder_layers=2",
                       "max_target_length=4096", "per_device_batch_size=1", "dtype=bfloat16", "attention=dot_product",
                       "ici_fsdp_parallelism=1", *overrides])
    return builder.build(cfg, devices=jax.devices()[:1]).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_a_256k_vocabulary_at_4096_tokens_needs_a_fraction_of_the_temporaries():
    """Gemma 2's 256,000-token vocabulary at sequence 4096 (its layers shrunk so that the logits dominate):
    the compiled step's temporaries with 16 tiles are at least 4x smaller than untiled (compile only)."""
    untiled, tiled = temporaries(), temporaries("num_vocab_tiling=16")
    print(f"temporaries: untiled {untiled / 2**30:.2f} GiB, 16 tiles {tiled / 2**30:.2f} GiB ({untiled / tiled:.1f}x)")
    assert untiled >= 4 * tiled


def head_loss_and_grads(tiles: int, dtype, scale: float):
    """scale x the loss of a plain output projection and its gradients (tiled when tiles > 1)."""
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k1, (2, 16, 8)).astype(dtype)
    head = {"w": (0.5 * jax.random.normal(k2, (8, 64))).astype(dtype)}
    targets = jax.random.randint(k3, (2, 16), 0, 64)
    weights = jnp.ones((2, 16)).at[1, 3:].set(0.5)

    def logits_fn(h, xc):
        return ops.dense(xc, h["w"], out_dtype=jnp.float32)

    def loss(h, x):
        if tiles == 1:
            return scale * ops.cross_entropy(logits_fn(h, x), targets, weights)
        return scale * ops.tiled_cross_entropy(logits_fn, h, x, targets, weights, tiles)

    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(head, x), jax.make_jaxpr(jax.grad(loss))(head, x)


# The tiled loss computes its gradients in the forward pass for an incoming gradient of 1 and scales them
# in the backward pass; float16 (whose unscaled gradients could underflow) recomputes the logits in the
# backward pass instead. Both must give the untiled gradients for an incoming gradient other than 1.
@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 1e-5), (jnp.bfloat16, 2e-2), (jnp.float16, 2e-3)])
def test_tiled_head_gradients_for_a_scaled_loss(dtype, rtol):
    (loss, grads), _ = head_loss_and_grads(1, dtype, 64.0)
    (tiled_loss, tiled_grads), _ = head_loss_and_grads(4, dtype, 64.0)
    assert float(tiled_loss) == pytest.approx(float(loss), rel=1e-6)
    for g, t in zip(jax.tree.leaves(grads), jax.tree.leaves(tiled_grads)):
        g, t = np.asarray(g, np.float32), np.asarray(t, np.float32)
        np.testing.assert_allclose(t, g, rtol=rtol, atol=rtol * float(np.abs(g).max()))


def count_dots(jaxpr) -> int:
    """dot_general equations in a jaxpr and every jaxpr nested in it (scan bodies, custom_vjp rules)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == "dot_general"
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += count_dots(sub)
    return total


@pytest.mark.parametrize("dtype,dots", [(jnp.float32, 3), (jnp.float16, 4)])
def test_tiled_head_computes_each_chunks_logits_once(dtype, dots):
    """Under differentiation a chunk costs three matmuls (logits, their gradients for x and for the
    projection); float16 recomputes the logits in the backward pass (four)."""
    _, jaxpr = head_loss_and_grads(4, dtype, 1.0)
    assert count_dots(jaxpr.jaxpr) == dots
