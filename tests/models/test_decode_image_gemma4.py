"""Decoding from a prompt with an image for Gemma 4 (models/sampling.generate with the prompt's image inputs as
data/image_prompts.py lays them out: boi, the soft tokens, eoi; the tower's fixed block of patches): greedy tokens
equal the argmax of the full forward over the prompt and the tokens generated (teacher forced), on a tiny random
model with its tower; a different image gives different logits (the control). Against transformers: test_gemma4_vl.py.
"""

import json

import jax
import numpy as np
import pytest

from conftest import BASE_YML
from gemma4_image_helpers import PROCESSOR, TEXT, VISION
from maxtrain.config import load_config
from maxtrain.data import image_prompts
from maxtrain.models.families import gemma4
from maxtrain.models.model import Model
from maxtrain.models.runtime import Runtime
from vlm_helpers import check_greedy_decode_is_forward_argmax

pytest.importorskip("PIL")
BOI, IMAGE, EOI = 300, 301, 302


class Pieces:
    """The two tokenizer calls prompt_with_image makes (a tokenizer's own, for ids it holds as one piece)."""

    @staticmethod
    def piece(i):
        return {IMAGE: "<image_soft_token>"}.get(i, f"<{i}>")


def tiny(tmp_path, path=""):
    """The model keys, the model, its params and runtime; tmp_path holds preprocessor_config.json (the processor's
    70 soft tokens), read from beside tokenizer_path as for a checkpoint."""
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    keys = gemma4.from_hf_config({"text_config": TEXT, "vision_config": VISION, "image_token_id": IMAGE,
                                  "boi_token_id": BOI, "eoi_token_id": EOI})
    config = load_config([BASE_YML, "decoder_block=gemma4", *[f"{k}={v}" for k, v in keys.items()],
                          "max_target_length=128", "dtype=float32", "weight_dtype=float32", "attention=dot_product",
                          f"prompt_image={path}", f"tokenizer_path={tmp_path}"], command="maxtrain.decode")
    model = Model.bind(config)
    return config, model, model.init_params(jax.random.PRNGKey(0)), Runtime.from_config(config)


def png(path, seed):
    from PIL import Image  # pylint: disable=import-outside-toplevel

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.mark.slow  # the jitted decoding loop, the tower and the forward compile in ~30 s on two shared cores
def test_greedy_decode_from_a_gemma4_image_prompt_is_the_full_forwards_argmax(tmp_path):
    config, model, params, rt = tiny(tmp_path, png(tmp_path / "a.png", 0))
    prompt = [5, 17, 42, IMAGE, 7, 99, 3]
    ids, arrays = image_prompts.prompt_with_image(config, Pieces, prompt)
    # as Gemma4Processor: boi, 6 x 10 soft tokens (16 x 24 pixels -> 48 x 80 -> 12 x 20 patches pooled 2 x 2), eoi
    assert ids == [5, 17, 42, BOI] + [IMAGE] * 60 + [EOI, 7, 99, 3]
    assert arrays["pixel_values"].shape == (1, 280, 48) and arrays["image_position_ids"].shape == (1, 280, 2)
    positions, images = model.family.vision.inputs_named(config, np.array([ids]), arrays)
    # the control: another image, the same prompt
    other = image_prompts.prompt_with_image(config.replace(prompt_image=png(tmp_path / "b.png", 1)), Pieces, prompt)[1]
    _, images_b = model.family.vision.inputs_named(config, np.array([ids]), other)
    check_greedy_decode_is_forward_argmax(model, params, rt, ids, images, positions, images_b)
