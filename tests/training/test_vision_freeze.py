"""vision_freeze (training/freeze.py): an image-and-text model's frozen parts do not move in real train steps (the
tower's, the projector's and the language model's weights compared bitwise before and after), keep no optimizer
state, get no gradient through the frozen tower, and the settings that cannot work are refused before anything runs."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.config import load_config, with_overrides
from maxtrain.errors import ConfigError
from maxtrain.models.vision import qwen_images
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.training import freeze, optimizer, train_step

IMAGE, START, END = 290, 288, 289
VISION = dict(depth=2, hidden_size=16, num_heads=2, intermediate_size=24, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=32, num_position_embeddings=16, in_channels=3,
              deepstack_visual_indexes=[0], model_type="qwen3_vl")
GRID = np.array([[1, 4, 4]])  # 4 merged tokens
MODEL = ["decoder_block=qwen3_vl", "base_num_decoder_layers=2", "base_emb_dim=32", "base_num_query_heads=2",
         "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=48", "vocab_size=300", "max_target_length=16",
         f"image_token_id={IMAGE}", "mrope_section=[2,3,3]", "dtype=float32", "weight_dtype=float32",
         "attention=dot_product", "per_device_batch_size=1", "steps=10", "learning_rate=0.01", "warmup_steps_fraction=0"]


def cfg(*overrides):
    return load_config(with_overrides([BASE_YML, *MODEL, f"vision_config={json.dumps(VISION, separators=(',', ':'))}"],
                                      *overrides))


def batch(config):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 280, (1, 16)).astype(np.int32)
    ids[0, 3:9] = [START, IMAGE, IMAGE, IMAGE, IMAGE, END]
    pixels = rng.standard_normal((int(GRID.prod(1).sum()), 3 * 2 * 4 * 4)).astype(np.float32)
    images = qwen_images.image_inputs(pixels, GRID, config, pad_to=16)
    positions = qwen_images.rope_index(ids, GRID, IMAGE, 2)
    one = {"inputs": ids, "targets": np.roll(ids, -1, axis=1), "positions": positions, "segment_ids": np.ones_like(ids),
           "loss_weights": np.ones(ids.shape, np.float32), **images}
    return jax.tree.map(lambda a: np.asarray(a)[None], one)  # one accumulation step


def run_steps(config, steps=2):
    model, rt = Model.bind(config), Runtime.from_config(config)
    tx = optimizer.make_optimizer(config, model)
    state = train_step.init_state(config, model, rt, tx, jax.random.key(0))
    before = jax.tree.map(np.asarray, state["params"])
    step = jax.jit(train_step.make_train_step(config, model, rt, tx))
    b = batch(config)
    for _ in range(steps):
        state, _ = step(state, b)[:2]
    return model, before, jax.tree.map(np.asarray, state["params"]), state


def moved(model, before, after) -> dict:
    """{part: whether any of its weights changed}."""
    out = {"tower": False, "projector": False, "language_model": False}
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(before)[0], jax.tree.leaves(after)):
        keys = tuple(getattr(e, "key", e) for e in path)
        out[freeze.part(keys, model)] |= not np.array_equal(a, b)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("parts, trained", [
    ([], {"tower", "projector", "language_model"}),
    (["tower"], {"projector", "language_model"}),
    (["tower", "language_model"], {"projector"}),
    (["tower", "projector"], {"language_model"}),
])
def test_only_the_parts_left_out_move(parts, trained):
    config = cfg(f"vision_freeze=[{','.join(parts)}]")
    model, before, after, state = run_steps(config)
    assert moved(model, before, after) == {p: p in trained for p in ("tower", "projector", "language_model")}
    # the frozen parts keep no optimizer state: AdamW's moments cover the trained weights alone
    n_train, n_frozen = freeze.counts(before, config, model)
    moments = sum(x.size for x in jax.tree.leaves(state["opt_state"]) if x.ndim > 0)
    assert moments == 2 * n_train and (n_frozen > 0) == bool(parts)


def _compiled(fn, params):
    return jax.jit(fn).lower(params).compile()


def _flops(fn, params) -> float:
    return float(_compiled(fn, params).cost_analysis()["flops"])


@pytest.mark.slow
def test_a_frozen_tower_gets_no_gradient_and_the_backward_skips_it():
    """With the tower and the projector frozen their gradients are zero, and the compiled gradient's FLOPs drop by
    more than the tower's forward (its backward is about twice that): the backward does not run through it."""
    config = cfg("vision_freeze=[tower,projector]")
    model, rt = Model.bind(config), Runtime.from_config(config)
    params = model.init_params(jax.random.key(0))
    b = jax.tree.map(lambda a: a[0], batch(config))
    text = {k: b[k] for k in ("inputs", "targets", "positions", "segment_ids", "loss_weights")}  # no images

    def loss(p, frozen=True, data=b):
        return model.loss_fn(freeze.stop_gradients(p, config, model) if frozen else p, data, rt)[0]

    frozen_grad = _compiled(jax.grad(loss), params)  # run for the gradients, and its FLOPs below
    grads = frozen_grad(params)
    assert all(float(np.abs(g).max()) == 0 for g in jax.tree.leaves(grads["vision"]))
    assert all(float(np.abs(g).max()) > 0 for g in jax.tree.leaves(grads["layers"]))
    tower_forward = _flops(loss, params) - _flops(lambda p: loss(p, data=text), params)
    saved = _flops(jax.grad(lambda p: loss(p, frozen=False)), params) - float(frozen_grad.cost_analysis()["flops"])
    assert tower_forward > 0 and saved > tower_forward


@pytest.mark.parametrize("overrides, words", [
    (["vision_freeze=[tower,projector,language_model]"], "nothing would train"),
    (["vision_freeze=[tower,tower]"], "distinct parts"),
    (["vision_freeze=[vision]"], "distinct parts among tower, projector, language_model"),
    (["vision_freeze=[tower]", "lora_rank=4"], "LoRA trains adapters of the language model alone"),
    (["vision_freeze=[tower]", "opt_type=muon"], "opt_type=adamw"),
])
def test_settings_that_cannot_work_are_refused(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(")):
        cfg(*overrides)


def test_a_model_without_a_tower_is_refused_vision_freeze():
    with pytest.raises(ConfigError, match="vision_freeze.*does nothing without a model with a vision tower"):
        load_config(with_overrides([BASE_YML], "vision_freeze=[tower]"))  # a text family
    with pytest.raises(ConfigError, match="does nothing without a model with a vision tower"):  # no tower imported
        load_config(with_overrides([BASE_YML], "decoder_block=qwen3_vl", "vision_freeze=[tower]"))


@pytest.mark.slow
def test_lora_trains_adapters_of_the_language_model_alone():
    """lora_rank > 0 on an image-and-text model: the adapters sit on the decoder's projections only; the tower, the
    projector and every base weight stay as loaded while the adapters move."""
    config = cfg("lora_rank=4")
    model, before, after, state = run_steps(config)
    assert not any(moved(model, before, after).values())
    assert set(state["lora"]) == {"layers"}
    assert any(float(np.abs(b).max()) > 0 for b in jax.tree.leaves(state["lora"]))
