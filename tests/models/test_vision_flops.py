"""The image towers' FLOPs per image (contract.Vision.flops, Model.vision_flops) against XLA's count of the tower's
forward and backward (compiled cost analysis, as tests/models/test_presets.py checks the text decoders), within 5%:
XLA also counts the elementwise work the formulas leave out (norms, softmax, activations, RoPE). One block per tower:
XLA's cost analysis counts a scanned loop's body once. A frozen tower (vision_freeze=[tower]) runs forward only; the
whole tower's backward is marked slow (its compile), the frozen parts' checks are not."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.config import load_config
from maxtrain.models.families import FAMILIES
from maxtrain.models.model import Model
from maxtrain.models.params import init_params
from maxtrain.models.vision import gemma4, llama4, qwen
from maxtrain.observability import metrics


def xla_flops(fn, *args) -> float:
    """XLA's FLOPs of jit(fn)(*args), compiled for this machine."""
    cost = jax.jit(fn).lower(*args).compile().cost_analysis()
    return (cost[0] if isinstance(cost, list) else cost)["flops"]


def training_flops(forward, params, trains) -> float:
    """XLA's FLOPs of the gradient of sum(forward(params)) for the parameters `trains` selects (the rest fixed)."""
    def loss(trained, fixed):
        outputs = forward({**fixed, **trained})
        return sum(jnp.sum(o.astype(jnp.float32)) for o in jax.tree.leaves(outputs))
    trained = {k: v for k, v in params.items() if trains(k)}
    fixed = {k: v for k, v in params.items() if not trains(k)}
    return xla_flops(jax.grad(loss), trained, fixed)


# (wide enough that the matmuls dwarf the elementwise work XLA also counts: jax 0.12 counts more of it than 0.10)
QWEN = qwen.VisionConfig(depth=1, hidden_size=128, num_heads=4, intermediate_size=256, out_hidden_size=128,
                         patch_size=2, temporal_patch_size=1, spatial_merge_size=2, num_position_embeddings=16,
                         deepstack_visual_indexes=(0,))


def bound(family: str, vision_config: str, freeze=(), lora_rank=0) -> Model:
    """The family's Model reading `vision_config` (the model keys Model.vision_flops and the family's tower read)."""
    config = types.SimpleNamespace(vision_config=vision_config, vision_freeze=list(freeze), lora_rank=lora_rank,
                                   decoder_block=family, base_emb_dim=64)
    return Model(FAMILIES[family], config, ())


def qwen_model(freeze=(), lora_rank=0) -> Model:
    return bound("qwen3_vl", json.dumps({**QWEN.to_hf(), "model_type": "qwen3_vl"}), freeze, lora_rank)


SLOW = pytest.mark.slow  # the whole tower's backward compiles in ~10 s on two shared cores


@pytest.mark.parametrize("freeze", [pytest.param((), marks=SLOW), ("tower",), ("projector",)])
def test_qwen_tower_flops_match_xla(freeze):
    """Training FLOPs of one 8 x 10 image (80 patches): everything training, the tower frozen (its forward; the
    mergers train whole, their LayerNorms first), the projector frozen (its input's gradient, not its weights')."""
    grid = np.array([[1, 8, 10]])
    params = init_params(qwen.param_specs(QWEN), jax.random.PRNGKey(0), jnp.float32)
    pixels = jax.random.normal(jax.random.PRNGKey(1), (80, QWEN.patch_dim))
    projector = FAMILIES["qwen3_vl"].vision.projector
    trains = {(): lambda k: True, ("tower",): lambda k: k in projector,
              ("projector",): lambda k: k not in projector}[freeze]
    xla = training_flops(lambda p: qwen.forward(p, pixels, grid, QWEN), params, trains)
    formula = qwen_model(freeze).vision_flops(80)
    print(f"qwen {freeze}: XLA {xla:.4g}, formula {formula:.4g} ({xla / formula - 1:+.1%})")
    assert xla == pytest.approx(formula, rel=0.05)


def test_a_frozen_tower_counts_its_forward_alone():
    """Frozen by vision_freeze or by LoRA (which leaves the tower and projector as they are), the tower and projector
    count one forward; training, three."""
    forward = qwen.flops(QWEN, 80)
    once = forward["tower"] + forward["projector"]
    assert qwen_model(("tower", "projector")).vision_flops(80) == pytest.approx(once)
    assert qwen_model(lora_rank=4).vision_flops(80) == pytest.approx(once)
    assert qwen_model().vision_flops(80) == pytest.approx(3 * once)
    assert qwen_model().vision_flops(0) == 0.0


# (no pixel shuffle, so that its MLP is as wide as its blocks: XLA counts each exact GELU as tens of FLOPs)
LLAMA4 = llama4.VisionConfig(hidden_size=512, num_hidden_layers=1, num_attention_heads=8, intermediate_size=512,
                             image_size=16, patch_size=2, pixel_shuffle_ratio=1.0, projector_input_dim=128,
                             projector_output_dim=128, vision_output_dim=128, text_hidden_size=64)
