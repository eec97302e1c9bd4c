"""How an image conversation's images sit in an element and in the model's inputs (data/image_conversations.py), for
the layouts of towers.TowerImages:

    Qwen's grids (block None)   each image takes its grid's t*h*w patches; Vision.inputs(config, ids,
                                pixel_values [patches, ...], image_grid_thw [images, 3], pad_to=patches)
    Gemma 4's blocks (block M)  each image takes a fixed block of M patches (the processor's padded
                                max_soft_tokens x pooling**2, grid (1, 1, M)); Vision.inputs(config, ids,
                                pixel_values [images, M, ...], image_position_ids [images, M, 2], pad_to=images)

An element's patch arrays (pixel_values, and Gemma 4's image_position_ids) are flat [patches, ...] either way, so
that packing counts patches alike: a row of image_patches_per_row patches holds image_patches_per_row / M of Gemma
4's images. Llama 4's tiles travel as their patches too (data/images_llama4.py patches_of), each image whole tiles
of s^2 patches (grid (tiles, s, s)), put back into tiles [tiles, C, S, S] for Vision.inputs(config, ids,
pixel_values, pad_to=tiles); its image text (begin, the tiles' placeholders and separators, end) replaces the chat
template's marker (expand_texts). A batch lays out each packed row's images alone (model_inputs on that row's tokens [1, T], pad_to =
image_patches_per_row) in the row's own slot [b, X, ...]; the model gives row r's placeholders row r's features
(models/image_batch.py), so the layout does not depend on which host, or shard, makes the other rows. Hence
image_patches_per_row is a whole number of Gemma 4's blocks, of Llama 4's tiles, and of Qwen's merge windows
(merge_size**2 patches).
"""

from __future__ import annotations

import numpy as np

from maxtrain.data import images_llama4
from maxtrain.data.errors import DataError

GRIDS = "image_grids"
TEXT = ("tokens", "weights", "parts", "positions")


