"""Qwen's tower runs a micro batch's images by row (models/vision/qwen_images.embed_images): row r's patches are
sequence r of [B, X], attending within row r, where the flat form ran every row's patches as one sequence [1, B X].
A tiny qwen3_vl (deepstack) and qwen3_5 (none) on three rows (two images, none, one): the logits and the gradients of
every parameter equal the flat layout's of the same images in float32, and the compiled forward holds no
[B X, B X] array of attention scores (the flat one's, the control, does)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.config import load_config, with_overrides
from maxtrain.models import image_batch
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.vision import qwen_images

IMAGE, START, END = 290, 288, 289
VISION = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16, in_channels=3)
COMMON = ["base_num_decoder_layers=2", "base_emb_dim=32", "base_num_query_heads=2", "base_num_kv_heads=2",
          "head_dim=16", "base_mlp_dim=48", "vocab_size=300", "max_target_length=24", f"image_token_id={IMAGE}",
          "mrope_section=[2,3,3]", "dtype=float32", "weight_dtype=float32", "attention=dot_product",
          "remat_policy=none"]
FAMILIES = {
    "qwen3_vl": (["decoder_block=qwen3_vl"], {"deepstack_visual_indexes": [0], "model_type": "qwen3_vl"}),
    "qwen3_5": (["decoder_block=qwen3_5", "inhomogeneous_layer_cycle_interval=2", "gdn_num_key_heads=2",
                 "gdn_num_value_heads=2", "gdn_key_head_dim=8", "gdn_value_head_dim=8", "gdn_conv_kernel_dim=4",
                 "gdn_chunk_size=8"],
                {"model_type": "qwen3_5"}),
}
# Row 0: an image of 4 x 4 patches (4 placeholders) and one of 2 x 2 (1); row 1: text alone; row 2: a 2 x 4 (2).
GRIDS = [np.array([[1, 4, 4], [1, 2, 2]]), np.zeros((0, 3), np.int64), np.array([[1, 2, 4]])]
X = 24  # image_patches_per_row: each row's slot
T = 24


def config_of(family: str):
    keys, vision = FAMILIES[family]
    return load_config(with_overrides([BASE_YML, *COMMON, *keys,
                                       f"vision_config={json.dumps({**VISION, **vision}, separators=(',', ':'))}"]))


def batch():
    """tokens [3, T] and each row's pixels [patches, C t p p] (row 1's none)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 280, (3, T)).astype(np.int32)
    ids[0, 2:8] = [START] + [IMAGE] * 4 + [END]
    ids[0, 12:15] = [START, IMAGE, END]
    ids[2, 5:9] = [START, IMAGE, IMAGE, END]
    pixels = [rng.standard_normal((int(g.prod(1).sum()), 96)).astype(np.float32) for g in GRIDS]
    return ids, pixels


def layouts(config):
    """(positions [3, B, T], images by row {rows_key: [B, X, ...]}, flat images {key: [B X, ...]} of the same
    images in the batch's order, padded to B X patches)."""
    ids, pixels = batch()
    rows = [qwen_images.image_inputs(p, g, config, pad_to=X) for p, g in zip(pixels, GRIDS)]
    by_row = {image_batch.ROWS + k: np.stack([r[k] for r in rows]) for k in qwen_images.IMAGE_KEYS}
    flat = qwen_images.image_inputs(np.concatenate(pixels), np.concatenate(GRIDS), config, pad_to=3 * X)
    positions = qwen_images.rope_index(ids, np.concatenate(GRIDS), IMAGE, 2)
    return ids, positions, by_row, flat


def loss_fn(model, rt, ids, positions):
    weight = jnp.asarray(np.random.default_rng(1).standard_normal((3, T, 300)), jnp.float32)

    def loss(params, images):
        logits = model.forward(params, jnp.asarray(ids), positions, jnp.ones_like(ids), rt, images=images)[0]
        return jnp.sum(logits * weight), logits
    return loss


def bound(family: str):
    config = config_of(family)
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.key(0))
    params = jax.tree.map(lambda a: a + 0.05 * jnp.sin(jnp.arange(a.size).reshape(a.shape)), params)  # biases too
    return config, model, rt, params


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_give_the_flat_layouts_logits(family):
    config, model, rt, params = bound(family)
    ids, positions, by_row, flat = layouts(config)
    forward = jax.jit(lambda p, i: loss_fn(model, rt, ids, positions)(p, i)[1])
    with jax.default_matmul_precision("highest"):
        rows_logits, flat_logits = forward(params, by_row), forward(params, flat)
    np.testing.assert_allclose(rows_logits, flat_logits, rtol=1e-5, atol=1e-5)
    # the control: the rows' slots read as one flat sequence (each row's frames numbered from 1 in its slot, so
    # row 0's and row 2's first frames attend to each other, and row 0's padding sits before row 2's features)
    naive = {k[len(image_batch.ROWS):]: v.reshape((-1,) + v.shape[2:]) for k, v in by_row.items()}
    with jax.default_matmul_precision("highest"):
        assert not np.allclose(forward(params, naive)[2], flat_logits[2], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rows_give_the_flat_layouts_gradients(family):
    config, model, rt, params = bound(family)
    ids, positions, by_row, flat = layouts(config)
    grad = jax.jit(jax.grad(lambda p, i: loss_fn(model, rt, ids, positions)(p, i)[0]))
    with jax.default_matmul_precision("highest"):
        rows_grads, flat_grads = grad(params, by_row), grad(params, flat)
    scale = max(float(jnp.max(jnp.abs(g))) for g in jax.tree.leaves(flat_grads))
    for (path, g), g0 in zip(jax.tree_util.tree_flatten_with_path(rows_grads)[0], jax.tree.leaves(flat_grads)):
        np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))
    assert float(jnp.max(jnp.abs(rows_grads["vision"]["pos_embed"]))) > 0  # the tower's gradients are compared


def test_the_tower_attends_within_each_row_not_over_the_batch():
    """The compiled forward by row has scores of [X, X] per row and none of [B X, B X]; the flat layout of the same
    batch (the control: the tower's one sequence) has."""
    config, model, rt, params = bound("qwen3_vl")
    ids, positions, by_row, flat = layouts(config)
    loss = loss_fn(model, rt, ids, positions)
    square = f"x{3 * X}x{3 * X}x"

    def text(images):
        return jax.jit(lambda p, i: loss(p, i)[0]).lower(params, images).as_text()
    assert square not in text(by_row) and f"3x2x{X}x{X}x" in text(by_row)
    assert square in text(flat)
