"""Qwen's vision tower attends within frames without a [P, P] mask over the batch (models/vision/frame_attention.py):
the same values and gradients as the plain masked form, memory that grows with P, not P^2, and the run's kernel."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models import attention
from maxtrain.models.vision import frame_attention, qwen
from maxtrain.parallel import sharding

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


# three rows of 24 patches each (a micro batch's images by row): two images, none (all padding), a two-frame video
ROW_GRIDS = [np.array([[1, 4, 4], [1, 2, 2]]), np.zeros((0, 3), np.int64), np.array([[2, 2, 4]])]


def row_segments():
    """[3, 24]: each row's frames numbered from 1 in its own row, and the flat form [1, 72]: row r's moved past the
    rows before (as the tower's one sequence had them)."""
    rows = np.stack([qwen.patch_layout(g, CONFIG, pad_to=24).segments for g in ROW_GRIDS])
    flat = np.where(rows > 0, rows + 24 * np.arange(3)[:, None], 0).reshape(1, -1)
    return jnp.asarray(rows), jnp.asarray(flat)


@pytest.mark.parametrize("implementation", ["dot_product", "flash"])
def test_rows_attend_as_the_flat_sequence_with_rows_frames_apart(implementation):
    """q, k, v [3, 24, N, H] with each row's segments: the values and gradients equal the flat sequence's [1, 72]
    (row r's frames numbered past the rows before) in float32, at every patch but the padding (whose rows nothing
    reads: there it attends to its own row's padding, not the batch's); the control, the flat sequence with each
    row's own numbering, lets row 0's and row 2's frame 1 attend to each other."""
    rows, flat = row_segments()
    rng = np.random.default_rng(0)
    q, k, v, weight = (jnp.asarray(rng.standard_normal((3, 24, 2, 16)), jnp.float32) for _ in range(4))
    real = np.asarray(rows > 0)[..., None, None]

    def loss(segments, q, k, v):
        shape = (segments.shape[0], -1, 2, 16)
        out = frame_attention.attend(q.reshape(shape), k.reshape(shape), v.reshape(shape), segments,
                                     implementation=implementation, platform="cpu", query_block=16)
        return jnp.sum(jnp.where(real, out.reshape(q.shape), 0) * weight)
    ours = jax.value_and_grad(functools.partial(loss, rows), argnums=(0, 1, 2))(q, k, v)
    theirs = jax.value_and_grad(functools.partial(loss, flat), argnums=(0, 1, 2))(q, k, v)
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for g, g0 in zip(ours[1], theirs[1]):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)
    crossed = jnp.asarray(np.asarray(rows).reshape(1, -1))
    assert not np.allclose(loss(crossed, q, k, v), theirs[0], rtol=1e-5)


def test_the_tower_by_rows_is_the_flat_towers_values_and_gradients():
    """qwen.forward_layout on pixels [3, 24, ...] with each row's layout [3, 24, ...] gives, row by row, the merged
    embeddings (and their gradients in every parameter) of the flat tower on the rows' patches as one sequence
    (row r's frames numbered past the rows before), in float32."""
    config = qwen.VisionConfig(**{**vars(CONFIG), "deepstack_visual_indexes": (0,)})
    params = jax.tree.map(lambda s: jnp.asarray(np.random.default_rng(len(s.shape)).standard_normal(s.shape) * 0.2,
                                                jnp.float32), qwen.param_specs(config),
                          is_leaf=lambda s: isinstance(s, qwen.ParamSpec))
    layouts = [qwen.patch_layout(g, config, pad_to=24) for g in ROW_GRIDS]
    rows = qwen.PatchLayout(*(np.stack(a) for a in zip(*layouts)))
    flat = qwen.PatchLayout(*(a.reshape((-1,) + a.shape[2:]) for a in rows))._replace(
        segments=np.asarray(row_segments()[1][0]))
    pixels = jnp.asarray(np.random.default_rng(1).standard_normal((3, 24, config.patch_dim)), jnp.float32)
    real = jnp.asarray(rows.images > 0)[..., None]  # the merged tokens of images (padding's are read by nothing)

    def loss(p, layout, shape):
        merged, (deep,) = qwen.forward_layout(p, pixels.reshape(shape + (-1,)), layout, config, platform="cpu")
        return jnp.sum(jnp.where(real, merged.reshape(real.shape[:2] + (-1,)) + deep.reshape(real.shape[:2] + (-1,)),
                                 0) ** 2)
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=2)
    with jax.default_matmul_precision("highest"):
        ours, theirs = grad(params, rows, (3, 24)), grad(params, flat, (72,))
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for g, g0 in zip(jax.tree.leaves(ours[1]), jax.tree.leaves(theirs[1])):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(g0))))
    crossed = flat._replace(segments=rows.segments.reshape(-1))  # the control: rows' frames 1 attend together
    assert not np.allclose(jax.jit(loss, static_argnums=2)(params, crossed, (72,)), theirs[0], rtol=1e-5)


@pytest.mark.parametrize("rows", [4, 1])
def test_the_kernel_under_a_mesh_takes_rows_over_the_batch_or_keeps_one_whole(rows):
    """Under FSDP 4 x tensor 2 (8 CPU devices), the flash kernel (interpret mode) on [rows, 24, 2, 16]: 4 rows split
    over the batch's 4 ways (the output split so; before, every device held them all), 1 (flat images) whole on
    every device; the values those of no mesh."""
    mesh = sharding.mesh_of(jax.devices()[:8], fsdp=4, tensor=2)
    rules = [["batch", ["data", "fsdp"]], ["heads", "tensor"]]
    segments = jnp.asarray(np.tile(qwen.patch_layout(np.array([[1, 2, 2], [2, 2, 4]]), CONFIG, pad_to=24).segments,
                                   (rows, 1)))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((rows, 24, 2, 16)), jnp.float32) for _ in range(3))
    attend = functools.partial(frame_attention.attend, implementation="flash", platform="cpu")
    with sharding.activation_sharding(mesh, rules):
        ways = sharding.ways("batch")
        out = jax.jit(attend)(q, k, v, segments)
    assert ways == 4 and (tuple(out.sharding.spec) + (None,))[0] == ("fsdp" if rows == 4 else None), out.sharding
    np.testing.assert_allclose(out, attend(q, k, v, segments), rtol=1e-5, atol=1e-5)


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
