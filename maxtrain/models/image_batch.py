"""A batch's image inputs as the decoder reads them (decoder.loss_fn).

The training data (data/image_conversations.py) stores each of the family's Vision.input_keys as ROWS + key with a
leading row axis [B, X, ...] (the micro batch's flat layout cut into B equal parts, so that it shards with the rows)
and the positions [B, T, streams]; the model reads them flat, and the positions [streams, B, T]. A batch made by hand
(tests, check_logits) may hold the flat keys themselves.
"""

from __future__ import annotations

import jax.numpy as jnp

ROWS = "rows_"  # the prefix of a batch's image arrays stored by row (data/image_conversations.py)


def images(model, batch: dict):
    """The batch's image inputs {Vision.input_keys: flat array}, or None when it has no pixel_values (the decoder
    refuses images for a text-only family, which then reads pixel_values alone)."""
    keys = model.family.vision.input_keys if model.family.vision is not None else ("pixel_values",)
    if ROWS + "pixel_values" in batch:
        return {k: batch[ROWS + k].reshape((-1,) + batch[ROWS + k].shape[2:]) for k in keys}
    if "pixel_values" not in batch:
        return None
    return {k: batch[k] for k in keys}


def positions(batch: dict):
    """The batch's positions: [B, T], or M-RoPE's streams [streams, B, T] (the data's [B, T, streams] moved)."""
    if ROWS + "pixel_values" in batch and batch["positions"].ndim == 3:
        return jnp.moveaxis(batch["positions"], -1, 0)
    return batch["positions"]
