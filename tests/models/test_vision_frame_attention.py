"""Qwen's vision tower attends within frames without a [P, P] mask over the batch (models/vision/frame_attention.py):
the same values and gradients as the plain masked form, memory that grows with P, not P^2, and the run's kernel."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models import attention
from maxtrain.models.vision import frame_attention, qwen

CONFIG = qwen.VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=40, num_position_embeddings=16)
# images of 4 x 6 and 2 x 2 patches, a two-frame video of 2 x 4, a 6 x 2 image: frames of 24, 4, 8, 8, 12 patches,
# padded to 72 (16 patches of padding, segment 0)
GRID = np.array([[1, 4, 6], [1, 2, 2], [2, 2, 4], [1, 6, 2]])


def masked(q, k, v, segments):
    """The tower's old attention: one [1, P, P] mask over the whole batch."""
    return attention.dot_product_attention(q, k, v, attention.make_attention_mask(segments, segments, causal=False))


@pytest.mark.parametrize("implementation", ["dot_product", "flash"])
def test_frame_attention_equals_the_masked_form_values_and_gradients(implementation):
    """Blocks of 16 queries (72 patches: the last block padded) or the flash kernel (interpret mode on CPU): the
    values and the gradients of q, k and v equal the [P, P]-masked form's in float32, padding rows included."""
    segments = jnp.asarray(qwen.patch_layout(GRID, CONFIG, pad_to=72).segments)[None]
    rng = np.random.default_rng(0)
    q, k, v, weight = (jnp.asarray(rng.standard_normal((1, 72, 2, 16)), jnp.float32) for _ in range(4))

    def loss(attend, q, k, v):
        return jnp.sum(attend(q, k, v, segments) * weight)
    ours = jax.value_and_grad(lambda *a: loss(lambda q, k, v, s: frame_attention.attend(
        q, k, v, s, implementation=implementation, platform="cpu", query_block=16), *a), argnums=(0, 1, 2))
    plain = jax.value_and_grad(lambda *a: loss(masked, *a), argnums=(0, 1, 2))
    np.testing.assert_allclose(frame_attention.attend(q, k, v, segments, implementation=implementation,
                                                      platform="cpu", query_block=16), masked(q, k, v, segments),
                               rtol=1e-5, atol=1e-5)
    (value, grads), (value0, grads0) = ours(q, k, v), plain(q, k, v)
    np.testing.assert_allclose(value, value0, rtol=1e-5)
    for g, g0 in zip(grads, grads0):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)


def test_the_towers_memory_grows_with_the_patches_not_their_square():
    """Twice the images of 16 x 16 patches (P 1024 -> 2048): the compiled gradient's temporaries grow about 2x
    (query blocks of 512 against P keys), where one [P, P] mask and scores grew them 4x."""
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), qwen.param_specs(CONFIG),
                          is_leaf=lambda s: isinstance(s, qwen.ParamSpec))

    def temp_bytes(images: int) -> int:
        layout = qwen.patch_layout(np.tile([[1, 16, 16]], (images, 1)), CONFIG)
        pixels = jnp.zeros((images * 256, CONFIG.patch_dim), jnp.float32)
        loss = lambda p: jnp.sum(qwen.forward_layout(p, pixels, layout, CONFIG, platform="cpu")[0])  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(params).compile().memory_analysis().temp_size_in_bytes
    small, large = temp_bytes(4), temp_bytes(8)
    assert large < 2.6 * small, (small, large)


def test_the_tower_takes_the_runs_kernel_but_never_cudnn_or_tokamax():
    """flash (segment ids inside the kernel) on GPUs and TPUs where the decoder's attention was autoselected or a
    kernel; an explicit dot_product stays; CPU keeps the blocked plain form unless flash was set."""
    def rt(backend, attention_name, autoselected=("attention",)):
        return types.SimpleNamespace(backend=backend, attention=attention_name, autoselected=autoselected)
    assert frame_attention.implementation(rt("cpu", "dot_product")) == "dot_product"
    assert frame_attention.implementation(rt("cpu", "flash", ())) == "flash"
    assert frame_attention.implementation(rt("gpu", "cudnn")) == "flash"
    assert frame_attention.implementation(rt("cuda", "tokamax", ())) == "flash"
    assert frame_attention.implementation(rt("gpu", "dot_product")) == "flash"  # autoselected: nothing else fit
    assert frame_attention.implementation(rt("gpu", "dot_product", ())) == "dot_product"
    assert frame_attention.implementation(rt("tpu", "flash")) == "flash"
