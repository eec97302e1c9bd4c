"""Decoding from a prompt with an image for Llama 4 (models/sampling.generate with the prompt's image inputs as
data/image_prompts.py lays them out: the prompt's <|image|> becoming the whole image text Llama4Processor writes,
the tiles [tiles, C, S, S]): greedy tokens equal the argmax of the full forward over the prompt and the tokens
generated (teacher forced), on a tiny random model with its tower; a different image gives different logits (the
control). Against transformers: test_llama4_vl.py."""

import json

import jax
import numpy as np
import pytest

from conftest import BASE_YML
from llama4_image_helpers import PROCESSOR, SPECIAL, SYMBOLS, model_keys
from maxtrain.config import ConfigError, load_config
from maxtrain.data import image_prompts, images_llama4
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from vlm_helpers import check_greedy_decode_is_forward_argmax

pytest.importorskip("PIL")
START, MARKER, PATCH, X, Y, END = (SPECIAL.index(s) for s in SYMBOLS)


class Pieces:
    """The tokenizer calls prompt_with_image makes (a tokenizer's own, for ids it holds as one piece)."""

    @staticmethod
    def piece(i):
        return SPECIAL[i] if i < len(SPECIAL) else f"<{i}>"

    @staticmethod
    def piece_id(text):
        return SPECIAL.index(text) if text in SPECIAL else None


def decoding(tmp_path, path=""):
    """The decode config; tmp_path holds preprocessor_config.json (tiles of 16 pixels, at most 4), read from beside
    tokenizer_path as for a checkpoint."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    return load_config([BASE_YML, "decoder_block=llama4", *[f"{k}={v}" for k, v in model_keys().items()],
                        "max_target_length=128", "dtype=float32", "weight_dtype=float32", "attention=dot_product",
                        f"prompt_image={path}", f"tokenizer_path={tmp_path}"], command="maxtrain.decode")


def tiny(tmp_path, path=""):
    """The config, the model, its params and runtime."""
    config = decoding(tmp_path, path)
    model = Model.bind(config)
    return config, model, model.init_params(jax.random.PRNGKey(0)), Runtime.from_config(config)


def png(path, seed, size=(24, 40)):
    from PIL import Image  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
    return str(path)


def test_an_image_prompt_is_laid_out_as_llama4s_processor(tmp_path):
    from PIL import Image  # pylint: disable=import-outside-toplevel

    config = decoding(tmp_path, png(tmp_path / "a.png", 0))
    prompt = [50, 51, MARKER, 52]
    ids, arrays = image_prompts.prompt_with_image(config, Pieces, prompt)
    # 24 x 40 pixels: 2 x 2 tiles of 16 (the canvas 32 x 48 fits it best), then the global view; 4 tokens a tile
    tile = [PATCH] * 4
    image = [START, *tile, X, *tile, Y, *tile, X, *tile, Y, MARKER, *tile, END]
    assert ids == [50, 51, *image, 52]
    want = images_llama4.llama4(Image.open(tmp_path / "a.png"),
                                images_llama4.Llama4VisionPreprocess.from_config({**PROCESSOR, "patch_size": 4}))
    assert want.aspect_ratio == (2, 2) and list(arrays) == ["pixel_values"]
    np.testing.assert_array_equal(arrays["pixel_values"], want.pixel_values)  # [5, 3, 16, 16]
    with pytest.raises(ConfigError, match=r"the prompt holds 2 image tokens \('<\|image\|>'.*prompt='<\|image\|>"):
        image_prompts.prompt_with_image(config, Pieces, [MARKER, 50, MARKER])
    with pytest.raises(ConfigError, match=r"holds 0 image tokens"):  # the placeholder is not what a prompt writes
        image_prompts.prompt_with_image(config, Pieces, [PATCH, 50])


@pytest.mark.slow  # the jitted decoding loop, the tower and the forward compile in ~30 s on two shared cores
def test_greedy_decode_from_a_llama4_image_prompt_is_the_full_forwards_argmax(tmp_path):
    config, model, params, rt = tiny(tmp_path, png(tmp_path / "a.png", 0))
    prompt = [20, 17, 42, MARKER, 27, 99, 30]  # ids past the special tokens
    ids, arrays = image_prompts.prompt_with_image(config, Pieces, prompt)
    assert ids.count(PATCH) == 20 and arrays["pixel_values"].shape == (5, 3, 16, 16)
    positions, images = model.family.vision.inputs_named(config, np.array([ids]), arrays)
    # the control: another image, the same prompt
    other = image_prompts.prompt_with_image(config.replace(prompt_image=png(tmp_path / "b.png", 1)), Pieces, prompt)[1]
    _, images_b = model.family.vision.inputs_named(config, np.array([ids]), other)
    check_greedy_decode_is_forward_argmax(model, params, rt, ids, images, positions, images_b)
