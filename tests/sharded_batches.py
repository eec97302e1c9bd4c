"""The same global batches for every mesh layout (the layout tests compare losses and gradients on them):
two packed documents per row, rows ending in different amounts of padding."""

from __future__ import annotations

import numpy as np

GLOBAL_BATCH = 8
STEPS = 3


def batches(cfg):
    """The same global batches for every layout: [accumulation steps, micro batch, T]."""
    rng = np.random.default_rng(0)
    for _ in range(STEPS):
        tokens = rng.integers(4, cfg.vocab_size, (1, GLOBAL_BATCH, cfg.max_target_length + 1), dtype=np.int32)
        seg = np.ones((1, GLOBAL_BATCH, cfg.max_target_length), np.int32)
        seg[:, :, 20:] = 2  # two documents per row
        positions = np.where(seg == 1, np.arange(cfg.max_target_length), np.arange(cfg.max_target_length) - 20)
        # Rows end in different amounts of padding (weight 0), so a mean of per-micro-batch means would
        # differ from the token-weighted mean the train step must compute.
        weights = np.ones(seg.shape, np.float32)
        for row in range(GLOBAL_BATCH):
            weights[:, row, cfg.max_target_length - 3 * row:] = 0.0
        batch = {"inputs": tokens[..., :-1], "targets": tokens[..., 1:], "segment_ids": seg,
                 "positions": positions.astype(np.int32), "loss_weights": weights}
        accum = cfg.gradient_accumulation_steps
        yield {k: v.reshape((accum, GLOBAL_BATCH // accum) + v.shape[2:]) for k, v in batch.items()}
