"""A prompt with an image, for maxtrain.decode (prompt_image): the image read and laid out as an image conversation's
(data/image_conversations.py: open_image, the tower's preprocessor), and the prompt's one image token expanded to the
image's placeholders, as `expand` does for a rendered chat (and as transformers' processors do).

    ids, arrays = image_prompts.prompt_with_image(config, tokenizer, prompt_ids)

arrays holds the image under transformers' forward-argument names, which the family's contract.Vision.inputs_named
lays out for the model: Qwen's towers (qwen3_vl, qwen3_5, qwen3_5_moe) {pixel_values [patches, ...], image_grid_thw
[1, 3]}, the image token becoming its merged-patch count of image tokens; Gemma 4's (gemma4) {pixel_values [1, M, ...],
image_position_ids [1, M, 2]} (one fixed block of M patches), the image token becoming begin-of-image, its soft-token
count of image tokens and end-of-image, as Gemma4Processor writes them; Llama 4's (llama4) {pixel_values [tiles, C,
S, S]} (the image's tiles, then its global view when it has several), the prompt's <|image|> becoming the whole image
text Llama4Processor writes (<|image_start|>, each tile's <|patch|> tokens with <|tile_x_separator|> between the
tiles of a row and <|tile_y_separator|> after each row, <|image|> and the global view's, <|image_end|>).
"""

from __future__ import annotations

import os

import numpy as np

from maxtrain.data import image_conversations, image_layout, images_llama4
from maxtrain.errors import ConfigError


def prompt_with_image(config, tokenizer, prompt_ids: list[int]) -> tuple[list[int], dict]:
    """(prompt_ids with its image token expanded to the image's placeholders, the image's arrays) for the image at
    config.prompt_image (a path, relative to the working directory)."""
    path, image_id = config.prompt_image, config.image_token_id
    if image_id < 0:
        raise ConfigError(f"prompt_image={path!r}: image_token_id is -1; set it to the id of the image placeholder "
                          "token (Qwen's <|image_pad|>, Gemma 4's image soft token, Llama 4's <|patch|>), as "
                          "scripts/convert_hf.py import writes it")
    tower = image_conversations.preprocessor(config)
    ids = image_layout.piece_ids(tokenizer, tower.texts, f"prompt_image={path!r}") if tower.texts else {}
    marker = ids.get(tower.marker, image_id)  # the token the prompt writes for the image (Llama 4's <|image|>)
    text = tokenizer.piece(marker)
    count = list(prompt_ids).count(marker)
    if count != 1:
        example = text if tower.wrap or tower.marker else f"<|vision_start|>{text}<|vision_end|>"
        raise ConfigError(f"prompt_image={path!r}: the prompt holds {count} image tokens ({text!r}, id {marker}); "
                          f"write it once where the image goes, e.g. prompt='{example}Describe the image.'")
    image = image_conversations.open_image(path, os.getcwd(), "prompt_image", 0, config.max_image_pixels)
    arrays, grid, placeholders, texts = tower(image)
    if ids:  # Llama 4: the processor's whole image text in place of <|image|>; the tiles [tiles, C, S, S]
        tokens, _ = image_layout.expand_texts(np.asarray(prompt_ids), np.ones(len(prompt_ids), np.float32), marker,
                                              [[ids[t] for t in texts]], "prompt_image", text)
        return [int(t) for t in tokens], {"pixel_values": images_llama4.tiles_of(arrays["pixel_values"], tower.spec)}
    tokens, _ = image_conversations.expand(np.asarray(prompt_ids), np.ones(len(prompt_ids), np.float32), image_id,
                                           [placeholders], "prompt_image", text, tower.wrap)
    ids = [int(t) for t in tokens]
    if tower.block is not None:  # one image: its fixed block of patches, under the forward's names
        return ids, {k: np.asarray(arrays[k])[None] for k in tower.keys}
    return ids, {"pixel_values": arrays["pixel_values"], "image_grid_thw": np.asarray([grid], np.int64)}
