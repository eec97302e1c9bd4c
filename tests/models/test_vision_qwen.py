"""The Qwen3-VL / Qwen3.5 vision tower (models/vision/qwen.py) against transformers' Qwen3VLVisionModel and
Qwen3_5VisionModel in float32: the merged embeddings and Qwen3-VL's deepstack features of images and a video of
different grids, from the transformers weights converted by the name mapping; the mapping both ways (our params
exported load strictly into transformers and read back unchanged; the names are the real models' under
PREFIXES); the grid's host-side facts (positions by merge window, segments per frame)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models.hf import ConversionError
from maxtrain.models.params import is_spec
from maxtrain.models.vision import qwen

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_5 import configuration_qwen3_5, modeling_qwen3_5  # noqa: E402
from transformers.models.qwen3_vl import configuration_qwen3_vl, modeling_qwen3_vl  # noqa: E402

# depth 3, D 32 (2 heads of 16), F 48, 4 x 4 pixel patches over 2 frames, a 4 x 4 learned position grid, merges of
# 2 x 2 into 40 (the text width); Qwen3-VL takes deepstack features after blocks 0 and 1.
TINY = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=48, patch_size=4, temporal_patch_size=2,
            spatial_merge_size=2, out_hidden_size=40, num_position_embeddings=16, in_channels=3)
KINDS = {"qwen3_vl": ({**TINY, "deepstack_visual_indexes": [0, 1]}, modeling_qwen3_vl.Qwen3VLVisionModel,
                      configuration_qwen3_vl.Qwen3VLVisionConfig),
         "qwen3_5": (TINY, modeling_qwen3_5.Qwen3_5VisionModel,
                     configuration_qwen3_5.Qwen3_5VisionConfig)}
# An image of 4 x 6 patches (the 4 x 4 position grid stretched), one of 2 x 2, a two-frame video of 2 x 4.
GRID = np.array([[1, 4, 6], [1, 2, 2], [2, 2, 4]])


def hf_tower(kind: str, seed: int = 0):
    """transformers' tower with every parameter drawn at a scale that makes each part count (its own init zeroes
    the biases and keeps the LayerNorms at the identity)."""
    vision_config, cls, config_cls = KINDS[kind]
    model = cls(config_cls(**vision_config, attn_implementation="eager")).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias") or name == "pos_embed.weight":
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5 if p.ndim == 2 else noise * 0.1)
    return model, qwen.VisionConfig.from_hf(model.config.to_dict())


def random_params(config: qwen.VisionConfig, seed: int = 0) -> dict:
    """Every declared parameter drawn from numpy (no compile, unlike init_params' draws; norms away from 1)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (rng.standard_normal(s.shape) * (0.2 if len(s.shape) < 2 + ("layers" in s.axes)
                                                                   else s.shape[-2] ** -0.5)).astype(np.float32),
                        qwen.param_specs(config), is_leaf=is_spec)


def rel(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), theirs.detach().double().numpy()
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_tower_computes_transformers_embeddings_and_deepstack_features(kind):
    model, config = hf_tower(kind)
    params = qwen.to_maxtrain({k: v.numpy() for k, v in model.state_dict().items()}, config, prefix="")
    pixels = np.random.default_rng(1).standard_normal((int(GRID.prod(1).sum()), config.patch_dim)).astype(np.float32)
    with torch.no_grad():
        out = model(torch.from_numpy(pixels), grid_thw=torch.from_numpy(GRID))
    with jax.default_matmul_precision("highest"):
        embeddings, features = jax.jit(lambda p, x: qwen.forward(p, x, GRID, config))(params, jnp.asarray(pixels))
    assert embeddings.shape == (GRID.prod(1).sum() // 4, 40)
    # Measured 2026-11-30 (CPU, float32, seed 0): Qwen3-VL 4.9e-7 (embeddings), 4.4e-7 and 4.1e-7 (deepstack);
    # Qwen3.5 4.5e-7; seeds 1 and 2 all under 5.1e-7.
    difference = rel(embeddings, out.pooler_output)
    assert difference < 1e-5, f"{kind}: embeddings differ by {difference:.2e}"
    theirs = list(getattr(out, "deepstack_features", None) or [])
    assert len(features) == len(theirs) == len(config.deepstack_visual_indexes)
    for i, (a, b) in enumerate(zip(features, theirs)):
        assert rel(a, b) < 1e-5, f"{kind}: deepstack feature {i} differs by {rel(a, b):.2e}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_our_params_load_strictly_into_transformers_and_come_back_unchanged(kind):
    model, config = hf_tower(kind)
    params = random_params(config)
    exported = qwen.to_hf(params, config, prefix="")
    model.load_state_dict({k: torch.from_numpy(v) for k, v in exported.items()}, strict=True)
    back = qwen.to_maxtrain({k: v.numpy() for k, v in model.state_dict().items()}, config, prefix="")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, back)


