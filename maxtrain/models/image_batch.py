"""A batch's image inputs as the decoder reads them (decoder.loss_fn), and how a family's Vision.embed finds the
feature each image placeholder takes.

Two layouts of `images` reach Vision.embed:

    flat     {input_key: [X, ...]}: the batch's images in token order, padding after the last (a batch made by
             hand: tests, check_logits, decode); the k-th placeholder of the batch, in row-major token order, takes
             the k-th image feature
    by row   {ROWS + input_key: [B, X, ...]}: row r's images in its own slot, padded within it (the training data,
             data/image_conversations.py; the positions [B, T, streams]); row r's k-th placeholder takes the k-th
             feature of row r's slot: feature r * (features per row) + k. A row's arrays depend on that row alone,
             so any split of the rows over hosts or data-parallel shards gives the same inputs (and the arrays shard
             with the rows)

`by_row` flattens the second into the first's arrays and says how many rows it had; `in_rows` keeps the rows (a flat
batch's images as one row), for a tower that runs each row's images as a sequence of their own (Qwen's: its attention
then costs B X^2, not (B X)^2); `placeholder_index` gives each placeholder its feature for either.
"""

from __future__ import annotations

import jax.numpy as jnp

ROWS = "rows_"  # the prefix of a batch's image arrays stored by row (data/image_conversations.py)


def images(model, batch: dict):
    """The batch's image inputs ({ROWS + Vision.input_keys: [B, X, ...]} by row, or the flat keys of a batch made
    by hand), or None when it has no pixel_values (the decoder refuses images for a text-only family, which then
    reads pixel_values alone)."""
    keys = model.family.vision.input_keys if model.family.vision is not None else ("pixel_values",)
    if ROWS + "pixel_values" in batch:
        return {ROWS + k: batch[ROWS + k] for k in keys}
    if "pixel_values" not in batch:
        return None
    return {k: batch[k] for k in keys}


def in_rows(images: dict, keys: tuple, batch_rows: int) -> tuple[dict, int | None]:
    """({key: [B, X, ...]}, B) from images by row {ROWS + key: [B, X, ...]}; ({key: [1, X, ...]}, None) for flat
    ones (the batch's images one row, in their order). A ValueError when the images' rows are not the tokens'
    batch_rows."""
    if ROWS + keys[0] not in images:
        return {k: images[k][None] for k in keys if k in images}, None
    rows = images[ROWS + keys[0]].shape[0]
    if rows != batch_rows:
        raise ValueError(f"the images are laid out for {rows} rows but the tokens have {batch_rows}; make them by row "
                         "with the batch (data/image_conversations.py), or give them flat")
    return {k: images[ROWS + k] for k in keys if ROWS + k in images}, rows


def by_row(images: dict, keys: tuple, batch_rows: int) -> tuple[dict, int | None]:
    """(the images flat {key: [B * X, ...]}, B) from images by row {ROWS + key: [B, X, ...]}; (images, None) for
    flat ones. A ValueError when the images' rows are not the tokens' batch_rows."""
    if ROWS + keys[0] not in images:
        return images, None
    arrays, rows = in_rows(images, keys, batch_rows)
    return {k: v.reshape((-1,) + v.shape[2:]) for k, v in arrays.items()}, rows


def placeholder_index(mask, rows: int | None, features: int):
    """[B, T] int32: the feature (of `features` in all) each placeholder of mask [B, T] takes, clipped into range
    (non-placeholders read a row they do not use): flat (rows None), the batch's k-th placeholder in token order
    takes feature k; by row, row r's k-th takes feature r * features / rows + k."""
    if rows is None:
        order = jnp.cumsum(mask.reshape(-1)).reshape(mask.shape) - 1
    else:
        order = jnp.cumsum(mask, axis=1) - 1 + jnp.arange(mask.shape[0])[:, None] * (features // rows)
    return jnp.clip(order, 0, features - 1)


def positions(batch: dict):
    """The batch's positions: [B, T], or M-RoPE's streams [streams, B, T] (the data's [B, T, streams] moved)."""
    if ROWS + "pixel_values" in batch and batch["positions"].ndim == 3:
        return jnp.moveaxis(batch["positions"], -1, 0)
    return batch["positions"]
