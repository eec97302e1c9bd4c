"""The changes that bring per-chip memory down (docs/scale.md, "Where the memory went"), on CPU:
activations placed apart from parameters, gradients kept sharded, 16-bit attention scores."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxtrain.models import attention
from maxtrain.training import builder
from maxtrain import config as config_lib
from maxtrain.compile import hlo_stats
from maxtrain.parallel import sharding
from maxtrain.config import with_overrides

from conftest import BASE_YML, TINY


def test_activation_rules_place_the_residual_stream_on_the_tensor_axis():
    rules = config_lib.load_config([BASE_YML]).logical_axis_rules
    # Parameters: embed over fsdp (and expert), heads over tensor, as before.
    assert sharding.logical_to_spec(("embed", "heads", "head_dim"), rules) == P(("fsdp", "expert"), "tensor", None)
    # Activations: batch takes data, fsdp and expert, length context; embed, which would stay whole, goes on tensor.
    batch = ("data", "fsdp", "expert")
    assert sharding.activation_spec(("batch", "length", "embed"), rules) == P(batch, "context", "tensor")
    assert sharding.logical_to_spec(("batch", "length", "embed"), rules) == P(batch, "context", None)
    # An axis without an activation_ rule keeps its own: heads still on tensor.
    assert sharding.activation_spec(("batch", "length", "heads", "head_dim"), rules) == P(batch, "context",
                                                                                          "tensor", None)


def test_unknown_activation_axis_is_refused():
    with pytest.raises(config_lib.ConfigError, match="unknown logical axis 'activation_embedd'.*activation_<axis>"):
        config_lib.load_config([BASE_YML, 'logical_axis_rules=[["activation_embedd", "tensor"]]'])


def test_tensor_parallel_step_keeps_activations_and_gradients_sharded():
    """fsdp 4 x tensor 2 on the 8 CPU devices: the per-layer activation saved for the backward pass
    is split over both axes, so the program holds no [B, T, D] activation whole on a device."""
    config = builder.load_config(with_overrides([BASE_YML, *TINY], "dataset_type=synthetic", "ici_fsdp_parallelism=4",
                                                "ici_tensor_parallelism=2", "per_device_batch_size=2",
                                                "remat_policy=full"))
    run = builder.build(config)
    text = run.compile().as_text()
    b, t, d = run.config.micro_batch_size // 4, config.max_target_length, config.base_emb_dim
    layers = config.base_num_decoder_layers
    # The stacked residuals of the layer scan: [L, B/fsdp, T, D/tensor] per device.
    assert f"[{layers},{b},{t},{d // 2}]" in text
    assert f"[{layers},{b},{t},{d}]" not in text
    stats = hlo_stats.collectives(text)
    assert stats.bytes_by_kind["reduce-scatter"] > 0 or stats.bytes_by_kind["all-reduce"] > 0


def _old_reference(q, k, v, mask, scale, cap):
    """dot_product_attention as it was: float32 scores and softmax."""
    b, t, n, h = q.shape
    g = k.shape[2]
    q = q.reshape(b, t, g, n // g, h)
    scores = jnp.einsum("BTGRH,BSGH->BGRTS", q, k, preferred_element_type=jnp.float32)
    scores = attention.soft_cap(scores * scale, cap)
    scores = jnp.where(mask[:, None, None], scores, attention.reference._MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("BGRTS,BSGH->BTGRH", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, n, h).astype(q.dtype)


@pytest.mark.parametrize("cap", [0.0, 5.0])
def test_compact_16_bit_scores_match_float32_attention(cap):
    keys = jax.random.split(jax.random.key(0), 4)
    b, t, n, g, h = 2, 64, 4, 2, 32
    q, k, v = (jax.random.normal(keys[0], (b, t, n, h)), jax.random.normal(keys[1], (b, t, g, h)),
               jax.random.normal(keys[2], (b, t, g, h)))
    cotangent = jax.random.normal(keys[3], (b, t, n, h))
    segments = jnp.ones((b, t), jnp.int32).at[:, 40:].set(2)
    mask = attention.make_attention_mask(segments, segments)

    def loss(q, k, v, dtype, fn):
        out = fn(q.astype(dtype), k.astype(dtype), v.astype(dtype))
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    new = lambda q, k, v: attention.dot_product_attention(q, k, v, mask, scale=h**-0.5, logits_soft_cap=cap,
                                                          compact_scores=True)
    old = lambda q, k, v: _old_reference(q, k, v, mask, h**-0.5, cap)
    # float32 is computed exactly as before, and so is bfloat16 without compact scores.
    np.testing.assert_array_equal(new(q, k, v), old(q, k, v))
    qb, kb, vb = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    np.testing.assert_array_equal(attention.dot_product_attention(qb, kb, vb, mask, scale=h**-0.5, logits_soft_cap=cap),
                                  old(qb, kb, vb))
    # bfloat16: values and gradients within bfloat16's precision of the float32 ones.
    want = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, jnp.float32, old)
    got = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, jnp.bfloat16, new)
    for a, e in zip(got, want):
        assert float(jnp.max(jnp.abs(a - e)) / jnp.max(jnp.abs(e))) < 2e-2
    assert abs(float(loss(q, k, v, jnp.bfloat16, new)) - float(loss(q, k, v, jnp.float32, old))) < 0.01 * abs(
        float(loss(q, k, v, jnp.float32, old))) + 0.5


def test_compact_scores_store_no_float32_score_array(capsys):
    """What the backward pass keeps of bfloat16 attention: with compact scores, the T x S arrays it
    saves, the scores the q.k matmul writes and the probabilities' gradient are bfloat16 (a float32
    T x S product is what XLA's TPU compiler kept whole, twice per layer, under tensor parallelism:
    docs/scale.md); without, the scores are float32."""
    b, t, n, h = 1, 512, 2, 16
    q = jnp.ones((b, t, n, h), jnp.bfloat16)
    mask = attention.make_attention_mask(jnp.ones((b, t), jnp.int32), jnp.ones((b, t), jnp.int32))
    square = f"[{b},{n},1,{t},{t}]"

    def saved(compact):
        fn = lambda q, k, v: jnp.sum(attention.dot_product_attention(q, k, v, mask, compact_scores=compact)
                                     .astype(jnp.float32))
        jax.ad_checkpoint.print_saved_residuals(fn, q, q, q)
        residuals = capsys.readouterr().out
        # the forward and backward passes' products (the gradient of the probabilities is one of them)
        grad_fn = jax.grad(fn, argnums=(0, 1, 2))
        products = [line for line in jax.jit(grad_fn).lower(q, q, q).as_text().splitlines() if "dot_general" in line]
        return residuals, "\n".join(products)

    residuals, scores = saved(True)
    float32_scores = re.compile(rf"-> tensor<(\d+x)*{t}x(\d+x)*{t}x(\d+x)*f32>")  # a dot_general writing a T x S float32 array
    assert f"bf16{square}" in residuals and f"f32{square}" not in residuals, residuals
    assert f"tensor<{b}x{n}x1x{t}x{t}xbf16>" in scores and not float32_scores.search(scores), scores
    residuals, scores = saved(False)
    assert float32_scores.search(scores), scores