@pytest.mark.parametrize("name", ["Qwen3VL", "Qwen3VLMoe", "Qwen3_5", "Qwen3_5Moe"])
def test_the_names_are_the_released_models_under_model_visual(name):
    """The tower's names under PREFIXES[...ForConditionalGeneration] are exactly the full model's tensors there
    (the MoE models have the same tower)."""
    vision_config = KINDS["qwen3_vl" if name.startswith("Qwen3VL") else "qwen3_5"][0]
    text = dict(hidden_size=40, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=20,
                intermediate_size=32, vocab_size=64, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                layer_types=["full_attention"])
    if name.startswith("Qwen3VL"):
        text.pop("layer_types")
    cls = getattr(transformers, f"{name}ForConditionalGeneration")
    config = getattr(transformers, f"{name}Config")(vision_config=vision_config, text_config=text)
    with torch.device("meta"):
        names = {k for k in cls(config).state_dict() if k.startswith(qwen.PREFIXES[cls.__name__])}
    ours = qwen.VisionConfig.from_hf(config.vision_config.to_dict())
    params = random_params(ours)
    exported = qwen.to_hf(params, ours, prefix=qwen.PREFIXES[cls.__name__])
    assert set(exported) == names
    extra = {**exported, "model.visual.blocks.9.attn.qkv.weight": exported["model.visual.blocks.0.attn.qkv.weight"],
             "model.language_model.norm.weight": np.ones(40, np.float32)}
    with pytest.raises(ConversionError, match=r"no place for .*blocks\.9"):
        qwen.to_maxtrain(extra, ours)


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_vision_config_reads_and_writes_transformers_fields(kind):
    vision_config, _, config_cls = KINDS[kind]
    ours = qwen.VisionConfig.from_hf(config_cls(**vision_config).to_dict())
    assert ours.deepstack_visual_indexes == tuple(vision_config.get("deepstack_visual_indexes", ()))
    assert qwen.VisionConfig.from_hf(config_cls(**ours.to_hf()).to_dict()) == ours
    # A Qwen3-VL config.json that omits the deepstack indexes means transformers' default, as a real one states:
    released = {"depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152, "in_channels": 3,
                "intermediate_size": 4304, "model_type": "qwen3_vl", "num_heads": 16, "num_position_embeddings": 2304,
                "out_hidden_size": 4096, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}
    assert qwen.VisionConfig.from_hf(released).deepstack_visual_indexes == (8, 16, 24)
    with pytest.raises(ConversionError, match="patch_size"):
        qwen.VisionConfig.from_hf({**released, "patch_size": [16, 16]})


def test_patches_come_window_by_window_and_attend_within_their_frame():
    config = qwen.VisionConfig(depth=1, hidden_size=32, num_heads=2, spatial_merge_size=2, num_position_embeddings=16)
    positions = qwen.patch_positions([[1, 2, 4]], config)
    assert positions.tolist() == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert qwen.segment_ids([[1, 2, 2], [2, 2, 2]], config).tolist() == [1] * 4 + [2] * 4 + [3] * 4
    rows, weights = qwen.position_taps([[1, 4, 4]], config)  # the grid's own size: each patch reads its own cell
    np.testing.assert_array_equal(rows[np.arange(16), np.argmax(weights, 1)], [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13,
                                                                               10, 11, 14, 15])
    np.testing.assert_allclose(weights.sum(1), 1, rtol=1e-6)
    with pytest.raises(ValueError, match="multiples of 2"):
        qwen.grid([[1, 3, 4]], config)


@pytest.mark.slow  # 10-13 s on 2 cores (2026-11-30): the gradient's compile
def test_every_parameter_gets_a_gradient_and_bfloat16_stays_close():
    """The forward is differentiable through every parameter (deepstack mergers included), and in bfloat16
    matmuls it stays near float32."""
    config = qwen.VisionConfig(**{**TINY, "deepstack_visual_indexes": (1, 2)})
    params = random_params(config)
    grid = np.array([[1, 2, 4], [2, 2, 2]])
    pixels = jnp.asarray(np.random.default_rng(0).standard_normal((16, config.patch_dim)), jnp.float32)

    def loss(p, dtype=jnp.float32):
        embeddings, features = qwen.forward(p, pixels, grid, config, dtype)
        return jnp.sum(embeddings.astype(jnp.float32) ** 2) + sum(jnp.sum(f.astype(jnp.float32) ** 2) for f in features)
    grads = jax.jit(jax.grad(loss))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    dead = [jax.tree_util.keystr(k) for k, g in flat if not np.all(np.isfinite(g)) or not np.any(np.asarray(g))]
    assert not dead, f"no gradient reaches {dead}"
    full, half = jax.jit(loss)(params), jax.jit(lambda p: loss(p, jnp.bfloat16))(params)
    assert abs(float(half) - float(full)) < 0.05 * abs(float(full))


@pytest.mark.slow  # two compiled backward passes: ~20 s on 2 busy cores
def test_remat_keeps_the_gradients_and_drops_the_blocks_attention_weights():
    """With remat the backward recomputes each block (the same gradients) and holds one block's [heads, P, P]
    attention weights, not every block's: the compiled gradient's temporaries shrink."""
    config = qwen.VisionConfig(**{**TINY, "depth": 4})
    params = random_params(config)
    grid = np.array([[1, 8, 16]])  # 128 patches: the attention weights dominate the activations
    layout = qwen.patch_layout(grid, config)
    pixels = jnp.asarray(np.random.default_rng(0).standard_normal((128, config.patch_dim)), jnp.float32)

    def grad(remat):
        loss = lambda p: jnp.sum(qwen.forward_layout(p, pixels, layout, config, remat=remat)[0] ** 2)  # noqa: E731
        compiled = jax.jit(jax.grad(loss)).lower(params).compile()
        return compiled(params), compiled.memory_analysis().temp_size_in_bytes
    (plain, plain_temp), (remat, remat_temp) = grad(False), grad(True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), plain, remat)
    assert remat_temp < 0.6 * plain_temp, (remat_temp, plain_temp)