GEMMA4 = gemma4.VisionConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=32, pooling_kernel_size=2, patch_size=2,
                             position_embedding_size=16, text_hidden_size=64)


@pytest.mark.parametrize("freeze", [pytest.param((), marks=SLOW), ("tower",)])
def test_llama4_tower_flops_match_xla(freeze):
    """Two tiles of 8 x 8 patches (the class token beside each), the pixel-shuffle adapter and the projector; the
    tower frozen: its forward, the projector's forward and weight gradient."""
    params = init_params(llama4.param_specs(LLAMA4), jax.random.PRNGKey(0), jnp.float32)
    pixels = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 16, 16))
    xla = training_flops(lambda p: llama4.forward(p, pixels, LLAMA4), params,
                         lambda k: not freeze or k == "projector")
    formula = bound("llama4", json.dumps(LLAMA4.to_hf()), freeze).vision_flops(128)
    print(f"llama4 {freeze}: XLA {xla:.4g}, formula {formula:.4g} ({xla / formula - 1:+.1%})")
    assert xla == pytest.approx(formula, rel=0.05)
    with pytest.raises(ValueError, match="whole tiles"):
        llama4.flops(LLAMA4, 100)


@SLOW
def test_gemma4_tower_flops_match_xla():
    """One image of 8 x 6 patches padded to 64 (the encoder computes the padding rows), 2 x 2 pooling."""
    params = init_params(gemma4.param_specs(GEMMA4), jax.random.PRNGKey(0), jnp.float32)
    column, row = np.meshgrid(np.arange(8), np.arange(6), indexing="xy")
    positions = np.pad(np.stack([column, row], -1).reshape(48, 2), [(0, 16), (0, 0)], constant_values=-1)[None]
    pixels = jax.random.uniform(jax.random.PRNGKey(1), (1, 64, GEMMA4.patch_dim))
    xla = training_flops(lambda p: gemma4.forward(p, pixels, positions, GEMMA4)[0], params, lambda k: True)
    formula = bound("gemma4", json.dumps({"vision_config": GEMMA4.to_hf()})).vision_flops(64)
    print(f"gemma4: XLA {xla:.4g}, formula {formula:.4g} ({xla / formula - 1:+.1%})")
    assert xla == pytest.approx(formula, rel=0.05)


def test_a_run_reading_images_counts_the_tower_per_row():
    """metrics.flops_per_token with image_patches_per_row: the text decoder's FLOPs per token and, spread over each
    row's tokens, the tower's for one image of the row's patch budget; a text-only model's stay the decoder's."""
    vision = json.dumps({**QWEN.to_hf(), "model_type": "qwen3_vl"})
    config = load_config([BASE_YML, "decoder_block=qwen3_vl", "base_emb_dim=64", "base_num_query_heads=4",
                          "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=96", "base_num_decoder_layers=2",
                          "vocab_size=300", "max_target_length=128", f"vision_config={vision}"])
    model = Model.bind(config)
    text = metrics.flops_per_token(model)
    assert text == model.flops_per_token() > 0
    assert metrics.flops_per_token(model, image_patches_per_row=80) == pytest.approx(
        text + 3 * sum(qwen.flops(QWEN, 80)[k] for k in ("tower", "projector")) / 128)
    plain = Model.bind(config.replace(vision_config=""))
    assert metrics.flops_per_token(plain, image_patches_per_row=80) == metrics.flops_per_token(plain)


def test_a_gemma4_run_counts_its_tower_image_by_image(tmp_path):
    """A Gemma 4 run of two fixed image blocks a row (builder.Run.flops_per_token, which the compile report and its
    MFU read): the tower's FLOPs twice for one block each, not once for one image of both blocks' patches (the old
    count: its attention and pooling grow as the square of the patches)."""
    import gemma4_image_helpers as g4  # pylint: disable=import-outside-toplevel
    from conftest import TINY  # pylint: disable=import-outside-toplevel
    from maxtrain.training import builder  # pylint: disable=import-outside-toplevel
    from post_helpers import compose  # pylint: disable=import-outside-toplevel

    pytest.importorskip("PIL.Image")
    dataset = g4.make_dataset(str(tmp_path), n=2)
    config = load_config(compose(BASE_YML, *TINY, f"base_output_directory={tmp_path}", *g4.model_args(dataset),
                                 f"image_patches_per_row={2 * g4.BLOCK}"))
    model = Model.bind(config)
    run = types.SimpleNamespace(config=config, model=model)
    text, length = model.flops_per_token(), config.max_target_length
    per_image = model.vision_flops(g4.BLOCK)
    assert builder.Run.flops_per_token(run) == pytest.approx(text + 2 * per_image / length)
    one_image = text + model.vision_flops(2 * g4.BLOCK) / length  # what a tower without fixed blocks counts
    assert metrics.flops_per_token(model, image_patches_per_row=2 * g4.BLOCK) == pytest.approx(one_image)
    assert builder.Run.flops_per_token(run) < one_image