def check_row_budget(tower, patches_per_row: int) -> None:
    """A one-line DataError when image_patches_per_row is not a whole number of the tower's image blocks (Gemma 4),
    tiles (Llama 4) or merge windows (Qwen's merge_size**2 patches: a row's slot is laid out alone)."""
    window = getattr(tower.spec, "merge_size", 1) ** 2 if tower.unit is None else 1
    if patches_per_row < window or patches_per_row % window:
        fit = max(window, patches_per_row // window * window)
        raise DataError(f"image_patches_per_row={patches_per_row} is not a multiple of the tower's {window} patches "
                        f"merged into one token (spatial_merge_size squared): each row's images are laid out in "
                        f"their own slot; set it to a multiple of {window}, e.g. {fit}")
    if tower.block is not None and (patches_per_row < tower.block or patches_per_row % tower.block):
        raise DataError(f"image_patches_per_row={patches_per_row} is not a multiple of the {tower.block} patches each "
                        f"image of this tower takes (its processor pads every image to max_soft_tokens x pooling**2 "
                        f"patches); set it to {tower.block} x the images a packed row holds, e.g. {tower.block}")
    if tower.tile is not None and (patches_per_row < tower.tile or patches_per_row % tower.tile):
        most = (tower.spec.max_tiles + (tower.spec.max_tiles > 1)) * tower.tile
        raise DataError(f"image_patches_per_row={patches_per_row} is not a whole number of the tower's tiles of "
                        f"{tower.tile} patches; set it to {tower.tile} x the tiles a packed row holds, e.g. {most} "
                        f"(one image of the processor's max_patches={tower.spec.max_tiles} tiles and its global view)")


def model_inputs(vision, config, tower, tokens, arrays: dict, grids, pad_to: int | None = None) -> tuple:
    """Vision.inputs for tokens [B, T] and the flat patch arrays of their images, in order: (positions, images);
    pad_to counts patches (the images' arrays padded to it). A batch calls it once per row (tokens [1, T])."""
    grids = np.asarray(grids, np.int64).reshape(-1, 3)
    if tower.tile is not None:  # Llama 4: the patches back into tiles [tiles, C, S, S]
        return vision.inputs(config, tokens, images_llama4.tiles_of(arrays["pixel_values"], tower.spec),
                             pad_to=None if pad_to is None else pad_to // tower.tile)
    if tower.block is None:
        return vision.inputs(config, tokens, arrays["pixel_values"], grids, pad_to=pad_to)
    blocks = {k: np.asarray(v).reshape((-1, tower.block) + np.shape(v)[1:]) for k, v in arrays.items()}
    return vision.inputs(config, tokens, **blocks, pad_to=None if pad_to is None else pad_to // tower.block)


def spans(tokens, image_token_id: int, lead: int = 0, bounds: tuple = ()) -> list[tuple[int, int]]:
    """(the first token, the last placeholder) of each image of `tokens`: with `bounds` (begin, end ids: Llama 4's
    <|image_start|> and <|image_end|>) from each begin to the token before its end; else each run of placeholders,
    `lead` tokens before it (Gemma 4's begin-of-image)."""
    tokens = np.asarray(tokens)
    if bounds:
        return [(int(s), int(e) - 1) for s, e in zip(np.flatnonzero(tokens == bounds[0]),
                                                     np.flatnonzero(tokens == bounds[1]))]
    image = tokens == image_token_id
    starts = np.flatnonzero(image & ~np.concatenate([[False], image[:-1]]))
    ends = np.flatnonzero(image & ~np.concatenate([image[1:], [False]]))
    return [(int(s) - lead, int(e)) for s, e in zip(starts, ends)]


def cut(element: dict, length: int, image_token_id: int, lead: int = 0, bounds: tuple = ()) -> tuple[dict, bool]:
    """The element cut to at most `length` tokens, and before any image whose placeholders would not all be inputs
    (the last token of a row is only a target): the images after the cut are dropped, with the tokens written
    before each image's placeholders (`spans`: Gemma 4's begin-of-image, Llama 4's whole image text)."""
    tokens = element["tokens"]
    if len(tokens) <= length:
        return element, False
    keep, end = None, length
    for i, (s, e) in enumerate(spans(tokens, image_token_id, lead, bounds)):
        if e >= length - 1:
            keep, end = i, min(length, max(s, 0))
            break
    keep = len(element[GRIDS]) if keep is None else keep
    patches = int(sum(np.prod(g) for g in element[GRIDS][:keep]))
    return {k: v[:keep] if k == GRIDS else v[:end] if k in TEXT else v[:patches] for k, v in element.items()}, True


def expand_texts(tokens, weights, marker_id: int, images: list, where: str, marker: str):
    """Each `marker` token replaced by its image's token ids (images: one id sequence per image, in order: Llama 4's
    begin, tiles' placeholders and separators, end, as Llama4Processor writes them), weight 0."""
    at = np.flatnonzero(np.asarray(tokens) == marker_id)
    if len(at) != len(images):
        raise DataError(f"{where}: the chat template wrote {len(at)} image markers ({marker!r}, id {marker_id}) for "
                        f"{len(images)} images; use the checkpoint's own chat template (or a built-in one) with a "
                        "tokenizer that holds the marker as one piece")
    out_tokens, out_weights, last = [], [], 0
    for i, ids in zip(at, images):
        out_tokens += [tokens[last:i], np.asarray(ids, np.int64)]
        out_weights += [weights[last:i], np.zeros(len(ids), np.float32)]
        last = i + 1
    out_tokens.append(tokens[last:])
    out_weights.append(weights[last:])
    return np.concatenate(out_tokens).astype(np.int32), np.concatenate(out_weights).astype(np.float32)


def piece_ids(tokenizer, texts, where: str) -> dict:
    """{text: id} of the pieces an image's text is made of, each one piece of the tokenizer (a DataError naming the
    missing one)."""
    out = {}
    for text in texts:
        i = tokenizer.piece_id(text)
        if i is None:
            raise DataError(f"{where}: the tokenizer has no {text!r} piece, which the image tower's processor writes "
                            "for each image; use the checkpoint's own tokenizer")
        out[text] = i
    return out
