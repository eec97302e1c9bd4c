"""The image scheme of a model's tower, for image conversations and image prompts (data/image_conversations.py,
image_prompts.py): for_tower reads the tower's config (the vision_config model key) and preprocessor_config.json
and gives its TowerImages, which maps an image to the tower's patch arrays and placeholders and says how its images
sit in a batch (data/image_layout.py). The schemes themselves: images.py (Qwen-VL, Gemma 4), images_llama4.py."""

from __future__ import annotations

import dataclasses

import numpy as np

from maxtrain.data import images_llama4
from maxtrain.data.errors import DataError
from maxtrain.data.images import (QWEN3_VL, Gemma4VisionPreprocess, QwenVisionPreprocess, gemma4, qwen_vl)


@dataclasses.dataclass(frozen=True)
class TowerImages:
    """A tower's image -> (patch arrays {name: [patches, ...]}, grid (t, h, w), placeholder count, token texts),
    picklable, with how its images sit in a batch: block None: each image takes its grid's t*h*w patches (Qwen's);
    block M: each takes a fixed block of M patches (Gemma 4's padded max_soft_tokens x pooling**2), grid (1, 1, M);
    tile M (Llama 4's): each takes whole tiles of M patches, grid (tiles, s, s), Vision.inputs reading the tiles.
    `wrap`: the tokens the processor writes around each image's placeholders (Gemma 4's begin- and end-of-image),
    or (). The token texts are () where the image becomes wrap + its placeholders; else (Llama 4) the whole text
    the processor writes for the image (begin, tiles' placeholders and separators, end), in place of `marker`
    (the text a chat template writes for an image; "" for the image token's own)."""
    preprocess: object
    spec: object
    block: int | None = None
    wrap: tuple = ()
    tile: int | None = None
    marker: str = ""
    texts: tuple = ()  # the pieces of its image texts, the first and last each image's begin and end (Llama 4's)

    @property
    def keys(self) -> tuple[str, ...]:
        """The patch arrays' names (transformers' forward-argument names)."""
        return ("pixel_values",) if self.block is None else ("pixel_values", "image_position_ids")

    @property
    def unit(self) -> int | None:
        """The patches an image's patch count is a multiple of (Gemma 4's block, Llama 4's tile), or None."""
        return self.block or self.tile

    def __call__(self, image):
        return self.preprocess(image, self.spec)


def _qwen_image(image, spec: QwenVisionPreprocess):
    out = qwen_vl(image, spec)
    return {"pixel_values": out.pixel_values}, out.grid_thw, out.num_tokens, ()


def _gemma4_image(image, spec: Gemma4VisionPreprocess):
    out = gemma4(image, spec)
    return ({"pixel_values": out.pixel_values, "image_position_ids": out.position_ids.astype(np.int32)},
            (1, 1, spec.max_patches), out.num_tokens, ())


GEMMA4_KEYS = {"patch_size", "pooling_kernel_size", "position_embedding_size"}


def for_tower(vision_config: dict, processor: dict | None) -> TowerImages:
    """The image preprocessing of a tower of `vision_config` (the vision_config model key, as JSON-decoded): Qwen's
    patches (a tower with temporal_patch_size and spatial_merge_size: Qwen2-VL, Qwen3-VL, Qwen3.5), with
    preprocessor_config.json's keys where given, else Qwen3-VL's, and the tower's own patch, frame and merge sizes;
    Gemma 4's (the key holding its tower's config and its token_ids: boi and eoi), with preprocessor_config.json's
    max_soft_tokens (else 280) and the tower's patch and pooling sizes; Llama 4's tiles (a tower with
    pixel_shuffle_ratio), with preprocessor_config.json's max_patches (else 16) and the tower's tile and patch
    sizes."""
    if {"pixel_shuffle_ratio", "image_size", "vision_output_dim"} <= set(vision_config):  # Llama 4's tiles
        spec = images_llama4.from_tower(vision_config, processor)
        return TowerImages(images_llama4.tower_image, spec, tile=images_llama4.patches_per_tile(spec),
                           marker=images_llama4.MARKER, texts=images_llama4.PIECES)
    inner = vision_config.get("vision_config")
    if isinstance(inner, dict) and GEMMA4_KEYS <= set(inner) and "token_ids" in vision_config:
        ids = vision_config["token_ids"]
        keys = {**(processor or {}), "patch_size": inner["patch_size"],
                "pooling_kernel_size": inner["pooling_kernel_size"]}
        spec = Gemma4VisionPreprocess.from_config(keys)
        return TowerImages(_gemma4_image, spec, spec.max_patches, (ids["boi_token_id"], ids["eoi_token_id"]))
    if not {"patch_size", "temporal_patch_size", "spatial_merge_size"} <= set(vision_config):
        raise DataError(f"image conversations are not wired for this image tower (vision_config keys "
                        f"{sorted(vision_config)[:6]}...): only towers with Qwen's patches (patch_size, "
                        "temporal_patch_size, spatial_merge_size), Gemma 4's and Llama 4's read training images yet")
    keys = {**QWEN3_VL, **(processor or {}), "patch_size": vision_config["patch_size"],
            "temporal_patch_size": vision_config["temporal_patch_size"],
            "merge_size": vision_config["spatial_merge_size"]}
    return TowerImages(_qwen_image, QwenVisionPreprocess.from_config(keys))
