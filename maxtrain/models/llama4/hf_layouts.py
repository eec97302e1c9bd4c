"""Llama 4's own Hugging Face tensor layouts (models/hf.py has the Layout contract and the shared ones)."""

from __future__ import annotations

import dataclasses

import numpy as np

from maxtrain.models.hf import Columns, Linear


@dataclasses.dataclass(frozen=True)
class PairedRope(Linear):
    """A q or k projection (a Linear of n_in leading maxtrain axes) whose heads hold RoPE's pairs side by
    side, (x_2i, x_2i+1) (Llama 4's checkpoints, rotated as complex numbers), where maxtrain rotates halves,
    (x_i, x_i+H/2): each head's features are de-interleaved on import (evens, then odds) and interleaved
    again on export. q and k are permuted alike, so q.k is unchanged (as are the L2 norm and the NoPE
    layers, which read no pairs)."""

    n_in: int = 1

    def to_maxtrain(self, w: np.ndarray, shape: tuple) -> np.ndarray:
        w = super().to_maxtrain(w, shape)
        return np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)  # evens, then odds

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        half = w.shape[-1] // 2
        return super().to_hf(np.stack([w[..., :half], w[..., half:]], axis=-1).reshape(w.shape))


@dataclasses.dataclass(frozen=True)
class Halves(Columns):
    """The part-th of `parts` equal blocks of the columns: Llama 4's experts keep gate and up in one
    gate_up_proj [E, D, 2F], gate in the first F columns and up in the last F."""

    def columns(self, width: int) -> slice:
        size = width // self.parts
        return slice(self.part * size, (self.part + 1) * size)
