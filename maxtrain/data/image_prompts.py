"""A prompt with an image, for maxtrain.decode (prompt_image): the image read and laid out as an image conversation's
(data/image_conversations.py: open_image, the tower's preprocessor), and the prompt's one image token expanded to the
image's placeholder count, as `expand` does for a rendered chat.

    ids, arrays = image_prompts.prompt_with_image(config, tokenizer, prompt_ids)

arrays holds the image under transformers' forward-argument names (pixel_values, image_grid_thw), which the family's
contract.Vision.inputs_named lays out for the model. Towers with Qwen's patches (qwen3_vl, qwen3_5, qwen3_5_moe) only
(Gemma 4's, which training reads, is refused here in one line).
"""

from __future__ import annotations

import os

import numpy as np

from maxtrain.data import image_conversations
from maxtrain.errors import ConfigError


def prompt_with_image(config, tokenizer, prompt_ids: list[int]) -> tuple[list[int], dict]:
    """(prompt_ids with its image token repeated to the image's placeholder count, {pixel_values, image_grid_thw})
    for the image at config.prompt_image (a path, relative to the working directory)."""
    path, image_id = config.prompt_image, config.image_token_id
    if image_id < 0:
        raise ConfigError(f"prompt_image={path!r}: image_token_id is -1; set it to the id of the image placeholder "
                          "token (<|image_pad|>), as scripts/convert_hf.py import writes it")
    text = tokenizer.piece(image_id)
    count = list(prompt_ids).count(image_id)
    if count != 1:
        raise ConfigError(f"prompt_image={path!r}: the prompt holds {count} image tokens ({text!r}, id {image_id}); "
                          f"write it once where the image goes, e.g. prompt='<|vision_start|>{text}<|vision_end|>"
                          "Describe the image.'")
    image = image_conversations.open_image(path, os.getcwd(), "prompt_image", 0, config.max_image_pixels)
    tower = image_conversations.preprocessor(config)
    if tower.block is not None:
        raise ConfigError(f"prompt_image={path!r}: decoding with an image prompt is wired for towers with Qwen's "
                          f"patches only (qwen3_vl, qwen3_5, qwen3_5_moe), not decoder_block={config.decoder_block}; "
                          "decode from a text prompt")
    arrays, grid, placeholders = tower(image)
    pixels = arrays["pixel_values"]
    tokens, _ = image_conversations.expand(np.asarray(prompt_ids), np.ones(len(prompt_ids), np.float32), image_id,
                                           [placeholders], "prompt_image", text)
    return [int(t) for t in tokens], {"pixel_values": pixels, "image_grid_thw": np.asarray([grid], np.int64)}
