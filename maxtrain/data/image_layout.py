"""How an image conversation's images sit in an element and in the model's inputs (data/image_conversations.py), for
both layouts of images.TowerImages:

    Qwen's grids (block None)   each image takes its grid's t*h*w patches; Vision.inputs(config, ids,
                                pixel_values [patches, ...], image_grid_thw [images, 3], pad_to=patches)
    Gemma 4's blocks (block M)  each image takes a fixed block of M patches (the processor's padded
                                max_soft_tokens x pooling**2, grid (1, 1, M)); Vision.inputs(config, ids,
                                pixel_values [images, M, ...], image_position_ids [images, M, 2], pad_to=images)

An element's patch arrays (pixel_values, and Gemma 4's image_position_ids) are flat [patches, ...] either way, so
that packing counts patches alike: a row of image_patches_per_row patches holds image_patches_per_row / M of Gemma
4's images. A batch lays out each packed row's images alone (model_inputs on that row's tokens [1, T], pad_to =
image_patches_per_row) in the row's own slot [b, X, ...]; the model gives row r's placeholders row r's features
(models/image_batch.py), so the layout does not depend on which host, or shard, makes the other rows. Hence
image_patches_per_row is a whole number of Gemma 4's blocks, and of Qwen's merge windows (merge_size**2 patches).
"""

from __future__ import annotations

import numpy as np

from maxtrain.data.errors import DataError

GRIDS = "image_grids"
TEXT = ("tokens", "weights", "parts", "positions")


def check_row_budget(tower, patches_per_row: int) -> None:
    """A one-line DataError when image_patches_per_row is not a whole number of the tower's image blocks (Gemma 4)
    or merge windows (Qwen's merge_size**2 patches: a row's slot is laid out alone)."""
    window = getattr(tower.spec, "merge_size", 1) ** 2 if tower.block is None else 1
    if patches_per_row < window or patches_per_row % window:
        fit = max(window, patches_per_row // window * window)
        raise DataError(f"image_patches_per_row={patches_per_row} is not a multiple of the tower's {window} patches "
                        f"merged into one token (spatial_merge_size squared): each row's images are laid out in "
                        f"their own slot; set it to a multiple of {window}, e.g. {fit}")
    if tower.block is not None and (patches_per_row < tower.block or patches_per_row % tower.block):
        raise DataError(f"image_patches_per_row={patches_per_row} is not a multiple of the {tower.block} patches each "
                        f"image of this tower takes (its processor pads every image to max_soft_tokens x pooling**2 "
                        f"patches); set it to {tower.block} x the images a packed row holds, e.g. {tower.block}")


def model_inputs(vision, config, tower, tokens, arrays: dict, grids, pad_to: int | None = None) -> tuple:
    """Vision.inputs for tokens [B, T] and the flat patch arrays of their images, in order: (positions, images);
    pad_to counts patches (the images' arrays padded to it). A batch calls it once per row (tokens [1, T])."""
    grids = np.asarray(grids, np.int64).reshape(-1, 3)
    if tower.block is None:
        return vision.inputs(config, tokens, arrays["pixel_values"], grids, pad_to=pad_to)
    blocks = {k: np.asarray(v).reshape((-1, tower.block) + np.shape(v)[1:]) for k, v in arrays.items()}
    return vision.inputs(config, tokens, **blocks, pad_to=None if pad_to is None else pad_to // tower.block)


def cut(element: dict, length: int, image_token_id: int, lead: int = 0) -> tuple[dict, bool]:
    """The element cut to at most `length` tokens, and before any image whose tokens would not all be inputs (the
    last token of a row is only a target): the images after the cut are dropped, with the `lead` tokens written
    before each image's placeholders (Gemma 4's begin-of-image)."""
    tokens = element["tokens"]
    if len(tokens) <= length:
        return element, False
    image = tokens == image_token_id
    starts = np.flatnonzero(image & ~np.concatenate([[False], image[:-1]]))
    ends = np.flatnonzero(image & ~np.concatenate([image[1:], [False]]))
    keep, end = len(starts), length
    for i, (s, e) in enumerate(zip(starts, ends)):
        if e >= length - 1:
            keep, end = i, min(length, max(int(s) - lead, 0))
            break
    patches = int(sum(np.prod(g) for g in element[GRIDS][:keep]))
    return {k: v[:keep] if k == GRIDS else v[:end] if k in TEXT else v[:patches] for k, v in element.items()}, True
