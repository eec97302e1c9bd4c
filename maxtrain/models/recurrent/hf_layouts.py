"""The fused Hugging Face tensor layouts of the hybrid families (Qwen3-Next, Qwen3.5: models/recurrent/hybrid.py
and their folders); models/hf.py has the Layout contract and the layouts every family shares."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from maxtrain.models.hf import Layout


@dataclasses.dataclass(frozen=True)
class Grouped(Layout):
    """Maxtrain parameters fused, group by group, in the rows of one torch Linear weight
    [groups x group width, D] (maxtrain: [D, ...]): each group holds every part's slice in the order `parts`
    (maxtrain parameter names of the same layer), `groups` counted by the axis after D of the parameter
    `groups_of` (its heads; None: one group, the parts one after another). `lead` axes come first on both sides
    (experts stacked in one tensor: [E, rows, D] against maxtrain's [E, D, ...]). Qwen3-Next's in_proj_qkvz holds,
    per key head, its q, k, and the v and z of the value heads it serves; its q_proj holds, per head, the query
    and the output gate; Qwen3.5's experts keep gate and up in one gate_up_proj [E, 2F, D].
    It converts once resolved against the parts' shapes, as GroupRows."""

    part: int
    parts: tuple[str, ...]
    groups_of: str | None = None
    lead: int = 0

    def resolve(self, shape_of: Callable[[str], tuple]) -> GroupRows:
        shapes = {p: shape_of(p) for p in self.parts + ((self.groups_of,) if self.groups_of else ())}
        groups = shapes[self.groups_of][self.lead + 1] if self.groups_of else 1
        sizes = [math.prod(shapes[p][self.lead + 1:]) // groups for p in self.parts]
        return GroupRows(groups, sum(sizes[:self.part]), sizes[self.part], sum(sizes), self.lead)


@dataclasses.dataclass(frozen=True)
class GroupRows(Layout):
    """A Grouped layout resolved against the parameters' shapes: rows [offset, offset + size) of each of the
    `groups` groups of `total` rows."""

    groups: int
    offset: int
    size: int
    total: int
    lead: int = 0

    def hf_shape(self, shape: tuple) -> tuple:
        return (*shape[:self.lead], self.groups * self.total, shape[self.lead])

    def to_maxtrain(self, w: np.ndarray, shape: tuple) -> np.ndarray:
        lead = w.shape[:self.lead]
        rows = w.reshape(*lead, self.groups, self.total, -1)[..., self.offset:self.offset + self.size, :]
        rows = rows.reshape(*lead, self.groups * self.size, -1)
        return np.swapaxes(rows, -1, -2).reshape(shape)

    def export(self, w: np.ndarray, out: dict, name: str, dtype) -> None:
        """Its rows of each group of the tensor it shares (created, zeroed, by the first part written)."""
        whole = out.setdefault(name, np.zeros(self.hf_shape(w.shape), dtype))
        lead = w.shape[:self.lead]
        rows = np.swapaxes(w.reshape(*lead, w.shape[self.lead], -1), -1, -2)
        rows = rows.reshape(*lead, self.groups, self.size, -1)
        whole.reshape(*lead, self.groups, self.total, -1)[..., self.offset:self.offset + self.size, :] = rows


@dataclasses.dataclass(frozen=True)
class DepthwiseConv(Layout):
    """A depthwise Conv1d weight [C, 1, K] kept as [K, C] (Qwen3-Next's conv1d)."""

    def hf_shape(self, shape: tuple) -> tuple:
        return (shape[1], 1, shape[0])

    def to_maxtrain(self, w: np.ndarray, shape: tuple) -> np.ndarray:
        return w.reshape(w.shape[0], -1).T.reshape(shape)

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        return w.T.reshape(self.hf_shape(w.shape))
