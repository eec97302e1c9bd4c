"""Llama 4's vision encoder, adapter and projector (models/vision/llama4.py) against transformers'
Llama4ForConditionalGeneration in float32: the adapter's features (get_image_features) and the projected embeddings
that replace the image tokens, for three tiles, from the transformers weights converted by the name mapping; the
mapping both ways (our params exported load strictly into transformers' vision_model and multi_modal_projector
and read back unchanged; the names are the full model's under PREFIXES); the config's fields and refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.models.hf import ConversionError
from maxtrain.models.params import is_spec
from maxtrain.models.vision import llama4
from vlm_helpers import check_remat_keeps_gradients_and_shrinks_temps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.llama4 import configuration_llama4, modeling_llama4  # noqa: E402

# 2 layers, D 32 (2 heads of 16), 48-pixel tiles of 8-pixel patches (6 x 6 and the class token), the adapter's
# shuffle of 2 x 2 patches (F = 4 D = 128) into 9 tokens of 48, projected to the text width 40.
TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=48,
            patch_size=8, pixel_shuffle_ratio=0.5, projector_input_dim=48, projector_output_dim=48,
            vision_output_dim=48, num_channels=3)
TEXT = dict(hidden_size=40, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=20,
            intermediate_size=32, intermediate_size_mlp=32, vocab_size=64, num_local_experts=2)
PREFIXES = llama4.PREFIXES["Llama4ForConditionalGeneration"]


def hf_model(seed: int = 0):
    """transformers' tiny Llama 4 with every vision and projector parameter drawn at a scale that makes each part
    count (its own init keeps the LayerNorms at the identity and the biases at zero)."""
    config = configuration_llama4.Llama4Config(vision_config=TINY, text_config=TEXT, attn_implementation="eager")
    model = modeling_llama4.Llama4ForConditionalGeneration(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith(PREFIXES):
                continue
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias") or p.ndim == 1:
                p.copy_(0.2 * noise)
            elif "positional" in name:
                p.copy_(0.5 * noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)
    return model, llama4.VisionConfig.from_hf(model.config.vision_config.to_dict(), TEXT["hidden_size"])


def random_params(config: llama4.VisionConfig, seed: int = 0) -> dict:
    """Every declared parameter drawn from numpy (norms away from 1)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: (rng.standard_normal(s.shape) * (0.2 if len(s.shape) < 2 + ("layers" in s.axes)
                                                                   else s.shape[-2] ** -0.5)).astype(np.float32),
                        llama4.param_specs(config), is_leaf=is_spec)


def rel(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), theirs.detach().double().numpy()
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


def test_the_encoder_computes_transformers_image_features_and_projected_embeddings():
    model, config = hf_model()
    assert model.vision_model.config._attn_implementation == "eager"  # pylint: disable=protected-access
    params = llama4.to_maxtrain({k: v.numpy() for k, v in model.state_dict().items()}, config)
    pixels = np.random.default_rng(1).standard_normal((3, 3, 48, 48)).astype(np.float32)
    with torch.no_grad():
        features = model.get_image_features(pixel_values=torch.from_numpy(pixels), return_dict=True).last_hidden_state
        projected = model.multi_modal_projector(features.reshape(-1, features.shape[-1]))
    with jax.default_matmul_precision("highest"):
        ours_features = jax.jit(lambda p, x: llama4.encode(p, x, config))(params, jnp.asarray(pixels))
        ours = jax.jit(lambda p, x: llama4.forward(p, x, config))(params, jnp.asarray(pixels))
    assert ours_features.shape == (3, 9, 48) and ours.shape == (3 * config.tokens_per_tile, 40)
    # Measured 2026-11-30 (CPU, float32, seed 0): 5.7e-7 (features), 5.2e-7 (projected); seeds 1 and 2 under 5.1e-7.
    # Rows and columns swapped in the rotary: 1.5e-1.
    assert rel(ours_features, features) < 1e-5, f"adapter features differ by {rel(ours_features, features):.2e}"
    assert rel(ours, projected) < 1e-5, f"projected embeddings differ by {rel(ours, projected):.2e}"


def test_our_params_load_strictly_into_transformers_and_come_back_unchanged():
    model, config = hf_model()
    params = random_params(config)
    exported = llama4.to_hf(params, config)
    for prefix, module in zip(PREFIXES, (model.vision_model, model.multi_modal_projector)):
        module.load_state_dict({k[len(prefix):]: torch.from_numpy(v) for k, v in exported.items()
                                if k.startswith(prefix)}, strict=True)
    back = llama4.to_maxtrain({k: v.numpy() for k, v in model.state_dict().items()}, config)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, back)


def test_the_names_are_the_full_models_under_its_prefixes():
    config = configuration_llama4.Llama4Config(vision_config=TINY, text_config=TEXT)
    with torch.device("meta"):
        names = {k for k in modeling_llama4.Llama4ForConditionalGeneration(config).state_dict()
                 if k.startswith(PREFIXES)}
    ours = llama4.VisionConfig.from_hf(config.vision_config.to_dict(), TEXT["hidden_size"])
    exported = llama4.to_hf(random_params(ours), ours)
    assert set(exported) == names
    assert {"vision_model.model.layers.1.self_attn.q_proj.bias", "multi_modal_projector.linear_1.weight"} <= names
    bias = exported["vision_model.model.layers.0.mlp.fc1.bias"]
    extra = {**exported, "vision_model.model.layers.2.mlp.fc1.bias": bias,
             "language_model.model.norm.weight": np.ones(40, np.float32)}
    with pytest.raises(ConversionError, match=r"no place for .*layers\.2"):
        llama4.to_maxtrain(extra, ours)
    del exported["multi_modal_projector.linear_1.weight"]
    with pytest.raises(ConversionError, match="no tensor multi_modal_projector.linear_1.weight"):
        llama4.to_maxtrain(exported, ours)


