"""Decoding from a prompt with an image (models/sampling.generate with the prompt's image inputs; Qwen3-VL's tower and
M-RoPE): greedy tokens equal the argmax of the full forward over the prompt and the tokens generated (teacher forced,
M-RoPE's positions from rope_index over the whole row), on a tiny random model with deepstack; a text-only family
given images, and prompt_image for a model without a tower, are refused in one line (Gemma 4's and Llama 4's
decoding: test_decode_image_gemma4.py, test_decode_image_llama4.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import BASE_YML
from maxtrain.config import load_config
from maxtrain.models import sampling
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from maxtrain.models.vision import qwen, qwen_images

IMAGE, START, END = 290, 288, 289
VISION = qwen.VisionConfig(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
                           patch_size=4, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=(0, 1))
GRID = np.array([[1, 4, 6]])  # 6 merged tokens


def tiny(family: str, vision: bool = True):
    extra = [f"vision_config={json.dumps({**VISION.to_hf(), 'model_type': 'qwen3_vl'})}",
             f"image_token_id={IMAGE}", "mrope_section=[2,3,3]"] if vision else []
    config = load_config([BASE_YML, f"decoder_block={family}", "base_emb_dim=64", "base_num_query_heads=4",
                          "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=96", "base_num_decoder_layers=3",
                          "vocab_size=300", "max_target_length=64", "dtype=float32", "weight_dtype=float32",
                          "attention=dot_product", *extra])
    model = Model.bind(config)
    return config, model, model.init_params(jax.random.PRNGKey(0)), Runtime.from_config(config)


@pytest.mark.slow  # the jitted decoding loop and the forward compile in ~40 s on two shared cores
def test_greedy_decode_from_an_image_prompt_is_the_full_forwards_argmax():
    config, model, params, rt = tiny("qwen3_vl")
    rng = np.random.default_rng(0)
    prompt = [5, 17, 42, START] + [IMAGE] * 6 + [END] + [7, 99, 3]
    pixels = rng.standard_normal((int(GRID.prod()), VISION.patch_dim)).astype(np.float32)
    positions, images = model.family.vision.inputs(config, np.array([prompt]), pixels, GRID)
    with jax.default_matmul_precision("highest"):
        new = sampling.generate(params, prompt, model, rt, max_new_tokens=5, images=images, positions=positions)
        row = np.array([prompt + new[:-1]])
        full_positions = qwen_images.rope_index(row, GRID, IMAGE, VISION.spatial_merge_size)
        logits, _ = jax.jit(lambda p: model.forward(p, jnp.asarray(row), jnp.asarray(full_positions),
                                                    jnp.ones_like(row), rt, images=images))(params)
    assert len(new) == 5
    assert new == [int(t) for t in np.argmax(np.asarray(logits)[0, len(prompt) - 1:], axis=-1)]
    # the text after the image resumes past it (M-RoPE), not at its slot: decoding at the slots would differ
    assert full_positions[0, 0, -1] < row.shape[1] - 1


def test_a_text_family_given_images_is_refused():
    _, model, params, rt = tiny("qwen3", vision=False)
    cache = model.init_cache(1, 8, jnp.float32)
    with pytest.raises(ValueError, match="text-only family"):
        model.forward_with_cache(params, jnp.ones((1, 4), jnp.int32), jnp.arange(4)[None], cache, 0, rt,
                                 images={"pixel_values": jnp.zeros((4, 96))})


def test_maxtrain_decode_refuses_an_image_for_a_text_family():
    """prompt_image with a text-only family, an image family without its tower, or image_token_id -1: one line naming
    the families that decode with images, before any reading; llama4 with its tower passes (it was refused)."""
    from maxtrain import decode  # pylint: disable=import-outside-toplevel
    from maxtrain.data import image_prompts  # pylint: disable=import-outside-toplevel
    from maxtrain.errors import ConfigError  # pylint: disable=import-outside-toplevel

    text = load_config([BASE_YML, "decoder_block=qwen3", "prompt_image=cat.png"], command="maxtrain.decode")
    wired = "qwen3_vl, gemma4, qwen3_5, qwen3_5_moe, llama4"  # the registry's order
    with pytest.raises(ConfigError, match=f"qwen3 is a text-only family.*{wired}") as e:
        decode.check_image_family(text)
    assert "\n" not in str(e.value)
    for family in ("qwen3_vl", "gemma4"):
        with pytest.raises(ConfigError, match="no vision tower"):
            decode.check_image_family(text.replace(decoder_block=family))
    decode.check_image_family(text.replace(decoder_block="llama4", vision_config='{"patch_size": 14}'))  # passes
    decode.check_image_family(text.replace(decoder_block="gemma4", vision_config='{"vision_config": {}}'))  # passes
    with pytest.raises(ConfigError, match="image_token_id is -1.*Gemma 4's image soft token"):
        image_prompts.prompt_with_image(text.replace(decoder_block="gemma4", image_token_id=-1), None, [1, 2])
    with pytest.raises(ConfigError, match="read by maxtrain.decode"):
        load_config([BASE_YML, "prompt_image=cat.png"], command="maxtrain.train")
