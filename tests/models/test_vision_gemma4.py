"""The Gemma 4 vision encoder and projector (models/vision/gemma4.py) against transformers' Gemma4Model in float32:
the soft-token embeddings that get_image_features returns and Gemma4Model puts, unchanged, on the image placeholders,
for two images of different sizes and aspect ratios padded as the processor pads them, from the transformers
weights converted by the name mapping, with and without clipped linears and standardization; the mapping both ways
(our params exported load strictly into transformers and read back unchanged; the names are the full models'
under PREFIXES); the config both ways and its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.data import images
from maxtrain.models.hf import ConversionError
from maxtrain.models import params as params_lib
from maxtrain.models.params import is_spec
from maxtrain.models.vision import gemma4
from vlm_helpers import check_remat_keeps_gradients_and_shrinks_temps

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("PIL")

# D 32 (4 query heads, 2 key/value heads of 8), F 48, 2 layers, 4 x 4 pixel patches pooled 2 x 2, a 40-entry
# position table per axis, projected into a text width of 40.
VISION = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, patch_size=4, pooling_kernel_size=2, position_embedding_size=40)
KINDS = {"clipped-standardized": {**VISION, "use_clipped_linears": True, "standardize": True},
         "plain": VISION}
TEXT = dict(hidden_size=40, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, global_head_dim=16, vocab_size=64, vocab_size_per_layer_input=64,
            layer_types=["full_attention"], hidden_size_per_layer_input=0)
# Up to 70 soft tokens (280 patches of 4 x 4) per image; a wide and a tall image become 8 x 34 and 24 x 10 patches.
SPEC = images.Gemma4VisionPreprocess(patch_size=4, max_soft_tokens=70, pooling_kernel_size=2)
IMAGE_TOKEN = 60  # inside the tiny vocabulary


def hf_model(kind: str, seed: int = 0):
    """A tiny transformers Gemma4ForConditionalGeneration (no audio) with every vision parameter drawn at a scale that
    makes each part count, clipping bounds that clip some values, and the standardization away from identity."""
    config = transformers.Gemma4Config(text_config=transformers.Gemma4TextConfig(**TEXT),
                                       vision_config=transformers.Gemma4VisionConfig(**KINDS[kind]), audio_config=None,
                                       image_token_id=IMAGE_TOKEN)
    config._attn_implementation = "eager"  # set on the sub-configs too
    model = transformers.Gemma4ForConditionalGeneration(config).float().eval()
    assert model.model.vision_tower.config._attn_implementation == "eager"
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if not name.startswith(("model.vision_tower.", "model.embed_vision.")) or "inv_freq" in name:
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("input_min", "output_min")):
                p.fill_(-1.0 - 0.5 * abs(float(noise)))
            elif name.endswith(("input_max", "output_max")):
                p.fill_(1.0 + 0.5 * abs(float(noise)))
            elif "norm" in name or name.endswith("std_scale"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("std_bias") or name.endswith("position_embedding_table"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise * p.shape[1] ** -0.5)
    return model, gemma4.VisionConfig.from_hf(config.to_dict())


def inputs(sizes=((30, 130), (95, 40)), seed: int = 1):
    """Random RGB images of these (height, width) through our Gemma 4 preprocessing (transformers' PIL processor's
    arrays): pixel_values [2, 280, 48], position_ids [2, 280, 2]."""
    rng = np.random.default_rng(seed)
    done = [images.gemma4(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), SPEC) for h, w in sizes]
    return np.stack([d.pixel_values for d in done]), np.stack([d.position_ids for d in done]), done


def random_params(config: gemma4.VisionConfig, seed: int = 0) -> dict:
    """Every declared parameter drawn from numpy (no compile): weights at their init scale, norm scales near 1,
    the rest (biases, bounds) near 0."""
    rng = np.random.default_rng(seed)

    def draw(s):
        noise = rng.standard_normal(s.shape)
        return np.asarray(noise * s.stddev if s.init == "normal" else (s.init == "ones") + 0.2 * noise, np.float32)
    return jax.tree.map(draw, gemma4.param_specs(config), is_leaf=is_spec)


def rel(ours, theirs) -> float:
    ours, theirs = np.asarray(ours, np.float64), theirs.detach().double().numpy()
    return float(np.max(np.abs(ours - theirs)) / np.max(np.abs(theirs)))


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_encoder_and_projector_compute_transformers_soft_tokens(kind):
    model, config = hf_model(kind)
    params = gemma4.to_maxtrain({k: v.numpy() for k, v in model.state_dict().items()}, config)
    pixels, positions, done = inputs()
    assert [d.num_tokens for d in done] == [68, 60] and len({d.pixel_values.shape for d in done}) == 1
    with torch.no_grad():
        theirs = model.model.get_image_features(torch.from_numpy(pixels), torch.from_numpy(positions.astype(np.int64)))
    theirs = torch.cat(theirs.pooler_output)
    run = jax.jit(lambda p, x, pos: gemma4.forward(p, x, pos, config))
    with jax.default_matmul_precision("highest"):
        embeddings, valid = run(params, jnp.asarray(pixels), jnp.asarray(positions))
        # other images of the same padded shape: the same compilation
        swapped = run(params, jnp.asarray(pixels[::-1]), jnp.asarray(positions[::-1]))
    assert run._cache_size() == 1
    assert embeddings.shape == (2, 70, 40)
    np.testing.assert_array_equal(np.asarray(valid).sum(1), gemma4.soft_tokens(positions, config))
    np.testing.assert_array_equal(np.asarray(valid), np.arange(70)[None] < np.array([[68], [60]]))
    # Measured 2026-11-30 (CPU, float32, seed 0): 1.4e-6 clipped and standardized (about 12% of the projections'
    # inputs clipped), 8.1e-7 plain; seeds 1 and 2 all under 2.5e-6.
    difference = rel(np.asarray(embeddings)[np.asarray(valid)], theirs)
    assert difference < 1e-5, f"{kind}: soft tokens differ by {difference:.2e}"
    np.testing.assert_allclose(np.asarray(swapped[0])[0, :60], np.asarray(embeddings)[1, :60], rtol=1e-5, atol=1e-5)


def test_gemma4_model_puts_the_soft_tokens_unchanged_on_the_image_tokens():
    """What Gemma4Model hands its language model on the image placeholders is exactly the projector's output (no
    embedding scale, no norm after it): the rows our forward marks valid, image by image."""
    model, config = hf_model("plain")
    params = gemma4.to_maxtrain({k: v.numpy() for k, v in model.state_dict().items()}, config)
    pixels, positions, _ = inputs()
    text = np.random.default_rng(2).integers(1, 50, 10)
    ids = np.concatenate([text[:4], [IMAGE_TOKEN] * 68, text[4:7], [IMAGE_TOKEN] * 60, text[7:]])[None]
    seen = {}
    model.model.language_model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.update(embeds=kwargs["inputs_embeds"]), with_kwargs=True)
    with torch.no_grad():
        model.model(input_ids=torch.from_numpy(ids), pixel_values=torch.from_numpy(pixels),
                    image_position_ids=torch.from_numpy(positions.astype(np.int64)))
    with jax.default_matmul_precision("highest"):
        embeddings, valid = jax.jit(lambda p, x, pos: gemma4.forward(p, x, pos, config))(
            params, jnp.asarray(pixels), jnp.asarray(positions))
    theirs = seen["embeds"][0][torch.from_numpy(ids[0] == IMAGE_TOKEN)]
    difference = rel(np.asarray(embeddings)[np.asarray(valid)], theirs)
    assert difference < 1e-5, f"the image tokens' embeddings differ from our soft tokens by {difference:.2e}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_our_params_load_strictly_into_transformers_and_come_back_unchanged(kind):
    model, config = hf_model(kind)
    params = random_params(config)
    exported = gemma4.to_hf(params, config)
    state = model.state_dict()
    assert set(exported) == {k for k in state if k.startswith(("model.vision_tower.", "model.embed_vision."))}
    model.load_state_dict({**state, **{k: torch.from_numpy(v) for k, v in exported.items()}}, strict=True)
    back = gemma4.to_maxtrain({k: v.numpy() for k, v in model.state_dict().items()}, config)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), b), params, back)


@pytest.mark.parametrize("cls", list(gemma4.PREFIXES))
def test_the_names_are_the_full_models_under_their_prefix(cls):
    config = transformers.Gemma4Config(text_config=TEXT, vision_config=KINDS["clipped-standardized"],
                                       audio_config=None)
    prefix = gemma4.PREFIXES[cls]
    with torch.device("meta"):
        names = {k for k in getattr(transformers, cls)(config).state_dict()
                 if k.startswith((prefix + gemma4.TOWER, prefix + gemma4.PROJECTOR))}
    ours = gemma4.VisionConfig.from_hf(config.to_dict())
    exported = gemma4.to_hf(random_params(ours), ours, prefix=prefix)
    assert set(exported) == names
    extra = {**exported, prefix + "vision_tower.encoder.layers.5.mlp.up_proj.linear.weight": np.zeros((48, 32))}
    with pytest.raises(ConversionError, match=r"no place for .*layers\.5"):
        gemma4.to_maxtrain(extra, ours, prefix=prefix)
    plain = gemma4.VisionConfig.from_hf({**config.to_dict(), "vision_config": VISION})
    with pytest.raises(ConversionError, match="no place for .*input_max"):
        gemma4.to_maxtrain(exported, plain, prefix=prefix)


def test_the_vision_config_reads_and_writes_transformers_fields():
    config = transformers.Gemma4Config(text_config=TEXT, vision_config=KINDS["clipped-standardized"],
                                       audio_config=None).to_dict()
    ours = gemma4.VisionConfig.from_hf(config)
    assert (ours.text_hidden_size, ours.head_dim, ours.use_clipped_linears, ours.rope_theta) == (40, 8, True, 100.0)
    again = transformers.Gemma4VisionConfig(**ours.to_hf()).to_dict()
    assert gemma4.VisionConfig.from_hf({**config, "vision_config": again}) == ours
    default_rope = {**VISION, "rope_parameters": {"rope_type": "default", "rope_theta": 50.0}}  # read as axial
    assert gemma4.VisionConfig.from_hf({**config, "vision_config": default_rope}).rope_theta == 50.0
    with pytest.raises(ConversionError, match="axial"):
        gemma4.VisionConfig.from_hf({**config, "vision_config": {**VISION, "rope_parameters": {"rope_type": "linear"}}})
    with pytest.raises(ConversionError, match="multiple of 4"):
        gemma4.VisionConfig.from_hf({**config, "vision_config": {**VISION, "head_dim": 6}})
    with pytest.raises(ConversionError, match="no vision_config"):
        gemma4.VisionConfig.from_hf({"text_config": TEXT})
    with pytest.raises(ValueError, match="pooling windows"):
        gemma4.forward(random_params(ours), jnp.zeros((1, 6, 48)), jnp.zeros((1, 6, 2), jnp.int32), ours)


@pytest.mark.slow  # the gradient's compile
def test_every_parameter_gets_a_gradient_and_bfloat16_stays_close():
    """The forward is differentiable through every trained parameter (the standardization's, a buffer in
    transformers, is fixed), and in bfloat16 matmuls it stays near float32."""
    config = gemma4.VisionConfig(**VISION, standardize=True, text_hidden_size=40)
    params = random_params(config)
    pixels, positions, _ = inputs()

    def loss(p, dtype=jnp.float32):
        embeddings, valid = gemma4.forward(p, jnp.asarray(pixels), jnp.asarray(positions), config, dtype)
        return jnp.sum(jnp.where(valid[..., None], embeddings.astype(jnp.float32), 0.0) ** 2)
    grads = jax.jit(jax.grad(loss))(params)
    flat = {jax.tree_util.keystr(k): np.asarray(g) for k, g in jax.tree_util.tree_flatten_with_path(grads)[0]}
    fixed = {"['std_bias']", "['std_scale']"}
    dead = [k for k, g in flat.items() if k not in fixed and (not np.all(np.isfinite(g)) or not np.any(g))]
    assert not dead, f"no gradient reaches {dead}"
    assert not any(np.any(flat[k]) for k in fixed)
    full, half = jax.jit(loss)(params), jax.jit(lambda p: loss(p, jnp.bfloat16))(params)
    assert abs(float(half) - float(full)) < 0.05 * abs(float(full))


def test_a_fresh_init_clips_nothing_and_marks_its_bounds_fixed():
    """A tower initialized from scratch with use_clipped_linears (no checkpoint yet) computes what the unclipped
    tower computes: its bounds start at the dtype's extremes; they and the standardization are fixed tensors."""
    clipped = gemma4.VisionConfig(**VISION, use_clipped_linears=True, standardize=True, text_hidden_size=40)
    plain = gemma4.VisionConfig(**VISION, standardize=True, text_hidden_size=40)
    params = params_lib.init_params(gemma4.param_specs(clipped), jax.random.key(0), jnp.float32)
    unclipped = {**params, "blocks": {k: v for k, v in params["blocks"].items() if k != "clip"}}
    pixels, positions, _ = inputs()
    run = jax.jit(gemma4.forward, static_argnums=3)
    np.testing.assert_array_equal(run(params, pixels, positions, clipped)[0], run(unclipped, pixels, positions, plain)[0])
    fixed = params_lib.fixed_paths(gemma4.param_specs(clipped))
    assert "['blocks']['clip']['q_proj']['input_min']" in fixed and "['std_scale']" in fixed
    assert "['blocks']['wq']" not in fixed


@pytest.mark.slow  # two compiled backward passes
def test_remat_keeps_the_gradients_and_drops_the_blocks_attention_weights():
    """With remat the backward recomputes each block (the same values and gradients) and holds one block's
    [images, heads, M, M] attention weights, not every block's: the compiled gradient's temporaries shrink (issue 59;
    without the checkpoint both runs hold the same)."""
    config = gemma4.VisionConfig(**{**VISION, "num_hidden_layers": 4}, text_hidden_size=40)
    params = random_params(config)
    pixels, positions = (jnp.asarray(a) for a in inputs()[:2])

    def loss(p, remat):
        embeddings, valid = gemma4.forward(p, pixels, positions, config, remat=remat)
        return jnp.sum(jnp.where(valid[..., None], embeddings, 0.0) ** 2), embeddings
    check_remat_keeps_gradients_and_shrinks_temps(loss, params)