def test_the_vision_config_reads_and_writes_transformers_fields():
    ours = llama4.VisionConfig.from_hf(configuration_llama4.Llama4VisionConfig(**TINY).to_dict(), 40)
    assert (ours.side, ours.shuffle, ours.tokens_per_tile, ours.head_dim) == (6, 2, 9, 16)
    assert llama4.VisionConfig.from_hf(configuration_llama4.Llama4VisionConfig(**ours.to_hf()).to_dict(), 40) == ours
    # Llama 4 Scout's vision_config (config.json) gives the defaults.
    released = {"attention_dropout": 0.0, "hidden_act": "gelu", "hidden_size": 1408, "image_size": 336,
                "initializer_range": 0.02, "intermediate_size": 5632, "model_type": "llama4_vision_model",
                "multi_modal_projector_bias": False, "norm_eps": 1e-05, "num_attention_heads": 16, "num_channels": 3,
                "num_hidden_layers": 34, "patch_size": 14, "pixel_shuffle_ratio": 0.5, "projector_dropout": 0.0,
                "projector_input_dim": 4096, "projector_output_dim": 4096, "rope_theta": 10000,
                "vision_feature_layer": -1, "vision_feature_select_strategy": "default", "vision_output_dim": 4096}
    assert llama4.VisionConfig.from_hf(released, 5120) == llama4.VisionConfig()
    assert llama4.VisionConfig().tokens_per_tile == 144
    for change, match in [({"vision_feature_layer": -2}, "vision_feature_layer"),
                          ({"vision_feature_select_strategy": "full"}, "vision_feature_select_strategy"),
                          ({"hidden_act": "silu"}, "hidden_act"), ({"norm_eps": 1e-6}, "norm_eps"),
                          ({"multi_modal_projector_bias": True}, "multi_modal_projector_bias"),
                          ({"projector_dropout": 0.1}, "projector_dropout"), ({"patch_size": [14, 14]}, "one size"),
                          ({"intermediate_size": 4096}, "intermediate_size"),
                          ({"vision_output_dim": 7680}, "vision_output_dim"),
                          ({"rope_parameters": {"rope_type": "linear", "factor": 2.0}}, "no scaling")]:
        with pytest.raises(ConversionError, match=match):
            llama4.VisionConfig.from_hf({**released, **change}, 5120)


def test_pixel_shuffle_and_patches_are_transformers():
    config = llama4.VisionConfig.from_hf(TINY, 40)
    x = np.random.default_rng(0).standard_normal((2, 36, 32)).astype(np.float32)
    theirs = modeling_llama4.pixel_shuffle(torch.from_numpy(x), 0.5).numpy()
    np.testing.assert_array_equal(np.asarray(llama4.pixel_shuffle(jnp.asarray(x), config)), theirs)
    pixels = np.random.default_rng(1).standard_normal((2, 3, 48, 48)).astype(np.float32)
    unfolded = torch.nn.Unfold(8, stride=8)(torch.from_numpy(pixels)).permute(0, 2, 1).numpy()
    np.testing.assert_array_equal(np.asarray(llama4.patches(jnp.asarray(pixels), config)), unfolded)
    with pytest.raises(ValueError, match="not tiles"):
        llama4.encode(random_params(config), jnp.zeros((2, 3, 40, 40)), config)


@pytest.mark.slow  # 10 s on 2 cores (2026-11-30): the gradient's compile
def test_every_parameter_gets_a_gradient_and_bfloat16_stays_close():
    config = llama4.VisionConfig.from_hf(TINY, 40)
    params = random_params(config)
    pixels = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 48, 48)), jnp.float32)

    def loss(p, dtype=jnp.float32):
        return jnp.sum(llama4.forward(p, pixels, config, dtype).astype(jnp.float32) ** 2)
    grads = jax.jit(jax.grad(loss))(params)
    flat = jax.tree_util.tree_flatten_with_path(grads)[0]
    dead = [jax.tree_util.keystr(k) for k, g in flat if not np.all(np.isfinite(g)) or not np.any(np.asarray(g))]
    assert not dead, f"no gradient reaches {dead}"
    full, half = jax.jit(loss)(params), jax.jit(lambda p: loss(p, jnp.bfloat16))(params)
    assert abs(float(half) - float(full)) < 0.05 * abs(float(full))


@pytest.mark.slow  # two compiled backward passes
def test_remat_keeps_the_gradients_and_holds_one_blocks_activations():
    """With remat the backward recomputes each block (the same values and gradients) and holds one block's
    activations, not every block's: the compiled gradient's temporaries shrink (issue 59)."""
    config = llama4.VisionConfig.from_hf({**TINY, "num_hidden_layers": 4}, TEXT["hidden_size"])
    params = random_params(config)
    pixels = jnp.asarray(np.random.default_rng(1).standard_normal((8, 3, 48, 48)), jnp.float32)

    def loss(p, remat):
        rows = llama4.forward(p, pixels, config, remat=remat)
        return jnp.sum(rows ** 2), rows
    check_remat_keeps_gradients_and_shrinks_temps(loss, params)
